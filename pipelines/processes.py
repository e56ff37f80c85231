"""Process plumbing shared by every long-running command (a stage's `kedro run`, the warm worker, `layertune repro`,
the Ray driver): signal handlers, processes that end with their parent, liveness, and one run of a stage at a time.

A cell's training must end with the command that started it: `dvc repro` killed with SIGKILL cannot pass anything
on, and its stage command would be re-parented to init, finish, and log a FINISHED run that dvc.lock never records
(the next `dvc repro` trains the cell again). So each link of the chain asks the kernel for SIGTERM when its parent
exits (`die_with_parent`, Linux's PR_SET_PDEATHSIG, kept across exec): the warm client under `dvc`, the warm
server's fork that runs the command, and each `dvc` that `layertune repro` starts (`tied`). SIGTERM ends a cell's
MLflow run KILLED, as a Ctrl-C does. Elsewhere (not Linux) nothing is asked; `acquire_stage_lock` still keeps a
second run of the stage from starting while the first lives.

Only the standard library is imported at module level: the warm client starts in milliseconds.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path

logger = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
LOCK_FOLDER = Path("data") / ".locks"  # in the project folder; no DVC stage reads or writes it
LOCK_WAIT_S = 120.0  # a killed run ending (its run KILLED) takes seconds; a live one is reported after this


# ------------------------------------------------------------------------------------------------ signals


@contextlib.contextmanager
def on_signals(handler: Callable[[int, object], None], signums: Iterable[int] = STOP_SIGNALS) -> Iterator[bool]:
    """Within the block, ``handler(signum, frame)`` handles ``signums``; the previous handlers come back after it.
    Python installs handlers only in the main thread: elsewhere nothing changes (yields False)."""
    if threading.current_thread() is not threading.main_thread():
        yield False
        return
    previous = {signum: signal.signal(signum, handler) for signum in signums}
    try:
        yield True
    finally:
        for signum, old in previous.items():
            signal.signal(signum, old)


@contextlib.contextmanager
def signals_deferred(signums: Iterable[int] = STOP_SIGNALS) -> Iterator[None]:
    """Within the block, ``signums`` are held: noted, then sent again as it ends, to the handlers installed before
    it. A step that must not be cut in two runs whole (an MLflow run created and its owner told). A handler, not a
    blocked mask: a signal sent to the process may reach any of its threads. Main thread only."""
    received: list[int] = []
    try:
        with on_signals(lambda signum, frame: received.append(signum), signums):
            yield
    finally:
        for signum in dict.fromkeys(received):
            signal.raise_signal(signum)


def ignore_signals(signums: Iterable[int] = STOP_SIGNALS) -> None:
    """``signums`` ignored from now on (in the main thread): a second signal must not cut a cleanup short."""
    if threading.current_thread() is threading.main_thread():
        for signum in signums:
            signal.signal(signum, signal.SIG_IGN)


# ------------------------------------------------------------------------------ ending with the parent


def die_with_parent(signum: int = signal.SIGTERM, parent: int | None = None) -> bool:
    """Ask the kernel to send ``signum`` to this process when its parent exits (Linux; kept across exec, not given
    to children). ``parent``: the process id that started this one, when known: if it has exited already (before
    the request), the signal comes now. False where the platform cannot."""
    if sys.platform != "linux":
        return False
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(signum), 0, 0, 0) != 0:
        return False
    if parent is not None and os.getppid() != parent:  # re-parented already: the parent is gone
        os.kill(os.getpid(), signum)
    return True


def tied(command: Sequence[str]) -> list[str]:
    """``command`` run so that it gets SIGTERM when this process exits, even by SIGKILL (`die_with_parent`): a
    small Python start that asks for it and executes ``command``. The thread that starts it must outlive it (the
    kernel's parent is that thread): one that waits for it does."""
    if sys.platform != "linux":
        return list(command)
    return [sys.executable, "-m", "pipelines.processes", "tied", str(os.getpid()), "--", *command]


def _exec_tied(parent: int, command: Sequence[str]) -> int:
    die_with_parent(signal.SIGTERM, parent)
    try:
        os.execvp(command[0], list(command))
    except OSError as error:
        print(f"pipelines.processes: cannot run {command[0]!r}: {error}", file=sys.stderr)
        return 127


# ------------------------------------------------------------------------------------------------ liveness


def group_alive(group: int) -> bool:
    """Whether a process of process group ``group`` still runs (zombies do not count: an orphan's reaper may leave
    them)."""
    try:
        os.killpg(group, 0)  # quick, but a group of zombies still answers
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    import psutil

    for process in psutil.process_iter():
        with contextlib.suppress(psutil.Error, OSError):
            if os.getpgid(process.pid) == group and process.status() != psutil.STATUS_ZOMBIE:
                return True
    return False


# ----------------------------------------------------------------------------------- one run of a stage


class StageBusy(RuntimeError):
    """A run of the same stage lives in another process (the message names it)."""


def stage_lock_path(project: str | os.PathLike, pipelines: Sequence[str], params: Mapping[str, object]) -> Path:
    """The lock of a Kedro run of ``pipelines`` with runtime ``params`` (one DVC stage: a cell, a study's
    tokenize ...) in ``project``."""
    digest = hashlib.sha256(repr(sorted((str(k), str(v)) for k, v in params.items())).encode()).hexdigest()[:16]
    return Path(project) / LOCK_FOLDER / f"{'+'.join(pipelines) or 'default'}-{digest}.lock"


def acquire_stage_lock(path: Path, what: str, wait_s: float = LOCK_WAIT_S):
    """The lock at ``path``, acquired (a `filelock.FileLock`: ``release()`` it): a second run of the same stage waits
    (a log line names the process that holds it) up to ``wait_s`` seconds, then fails with `StageBusy`. The kernel
    releases it when the holder exits, however."""
    from filelock import FileLock, Timeout

    path.parent.mkdir(parents=True, exist_ok=True)
    holder = path.with_name(f"{path.name}.pid")  # the lock file itself is filelock's
    lock = FileLock(path)
    try:
        lock.acquire(timeout=0)
    except Timeout:
        logger.warning("%s runs already in process %s: waiting up to %.0f s for it to end", what, _read_pid(holder),
                       wait_s)
        try:
            lock.acquire(timeout=wait_s)
        except Timeout:
            pid = _read_pid(holder)
            raise StageBusy(f"{what} runs already, in process {pid} (lock {path}); wait for it to end, or stop it: "
                            f"kill {pid}") from None
    holder.write_text(f"{os.getpid()}\n")
    return lock


def _read_pid(path: Path) -> str:
    with contextlib.suppress(OSError):
        return path.read_text().strip() or "?"
    return "?"


if __name__ == "__main__":  # python -m pipelines.processes tied <parent pid> -- <command...>  (`tied`)
    if len(sys.argv) < 5 or sys.argv[1] != "tied" or sys.argv[3] != "--":
        print("usage: python -m pipelines.processes tied <parent pid> -- <command> [args...]", file=sys.stderr)
        sys.exit(2)
    sys.exit(_exec_tied(int(sys.argv[2]), sys.argv[4:]))
