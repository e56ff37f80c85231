"""Process plumbing for the long-running commands (a stage's `kedro run`, its workers, `layertune repro`).

A cell's training must end with the command that started it, even one killed with SIGKILL: each link of the chain
asks for SIGTERM when its parent exits (`die_with_parent`, `tied`; docs/pipeline.md, "What happens when things go
wrong"). Only the standard library is imported at module level: `tied` starts fast.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
# setsid would do too, but would also detach the group from the terminal; process_group is Python 3.11+
_OWN_GROUP = {"process_group": 0} if sys.version_info >= (3, 11) else {"start_new_session": True}


# ------------------------------------------------------------------------------------------------ signals


@contextlib.contextmanager
def on_signals(handler: Callable[[int, object], None] | signal.Handlers, signums: Iterable[int] = STOP_SIGNALS
               ) -> Iterator[bool]:
    """Within the block, ``handler`` (or `signal.SIG_IGN`) handles ``signums``; the previous handlers come back after
    it. The one place that installs signal handlers. Python installs them only in the main thread: elsewhere nothing
    changes (yields False)."""
    if threading.current_thread() is not threading.main_thread():
        yield False
        return
    previous = {signum: signal.signal(signum, handler) for signum in signums}
    try:
        yield True
    finally:
        for signum, old in previous.items():
            signal.signal(signum, old)


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP, raised in the main thread so that cleanup (a cell's staging folder removed, the runs ended
    KILLED) happens as for Ctrl-C."""


@contextlib.contextmanager
def terminated_as_interrupt(signums: Iterable[int] = (signal.SIGTERM, signal.SIGHUP)) -> Iterator[bool]:
    """Within the block, ``signums`` raise `Terminated` (main thread only)."""
    def handler(signum: int, frame: object) -> None:
        raise Terminated(f"received signal {signal.Signals(signum).name}")

    with on_signals(handler, signums) as installed:
        yield installed


@contextlib.contextmanager
def signals_noted(signums: Iterable[int] = STOP_SIGNALS) -> Iterator[list[int]]:
    """Within the block, ``signums`` are only noted, in the list it yields (main thread only): for a loop that checks
    between steps a signal must not cut (Ray's wait)."""
    noted: list[int] = []
    with on_signals(lambda signum, frame: noted.append(signum), signums):
        yield noted


@contextlib.contextmanager
def signals_deferred(signums: Iterable[int] = STOP_SIGNALS) -> Iterator[None]:
    """Within the block, ``signums`` are held, then sent again as it ends, to the handlers before it: a step that
    must not be cut in two runs whole (an MLflow call cut short leaves the store's session broken). A handler, not a
    blocked mask: a signal sent to the process may reach any of its threads. Main thread only."""
    received: list[int] = []
    try:
        with signals_noted(signums) as received:
            yield
    finally:
        for signum in dict.fromkeys(received):
            signal.raise_signal(signum)


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


# ------------------------------------------------------------------------------------------------ liveness


def group_alive(group: int) -> bool:
    """Whether a process of group ``group`` runs (zombies do not count: an orphan's reaper may leave them)."""
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


# ------------------------------------------------------------------------------------------------ children


class Interrupted(Exception):
    """A signal stopped the command; every child it had started has ended."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum

    def __reduce__(self):  # pickled by its signal number (the message is not what __init__ takes)
        return Interrupted, (self.signum,)


class Children:
    """The commands a process runs (`layertune repro`'s `dvc repro`), each in a process group of its own: signalling
    the group reaches the stage commands it starts too (DVC does not pass SIGTERM on)."""

    def __init__(self, grace_s: float = 30.0) -> None:
        self.grace_s = grace_s
        self._lock = threading.Lock()
        self._running: set[subprocess.Popen] = set()
        self._signum: int | None = None  # set once stopping: no new child starts

    def run(self, command: Sequence[str], **popen) -> subprocess.CompletedProcess | None:
        """``subprocess.run(command)`` in a process group of its own; None, without starting it, once stopping."""
        with self._lock:  # a child starts before `stop` lists the running ones, or not at all
            if self._signum is not None:
                return None
            process = subprocess.Popen(command, **popen, **_OWN_GROUP)
            self._running.add(process)
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
        """Within the block, SIGTERM, SIGINT and SIGHUP raise `Interrupted` (main thread only), which stops the
        children before it leaves the block; other errors let them finish."""
        def interrupt(signum: int, frame: object) -> None:
            raise Interrupted(signum)

        with on_signals(interrupt, STOP_SIGNALS):
            try:
                yield self
            except (Interrupted, KeyboardInterrupt) as error:
                with on_signals(signal.SIG_IGN):  # a second signal must not cut the stopping short
                    self.stop(getattr(error, "signum", signal.SIGINT))
                raise


def _signal_group(group: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(group, signum)


def _wait_gone(groups: Sequence[int], timeout_s: float) -> bool:
    # Process groups, not processes: psutil.wait_procs waits for processes it is given, and a group's are not known
    deadline = time.monotonic() + timeout_s
    while any(map(group_alive, groups)):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


# ---------------------------------------------------------------------------------- one build at a time


class BuildRunning(RuntimeError):
    """Another build of the project, or of a study, runs (the message names its process)."""


@contextlib.contextmanager
def one_build(project: Path) -> Iterator[None]:
    """The project's build lock, held within the block; `BuildRunning`, naming the holder's process, at once if
    another command holds it. The kernel releases it when the holder exits, however."""
    with _held(project, "layertune-build", lambda pid, command: f"another build of this project is running (PID "
                                                               f"{pid}); wait for it to end, or stop it: kill {pid}"):
        yield


@contextlib.contextmanager
def one_study_build(project: Path, studies: Iterable[str]) -> Iterator[None]:
    """The locks of ``studies`` held within the block, by the stage that writes their folders (each per-study stage
    its study's, the plan every study's); `BuildRunning`, naming the holder's process and command, at once if another
    process holds one. So a stage run by hand (`kedro run`) beside a build's, which would train the same cells and
    replace the build's folders, is refused: the build's own stages run one at a time (DVC's order), and
    `layertune repro`'s lock (`one_build`) is another."""
    with contextlib.ExitStack() as stack:
        for study in studies:
            stack.enter_context(_held(project, f"layertune-study-{study}", lambda pid, command, study=study: (
                f"study {study} is being built by another process (PID {pid}: {command}); wait for it to end, or "
                f"stop it: kill {pid}")))
        yield


@contextlib.contextmanager
def _held(project: Path, name: str, refusal: Callable[[str, str], str]) -> Iterator[None]:
    """Lock ``name`` of ``project`` (beside DVC's own, in .dvc/tmp), held within the block; else `BuildRunning` with
    ``refusal(pid, command)`` of the process that holds it. The kernel releases it when the holder exits, however."""
    from filelock import FileLock, Timeout

    folder = project / ".dvc" / "tmp"
    folder.mkdir(parents=True, exist_ok=True)
    holder = folder / f"{name}.pid"
    lock = FileLock(folder / f"{name}.lock")
    try:
        lock.acquire(timeout=0)
    except Timeout:
        pid = "?"
        with contextlib.suppress(OSError):
            pid = holder.read_text().strip() or "?"
        raise BuildRunning(refusal(pid, _command_of(pid))) from None
    try:
        holder.write_text(f"{os.getpid()}\n")
        yield
    finally:
        lock.release()


def _command_of(pid: str) -> str:
    """The command line of process ``pid``, its program by name (``python -m kedro run …``); "?" if unknown."""
    import psutil

    try:
        command = psutil.Process(int(pid)).cmdline()
    except (ValueError, psutil.Error):
        return "?"
    return " ".join(" ".join([Path(command[0]).name, *command[1:]]).split()) or "?"  # one line, whatever it holds


if __name__ == "__main__":  # python -m pipelines.processes tied <parent pid> -- <command...>  (`tied`)
    if len(sys.argv) < 5 or sys.argv[1] != "tied" or sys.argv[3] != "--":
        print("usage: python -m pipelines.processes tied <parent pid> -- <command> [args...]", file=sys.stderr)
        sys.exit(2)
    die_with_parent(signal.SIGTERM, int(sys.argv[2]))
    try:
        os.execvp(sys.argv[4], sys.argv[4:])
    except OSError as error:
        print(f"pipelines.processes: cannot run {sys.argv[4]!r}: {error}", file=sys.stderr)
        sys.exit(127)
