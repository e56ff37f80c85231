"""train: every cell of a study's plan that is not built yet (`pipelines.trained_cells`), in the plan's order, where
`layertune repro` asked (`pipelines.scheduling`: this process, N worker processes, or a Ray cluster). Each cell's
folder is written whole as it ends, and is one MLflow run under the build's (`pipelines.tracking.StudyRuns`)."""

import contextlib
import functools
import logging
import os
import time
from collections.abc import Mapping
from pathlib import Path

from layertune.distributed import is_main_process, launched, state
from layertune.model_paths import model_layers
from layertune.study import StudyCell, layers_key
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
    tasks = sorted({cell.task for cell in plan.cells})
    data = {task: scheduling.loaded(corpora[task]).fingerprint for task in tasks}
    text_sizes = {task: training_text_size(scheduling.loaded(corpora[task])) for task in tasks}
    builds = {cell.key: build_record(cell, plan.code, data[cell.task]) for cell in plan.cells}
    build_keys = {key: build["key"] for key, build in builds.items()}
    copied: set[str] = set()  # cells another study has built, copied here (by the main process)
    if is_main_process():  # in a cell trained by several processes, the main one moves folders; the others wait
        cells.set_aside(builds)
        built = {cell.key for cell in plan.cells if cells.settle(cell.key, build_keys[cell.key], build_keys)}
        copied = copied_from_other_studies([cell for cell in plan.cells if cell.key not in built], builds, cells)
        built |= copied
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
        if jobs or copied:
            runs.open_build({"cells": len(jobs), "where": scheduler.description,
                             **({"copied": len(copied)} if copied else {})})
        for key in sorted(copied):
            runs.copied(key)
        training_since = time.monotonic()
        took: list[tuple[StudyCell, float | None]] = []  # each cell trained in this build, and its seconds
        with contextlib.closing(scheduler.cells(jobs)) as events:
            for event in events:
                if isinstance(event, Started):
                    started[event.key] = time.monotonic()
                    runs.started(event.key, event.at_ms)
                    continue
                runs.finished(event.key, event.started_ms)
                if event.key in started:
                    seconds = time.monotonic() - started[event.key]
                else:  # a scheduler that reports a cell's start as it ends (Ray), by the clock where it trained
                    seconds = time.time() - event.started_ms / 1000 if event.started_ms else None
                took.append((planned[event.key], seconds))
                done = set(runs.done)
                left = [job.cell for job in jobs if job.cell.key not in done]
                logger.info("[%d/%d] %s trained%s%s", len(runs.done), len(jobs), event.key,
                            f" in {seconds:.1f} s" if seconds is not None else "",
                            time_left(time.monotonic() - training_since, took, left, plan.study, text_sizes))


def copied_from_other_studies(cells_to_build: list[StudyCell], builds: Mapping[str, dict],
                               cells: TrainedCells) -> set[str]:
    """The cells of ``cells_to_build`` that another study of the project has built (the same build key: spec,
    models, code and data), copied from its folder rather than trained again: the default methods study's top-K
    cells are the ablation's SST-2 cells. Returns their keys."""
    elsewhere = cells.built_elsewhere()
    copied: dict[str, Path] = {}  # cell key -> the folder it was copied from
    for cell in cells_to_build:
        build = builds[cell.key]
        if source := next((folder for folder in elsewhere.get(build["key"], [])
                           if cells.copy_built(cell.key, build, folder)), None):
            copied[cell.key] = source
    if copied:
        logger.info("%d cell(s) copied from another study's folder, the same build: %s", len(copied),
                    ", ".join(f"{key} ({source.parent.name})" for key, source in sorted(copied.items())))
    return set(copied)


def time_left(elapsed_s: float, took: list[tuple[StudyCell, float | None]], left: list[StudyCell],
              study: str, text_sizes: Mapping[str, float] | None = None) -> str:
    """``; about 3.2 min left for <study>``: the cells ``left``, each at what `expected_seconds` says from the
    cells trained so far (``took``) and the tasks' ``text_sizes`` (`training_text_size`), at this build's pace (its
    wall time per second of cell: below one with several jobs at once). With several jobs, cells still training
    count whole, so early lines say too much."""
    if not left:
        return f"; none left for {study}"
    timed = [(cell, seconds) for cell, seconds in took if seconds is not None]
    bound = False
    if timed and sum(seconds for _, seconds in timed) > 0:
        pace = elapsed_s / sum(seconds for _, seconds in timed)
        estimates = [expected_seconds(cell, timed, text_sizes) for cell in left]
        seconds = pace * sum(estimate for estimate, _ in estimates)
        bound = any(lower for _, lower in estimates)
    else:  # no cell timed (a scheduler that reports no starts): the mean cell's wall time
        seconds = elapsed_s / max(len(took), 1) * len(left)
    how = "at least" if bound else "about"
    return f"; {how} {seconds / 60:.1f} min left for {study}" if seconds >= 60 else \
        f"; {how} {seconds:.0f} s left for {study}"


def expected_seconds(cell: StudyCell, timed: list[tuple[StudyCell, float]],
                     text_sizes: Mapping[str, float] | None = None) -> tuple[float, bool]:
    """What ``cell`` should take, from the cells ``timed`` so far (at least one), and whether that is only a lower
    bound:
    - its setting's mean: the seeds of one setting cost alike;
    - else its tunable layers' (or method's) mean on the study's other tasks, times how this task's cells compare
      with theirs on the closest setting both have trained (the most layers up to the cell's: a longer input costs
      more the more layers train; for methods, the settings' mean); on a task none of whose cells has trained, as
      its training text compares with theirs (``text_sizes``);
    - else, on a study's first task, a top-K cell at its task's per-layer cost so far (`_per_layer_seconds`), or at
      least the costliest setting of the task so far: a grid trains fewer layers first (a lower bound: the log line
      then says "at least").
    """
    def mean(values):
        return sum(values) / len(values)

    def by(task: str) -> dict:
        """setting less the task → the mean seconds of ``task``'s timed cells with it"""
        found: dict = {}
        for other, seconds in timed:
            if other.task == task:
                found.setdefault(other.setting[1:], []).append(seconds)
        return {knob: mean(values) for knob, values in found.items()}

    knob, mine = cell.setting[1:], by(cell.task)
    if knob in mine:
        return mine[knob], False
    estimates = []
    for task in sorted({other.task for other, _ in timed} - {cell.task}):
        theirs = by(task)
        if knob in theirs:
            shared = sorted(mine.keys() & theirs.keys(), key=_layers_order)
            closest = [k for k in shared if _layers_order(k) <= _layers_order(knob)][-1:] or shared
            scale = mean([mine[k] / theirs[k] for k in closest]) if closest else \
                text_sizes[cell.task] / text_sizes[task] if text_sizes and text_sizes.get(task) else 1.0
            estimates.append(theirs[knob] * scale)
    if estimates:
        return mean(estimates), False
    if not mine:
        return mean([seconds for _, seconds in timed]), False
    if (per_layer := _per_layer_seconds(cell, timed)) is not None:
        return max(per_layer, max(mine.values())), False
    return max(mine.values()), True


def training_text_size(corpus) -> int:
    """Characters of text in ``corpus``'s training split (a tagged sentence's words joined): what an epoch of one
    task costs against another's before any of its cells has trained, as steps grow with examples and length."""
    return sum(len(" ".join(value)) if isinstance(value, list) else len(str(value))
               for column in corpus.text_columns for value in corpus.train[column])


def _top_k_layers(cell: StudyCell) -> int | None:
    """How many layers ``cell`` trains whole (top-K, one language model), 'all' as the model's layer count; None for
    another method, a combination, or a model whose config cannot be read."""
    if len(cell.spec.encoders) != 1 or cell.spec.encoders[0].method.name != "top_k":
        return None
    if cell.tunable_layers != "all":
        return cell.tunable_layers
    return _layer_count(cell.spec.encoders[0].model, cell.spec.encoders[0].revision)


@functools.lru_cache(maxsize=64)
def _layer_count(model: str, revision: str | None) -> int | None:
    """`model_layers`, read once per model: the time-left estimate asks on every cell line."""
    with contextlib.suppress(Exception):
        return model_layers(model, revision=revision)
    return None


def _per_layer_seconds(cell: StudyCell, timed: list[tuple[StudyCell, float]]) -> float | None:
    """``cell``'s seconds at the per-layer cost of its task's and encoder's timed top-K cells (of one layer or more):
    a top-K cell's step costs about its number of tuned layers (the frozen ones run once, from the cache), and
    early stopping ends most after a like number of epochs. None where nothing of the kind was timed."""
    layers = _top_k_layers(cell)
    rates = [seconds / k for other, seconds in timed if other.task == cell.task and other.encoder == cell.encoder
             and (k := _top_k_layers(other))]
    return layers * sum(rates) / len(rates) if layers and rates else None


def _layers_order(knob: tuple) -> tuple:
    """(encoder, tunable layers or method) in the order a grid trains them: fewer layers first, 'all' last; a
    method, by name, after every number of layers."""
    encoder, value = knob
    if isinstance(value, int) or value == "all":
        return encoder, False, *layers_key(value), ""
    return encoder, True, False, 0, str(value)


def scheduler_from_environment():
    """Where `layertune repro` asked, through the environment, for the cells to train: on Ray (``LAYERTUNE_RAY``), in
    N worker processes (``LAYERTUNE_JOBS``), else in this process; `ValueError` naming a bad value."""
    from pipelines.ray_cluster import CPUS_ENV, RAY_ENV, RayCluster

    if (address := os.environ.get(RAY_ENV)) is not None:
        return RayCluster(address, scheduling.number_from_environment(CPUS_ENV, None))
    jobs = scheduling.number_from_environment(scheduling.JOBS_ENV, 1)
    return scheduling.InProcess() if jobs == 1 else scheduling.WorkerProcesses(jobs, scheduling.devices())
