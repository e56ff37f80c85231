"""Where a study's cells train, all from its one train stage: here (`InProcess`), in N worker processes
(`WorkerProcesses`) or on a Ray cluster (`pipelines.ray_cluster`); docs/pipeline.md, "Scaling out".

A scheduler takes `CellJob`s in the plan's order and yields `Started` and `Finished` for each cell; a cell that fails
raises `CellFailed` once the cells still training are stopped. It knows nothing of MLflow (the stage's process owns
the runs). Closing its generator stops every cell still training before it returns.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import multiprocessing
import os
import queue
import shutil
import signal
import subprocess
import time
import traceback
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from layertune.io import disk_full, disk_full_error
from pipelines.processes import die_with_parent, on_signals, terminated_as_interrupt

logger = logging.getLogger(__name__)

JOBS_ENV = "LAYERTUNE_JOBS"  # cells trained at a time on this machine (`layertune repro --jobs N` sets it)
GRACE_S = 30.0  # a stopped worker's time to end its cell (its staging folder removed) before SIGKILL


@dataclass(frozen=True)
class Started:
    key: str
    at_ms: int | None = None  # when, if not now (a cell trained elsewhere, reported as it ends)


@dataclass(frozen=True)
class Finished:
    key: str
    started_ms: int | None = None  # when it started, if the scheduler did not say so before (`Started`)


class CellFailed(RuntimeError):
    """A cell's training failed; ``cell`` is its key, the message its error."""

    def __init__(self, cell: str, message: str) -> None:
        super().__init__(f"cell {cell} failed: {message}")
        self.cell = cell

    def __reduce__(self):
        return CellFailed, (self.cell, str(self).removeprefix(f"cell {self.cell} failed: "))


@dataclass(frozen=True)
class CellJob:
    """One cell to train and where its folder goes, picklable for a worker process or a Ray node; ``build`` is the
    record its folder keeps (`pipelines.trained_cells.build_record`)."""

    cell: Any  # a `layertune.study.StudyCell`
    build: dict
    corpus: Any  # a `pipelines.datasets.SavedCorpus` (or any callable that returns the `Corpus`)
    cache_dir: Path
    cells: Any  # the study's `pipelines.trained_cells.TrainedCells`

    @property
    def key(self) -> str:
        return self.cell.key

    def run(self) -> Path:
        """The cell trained (on its prepared corpus, from the tokenize stage's caches) and its folder written."""
        from layertune.cell import train_cell

        trained = train_cell(self.cell.spec, corpus=loaded(self.corpus), cache_dir=self.cache_dir)
        return self.cells.write(self.key, trained, self.build)


@functools.lru_cache(maxsize=8)
def loaded(corpus):
    """A corpus loaded once per process: a study's cells of one task share it (training never changes it)."""
    return corpus()


# ------------------------------------------------------------------------------------------ in this process


class InProcess:
    """Every cell here, one after another."""

    description = "in this process"

    def cells(self, jobs: Sequence[CellJob]) -> Iterator[Started | Finished]:
        for job in jobs:
            yield Started(job.key)
            try:
                job.run()
            except Exception as error:  # KeyboardInterrupt (Ctrl-C, SIGTERM) goes on as it is
                if disk_full(error):  # not the cell's failure: the stage stops with it, in one line
                    raise
                raise CellFailed(job.key, f"{type(error).__name__}: {error}") from error
            yield Finished(job.key)


# ------------------------------------------------------------------------------------ N worker processes


class WorkerProcesses:
    """``jobs`` worker processes (spawned: CUDA works in them), taking the cells in the plan's order; worker i sees
    GPU ``gpus[i % len(gpus)]`` alone (``CUDA_VISIBLE_DEVICES``). Not `concurrent.futures.ProcessPoolExecutor`: its
    workers share one environment, it reports no cell as it starts, and it cannot stop a cell that runs."""

    def __init__(self, jobs: int, gpus: Sequence[str | None] = (None,)) -> None:
        if jobs < 1:
            raise ValueError(f"{JOBS_ENV}: cells trained at a time must be at least 1; got {jobs}")
        self.jobs, self.gpus = jobs, list(gpus) or [None]

    @property
    def description(self) -> str:
        on = [gpu for gpu in self.gpus if gpu is not None]
        return f"{self.jobs} at a time" + (f" on GPUs {', '.join(on)}" if on else "")

    def cells(self, jobs: Sequence[CellJob]) -> Iterator[Started | Finished]:
        context = multiprocessing.get_context("spawn")
        tasks, events = context.Queue(), context.Queue()
        count = min(self.jobs, len(jobs))
        for job in jobs:
            tasks.put(job)
        for _ in range(count):
            tasks.put(None)  # no more cells: the worker ends
        workers = []
        try:
            for index in range(count):
                gpu = self.gpus[index % len(self.gpus)]
                with _environment({"CUDA_VISIBLE_DEVICES": gpu} if gpu is not None else {}):  # read at spawn
                    worker = context.Process(target=_work, args=(index, tasks, events, os.getpid()),
                                             name=f"layertune-cell-worker-{index}", daemon=True)
                    worker.start()
                workers.append(worker)
            holding: dict[int, str] = {}  # worker index -> the cell it trains
            finished = 0
            while finished < len(jobs):
                try:
                    kind, index, key, detail = events.get(timeout=1.0)
                except queue.Empty:
                    _check_alive(workers, holding)
                    continue
                if kind == "started":
                    holding[index] = key
                    yield Started(key, detail)
                elif kind == "finished":
                    holding.pop(index, None)
                    finished += 1
                    yield Finished(key)
                elif kind == "disk full":
                    raise detail
                else:
                    raise CellFailed(key, detail)
        finally:
            _stop(workers)


def _work(index: int, tasks, events, parent: int) -> None:
    """A worker: cells from ``tasks`` until a None, each reported to ``events``. SIGTERM stops it as Ctrl-C would (a
    cell's staging folder is removed), and so does its parent's end."""
    die_with_parent(signal.SIGTERM, parent)
    # SIGINT ignored: a Ctrl-C reaches the stage too, which stops the workers itself (SIGTERM)
    with terminated_as_interrupt(), on_signals(signal.SIG_IGN, [signal.SIGINT]), \
            contextlib.suppress(KeyboardInterrupt):
        while (job := tasks.get()) is not None:
            events.put(("started", index, job.key, int(time.time() * 1000)))
            try:
                job.run()
            except Exception as error:
                if (full := disk_full_error(error)) is not None:  # not the cell's failure: said as it is
                    events.put(("disk full", index, job.key, full))
                    return
                events.put(("failed", index, job.key, f"{type(error).__name__}: {error}\n{traceback.format_exc()}"))
                return
            events.put(("finished", index, job.key, None))


def _check_alive(workers: list, holding: dict[int, str]) -> None:
    """`CellFailed` for a worker that died holding a cell (killed by the system, out of memory, ...)."""
    for index, worker in enumerate(workers):
        if index in holding and worker.exitcode is not None:
            code = worker.exitcode
            cause = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit status {code}"
            raise CellFailed(holding[index], f"its worker process ended ({cause}) while it trained")


def _stop(workers: list) -> None:
    """Every worker still alive gets SIGTERM and `GRACE_S` to stop, then SIGKILL."""
    alive = [worker for worker in workers if worker.is_alive()]
    for worker in alive:
        worker.terminate()
    deadline = time.monotonic() + GRACE_S
    for worker in alive:
        worker.join(max(deadline - time.monotonic(), 0.1))
        if worker.is_alive():
            worker.kill()
            worker.join(5)


@contextlib.contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    """``values`` in ``os.environ`` within the block (a spawned process copies the environment as it starts)."""
    before = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def devices() -> list[str | None]:
    """The GPUs workers take turns on: ``$CUDA_VISIBLE_DEVICES``, else those `nvidia-smi` lists; [None] on CPU."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [d for d in visible.split(",") if d.strip()] or [None]
    if shutil.which("nvidia-smi"):
        listed = subprocess.run(["nvidia-smi", "--list-gpus"], capture_output=True, text=True, check=False).stdout
        found = [str(i) for i, line in enumerate(listed.splitlines()) if line.startswith("GPU ")]
        if found:
            return found
    return [None]


def number_from_environment(name: str, default: int | None) -> int | None:
    """Variable ``name`` as a whole number of at least 1 (``default`` where it is unset or empty); else a
    `ValueError` naming it."""
    if not (text := os.environ.get(name)):
        return default
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"${name}={text!r}: a whole number of at least 1 is expected")
    return value
