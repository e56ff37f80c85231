"""Several cells at a time on this machine (`layertune repro --jobs N`), on DVC's own mechanisms.

`dvc repro` runs one stage at a time. DVC does allow several `dvc repro` processes on disjoint stages of one
workspace: each holds the repository lock only while it reads and records state (not while its command runs), and
locks the paths it reads and writes. So each cell that changed runs as its own
``dvc --wait-for-lock repro --single-item <cell>``, ``jobs`` at a time (each waits for the repository lock instead of
failing on it). On a machine with GPUs each worker sees one GPU (``CUDA_VISIBLE_DEVICES``), in turn. Each cell trains
exactly as in a serial build, so the results are the same, byte for byte.

Each `dvc` runs in a process group of its own, with the stage command it starts (`Children`); SIGTERM, SIGINT or
SIGHUP to the build is passed on to every group, which it waits for (then SIGKILL after a grace period); a build
killed with SIGKILL takes its `dvc` processes with it (`pipelines.processes.tied`), and they their stage commands. No
cell goes on training, orphaned, after the build was stopped. (The Ray cluster's tasks stop their cells the same way.)
"""

from __future__ import annotations

import contextlib
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed

from pipelines.processes import STOP_SIGNALS, group_alive, ignore_signals, on_signals, tied

# setsid would do too, but would also detach the group from the terminal; process_group is Python 3.11+
_OWN_GROUP = {"process_group": 0} if sys.version_info >= (3, 11) else {"start_new_session": True}


class StageFailed(RuntimeError):
    """A cell's `dvc repro` failed; its output is in the message."""


class Interrupted(Exception):
    """A signal stopped the build; every `dvc` it had started has ended."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum

    def __reduce__(self):  # pickled by its signal number (the message is not what __init__ takes)
        return Interrupted, (self.signum,)


class Children:
    """The `dvc` processes running, each in a process group of its own, which holds the stage command it starts:
    signalling the group reaches the command too (DVC itself does not pass SIGTERM on)."""

    def __init__(self, grace_s: float = 30.0) -> None:
        self.grace_s = grace_s
        self._lock = threading.Lock()
        self._running: set[subprocess.Popen] = set()
        self._signum: int | None = None  # set once stopping: no new child starts

    def run(self, command: Sequence[str], started: Callable[[int], None] | None = None,
            **popen) -> subprocess.CompletedProcess | None:
        """``subprocess.run(command)`` in a process group of its own (``started`` is called with its id); None,
        without starting it, once stopping."""
        with self._lock:  # a child starts before `stop` lists the running ones, or not at all
            if self._signum is not None:
                return None
            process = subprocess.Popen(command, **popen, **_OWN_GROUP)
            self._running.add(process)
            if started is not None:
                try:
                    started(process.pid)
                except BaseException:  # the command must not run on without what `started` set up
                    _signal_group(process.pid, signal.SIGKILL)
                    process.wait()
                    self._running.discard(process)
                    raise
        # Left listed if waiting is interrupted (a signal, in the main thread): `stop` must still reach it.
        stdout, _ = process.communicate()
        with self._lock:
            self._running.discard(process)
        return subprocess.CompletedProcess(command, process.returncode, stdout)

    def stop(self, signum: int = signal.SIGTERM) -> None:
        """``signum`` to every running child's group; wait until they are gone (SIGKILL after ``grace_s``)."""
        with self._lock:
            self._signum = signum
            running = list(self._running)
        groups = [process.pid for process in running]  # each child leads its group
        for group in groups:
            _signal_group(group, signum)
        if not _wait_gone(groups, self.grace_s):
            for group in filter(group_alive, groups):
                _signal_group(group, signal.SIGKILL)
            _wait_gone(groups, 5.0)
        with self._lock:  # reaped, so that their ids (and groups) are never signalled again once reused
            self._running.difference_update(p for p in running if p.poll() is not None)

    @contextlib.contextmanager
    def stopped_on_signal(self) -> Iterator[Children]:
        """Within the block, SIGTERM, SIGINT and SIGHUP raise `Interrupted` (in the main thread; elsewhere the
        caller's handlers stay), which stops the children before it leaves the block. Other errors let the running
        children finish."""
        def interrupt(signum: int, frame: object) -> None:
            raise Interrupted(signum)

        with on_signals(interrupt, STOP_SIGNALS):
            try:
                yield self
            except (Interrupted, KeyboardInterrupt) as error:
                ignore_signals()  # a second signal must not cut the stopping short (restored on leaving)
                self.stop(getattr(error, "signum", signal.SIGINT))
                raise


def _signal_group(group: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(group, signum)


def _wait_gone(groups: Sequence[int], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while any(map(group_alive, groups)):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


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


def run_cells(cells: Sequence[str], jobs: int, gpus: Sequence[str | None], children: Children | None = None) -> None:
    """``dvc --wait-for-lock repro --single-item <cell>`` for each cell, ``jobs`` at a time; the first failure
    stops new cells from starting and is raised once the running ones end. A signal stops the running ones
    (`Children.stopped_on_signal`) and raises `Interrupted`."""
    children = children or Children()
    free: queue.Queue = queue.Queue()
    for slot in range(jobs):
        free.put(gpus[slot % len(gpus)])

    stop = threading.Event()  # set by the first failure: cells that have not started yet do not start

    def run(cell: str) -> float | None:
        if stop.is_set():
            return None
        gpu = free.get()
        env = dict(os.environ) if gpu is None else {**os.environ, "CUDA_VISIBLE_DEVICES": gpu}
        started = time.monotonic()
        try:
            # tied: a build killed with SIGKILL takes its cells with it (`pipelines.processes`)
            completed = children.run(tied(["dvc", "--wait-for-lock", "repro", "--single-item", cell]), env=env,
                                     text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        finally:
            free.put(gpu)
        if completed is None:  # stopped by a signal before it started
            return None
        if completed.returncode:
            stop.set()
            raise StageFailed(f"{cell} failed:\n{completed.stdout[-4000:]}")
        return time.monotonic() - started

    # The signal handling is inside the pool's block: the children stop before the pool waits for its threads.
    with ThreadPoolExecutor(jobs) as pool, children.stopped_on_signal():
        futures = {pool.submit(run, cell): cell for cell in cells}
        finished = 0
        for future in as_completed(futures):  # each cell reported as it ends
            if future.exception() is not None:
                raise future.exception()  # once the running cells end (leaving the pool waits for them)
            if future.result() is not None:  # None: not started, after a failure
                finished += 1
                print(f"layertune repro: [{finished}/{len(cells)}] {futures[future]} done in {future.result():.1f} s",
                      flush=True)
