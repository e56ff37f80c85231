"""train: every cell of a study's plan that is not built yet (`pipelines.trained_cells`), in the plan's order, where
`layertune repro` asked (`pipelines.scheduling`: this process, N worker processes, or a Ray cluster). Each cell's
folder is written whole as it ends, and is one MLflow run under the build's (`pipelines.tracking.StudyRuns`)."""

import contextlib
import logging
import os
import time
from pathlib import Path

from layertune.distributed import is_main_process, launched, state
from pipelines import scheduling, tracking
from pipelines.datasets import SavedCorpus
from pipelines.plans import TrainPlan
from pipelines.processes import terminated_as_interrupt
from pipelines.scheduling import CellJob, Started
from pipelines.trained_cells import TrainedCells, build_record

logger = logging.getLogger(__name__)


def train_cells(plan: TrainPlan, corpora: dict[str, SavedCorpus], cache_root: Path, cells: TrainedCells) -> None:
    from pipelines.param_checks import InvalidParams

    try:
        scheduler = scheduler_from_environment()  # first: a bad LAYERTUNE_JOBS stops the stage before any work
    except ValueError as error:
        raise InvalidParams(str(error)) from None
    data = {task: scheduling.loaded(corpora[task]).fingerprint for task in {cell.task for cell in plan.cells}}
    builds = {cell.key: build_record(cell, plan.code, data[cell.task]) for cell in plan.cells}
    build_keys = {key: build["key"] for key, build in builds.items()}
    if is_main_process():  # in a cell trained by several processes, the main one moves folders; the others wait
        cells.set_aside(builds)
        built = {cell.key for cell in plan.cells if cells.settle(cell.key, build_keys[cell.key], build_keys)}
    if launched():
        state().wait_for_everyone()
    if not is_main_process():
        built = {cell.key for cell in plan.cells if cells.is_built(cell.key, builds[cell.key]["key"])}
    todo = [cell for cell in plan.cells if cell.key not in built]
    logger.info("%s: %d of %d cell(s) to train%s", plan.study, len(todo), len(plan.cells),
                f", {scheduler.description}" if todo else "")
    jobs = [CellJob(cell, builds[cell.key], corpora[cell.task], cache_root, cells) for cell in todo]
    planned = {cell.key: cell for cell in plan.cells}
    prepared = {task: corpus.path for task, corpus in corpora.items()}
    started: dict[str, float] = {}
    with terminated_as_interrupt(), tracking.StudyRuns(plan.study, cells, planned, prepared, build_keys,
                                                        enabled=is_main_process()) as runs:
        if jobs:
            runs.open_build({"cells": len(jobs), "where": scheduler.description})
        training_since = time.monotonic()
        with contextlib.closing(scheduler.cells(jobs)) as events:
            for event in events:
                if isinstance(event, Started):
                    started[event.key] = time.monotonic()
                    runs.started(event.key, event.at_ms)
                    continue
                runs.finished(event.key, event.started_ms)
                took = f" in {time.monotonic() - started[event.key]:.1f} s" if event.key in started else ""
                logger.info("[%d/%d] %s trained%s%s", len(runs.done), len(jobs), event.key, took,
                            time_left(time.monotonic() - training_since, len(runs.done), len(jobs), plan.study))


def time_left(elapsed_s: float, done: int, total: int, study: str) -> str:
    """``; about 3.2 min left for <study>``: the cells still to train at the pace of those trained so far."""
    if done >= total:
        return f"; none left for {study}"
    seconds = elapsed_s / done * (total - done)
    return f"; about {seconds / 60:.1f} min left for {study}" if seconds >= 60 else \
        f"; about {seconds:.0f} s left for {study}"


def scheduler_from_environment():
    """Where `layertune repro` asked, through the environment, for the cells to train: on Ray (``LAYERTUNE_RAY``), in
    N worker processes (``LAYERTUNE_JOBS``), else in this process; `ValueError` naming a bad value."""
    from pipelines.ray_cluster import CPUS_ENV, RAY_ENV, RayCluster

    if (address := os.environ.get(RAY_ENV)) is not None:
        return RayCluster(address, scheduling.number_from_environment(CPUS_ENV, None))
    jobs = scheduling.number_from_environment(scheduling.JOBS_ENV, 1)
    return scheduling.InProcess() if jobs == 1 else scheduling.WorkerProcesses(jobs, scheduling.devices())
