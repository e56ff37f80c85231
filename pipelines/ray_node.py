"""What a Ray task of ``layertune repro --ray`` does on a node for one cell (`train_on_node`), and the build's
`BuildGate`, which knows which cells are still on the nodes' disks.

A cell runs in a workspace of its own (`NodeWorkspace`): a clone of the driver's commit with the driver's dvc.lock
and DVC remote, where ``dvc pull`` fetches the cell's inputs, ``dvc repro --pull --single-item <cell>`` trains it
(or restores it, when the remote's run-cache holds it already) and ``dvc push --run-cache`` sends its outputs and
run-cache entry back. Its commands run in a process group of their own (`pipelines.parallel.Children`), which a
cancelled task stops; a watcher process stops it if the task's worker dies (its node lost), so that no cell trains
on, orphaned, beside its retry. The workspaces of a build live in one folder per machine (with the build's
frozen-prefix cache), removed once every cell has stopped: Ray reports a cancelled task ended before it has stopped
its commands, may even start one it was asked to cancel, and under load was seen not to interrupt a running one at
all; hence the gate, which a running cell also asks about once a second whether the build goes on.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from pipelines.parallel import Children

LOG_TAIL = 6000  # characters of a failed cell's log shown by the driver
GATE_POLL_S = 1.0  # how often a running cell asks its build's gate whether the build goes on


class CellFailed(RuntimeError):
    """A cell's commands failed on its node; the message holds its log."""


@dataclass(frozen=True)
class CellResult:
    stage: str
    node: str
    seconds: float
    trained: bool  # False: restored from the remote's run-cache
    steps: dict[str, float] = field(default_factory=dict)  # seconds of each step: workspace, pull, repro, push


@dataclass(frozen=True)
class NodeWorkspace:
    """What a node needs to rebuild the driver's workspace for a cell: the commit, the driver's dvc.lock after the
    shared stages, its DVC remote (resolved: a relative path means nothing on another node) and environment."""

    repository: str  # a git URL or path every node reaches
    commit: str
    dvc_lock: str
    remote_config: str  # .dvc/config.local of the clone
    inputs: dict[str, list[str]]  # study -> the stages whose outputs its cells read
    build: str  # this build's id: the node's folders for it are `build_folder(build)`
    env: dict[str, str]

    def commands(self, stage: str, study: str) -> list[list[str]]:
        dvc = [sys.executable, "-m", "dvc"]
        return [[*dvc, "pull", "--quiet", *self.inputs[study]],
                [*dvc, "repro", "--pull", "--single-item", stage],
                [*dvc, "push", "--quiet", "--run-cache", stage]]

    def prepare(self, folder: Path) -> None:
        """``folder``: a clone of the commit with the driver's dvc.lock and remote. The frozen-prefix cache is shared
        by this build's cells on this node (each entry is written atomically); DVC's cache is not: DVC puts a pulled
        object in its cache in place (its reflink attempt creates the file empty first), so a cell pulling beside
        another can find that object present and check out an empty file (CI saw a 0-byte dev.parquet)."""
        _check(["git", "clone", "--quiet", "--no-checkout", self.repository, str(folder)], "git clone")
        _check(["git", "-C", str(folder), "checkout", "--quiet", self.commit], f"git checkout {self.commit}")
        shared = build_folder(self.build)
        (folder / ".dvc" / "config.local").write_text(  # its own cache even where the project's config names one
            f"{self.remote_config}[cache]\n    dir = {folder / '.dvc' / 'cache'}\n")
        (folder / "dvc.lock").write_text(self.dvc_lock)
        (shared / "feature-cache").mkdir(exist_ok=True)
        (folder / "data").mkdir(exist_ok=True)
        (folder / "data" / "cache").symlink_to(shared / "feature-cache", target_is_directory=True)


def train_on_node(workspace: NodeWorkspace, stage: str, study: str, env: dict[str, str], gate) -> CellResult:
    """The Ray task: ``stage`` built in a new workspace of this node, its outputs pushed; the workspace removed.
    Inside the build's `BuildGate` from before it touches the node's disk until its cleanup has ended; a task that
    finds the gate closed (Ray may start a task it was asked to cancel) does nothing. The last cell to leave a closed
    gate on its machine removes the build's folder there: the driver stops waiting for a cancelled cell after a
    while, and a cell still starting then (on a loaded machine) would write into the folder after its removal.

    Ray's own signal handling stays: a cancel raises KeyboardInterrupt here, SIGTERM exits the worker (which Ray
    counts as a worker death, and retries); either way the cell's process group is stopped first. A cancel Ray does
    not deliver (seen under load) is caught by the gate: the driver closes it before cancelling, and a running cell
    that finds it closed, or gone with the driver, stops as if cancelled."""
    import ray

    attempt = uuid.uuid4().hex
    try:
        where = Place(node=ray.get_runtime_context().get_node_id(), host=socket.gethostname())
        if not ray.get(gate.enter.remote(stage, attempt, where)):
            raise CellFailed(f"{stage}: not started, the build has ended")
        return _train_on_node(workspace, stage, study, env, _GateWatch(gate))
    finally:  # after the cell's cleanup; sent even if `enter` was interrupted (the gate takes calls in order)
        _to_the_end(_leave, gate, attempt, workspace.build)


def _leave(gate, attempt: str, build: str) -> None:
    import ray

    with contextlib.suppress(Exception):  # the driver, and the gate with it, may be gone
        if ray.get(gate.leave.remote(attempt), timeout=30):
            remove_build_folder(build)


class _GateWatch:
    """Whether the build has ended, from its gate: asked about once every `GATE_POLL_S`, never waited for (a slow
    answer from a loaded driver is no reason to stop, nor to hold up Ray's own cancel)."""

    def __init__(self, gate) -> None:
        self.gate, self.asked, self.last = gate, None, time.monotonic()

    def build_ended(self) -> bool:
        import ray

        if self.asked is None:
            if time.monotonic() - self.last >= GATE_POLL_S:
                self.asked, self.last = self.gate.is_open.remote(), time.monotonic()
            return False
        if not ray.wait([self.asked], timeout=0)[0]:
            return False
        asked, self.asked = self.asked, None
        try:
            return not ray.get(asked)
        except ray.exceptions.ActorDiedError:  # the gate is gone, with the driver or its node: so is the build
            return True
        except ray.exceptions.RayActorError:  # unavailable for now (a loaded driver node): ask again later
            return False


def _train_on_node(workspace: NodeWorkspace, stage: str, study: str, env: dict[str, str],
                   watch: _GateWatch) -> CellResult:
    import ray

    started = time.monotonic()
    children = Children(grace_s=20.0)
    log: list[str] = []
    try:
        with cell_folder(workspace.build, stage) as folder:
            try:
                workspace.prepare(folder)
                steps = {"workspace": time.monotonic() - started}
                # The stage commands call `python` and `dvc` by name: this interpreter's, however Ray was started.
                # No warm server: in a workspace that lives for one cell it would be no gain.
                path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
                env = {**os.environ, **workspace.env, **env, "PATH": path, "LAYERTUNE_WARM": "0"}
                for command in workspace.commands(stage, study):
                    began = time.monotonic()
                    done = _interruptible(watch.build_ended, children.run, command, started=_watch, cwd=folder,
                                          env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
                    if done is None:
                        raise CellFailed(f"{stage}: stopped, the build has ended")
                    steps[command[3]] = time.monotonic() - began
                    log.append(f"$ dvc {' '.join(command[3:])}\n{done.stdout}")
                    if done.returncode:
                        raise CellFailed(f"{stage} failed on {socket.gethostname()}:\n{''.join(log)[-LOG_TAIL:]}")
                return CellResult(stage=stage, node=ray.get_runtime_context().get_node_id()[:8],
                                  seconds=time.monotonic() - started, trained="Running stage" in log[1], steps=steps)
            finally:  # a cancel or an error stops the cell's commands (their runs end KILLED) before the folder goes
                _to_the_end(children.stop)
    except (KeyboardInterrupt, SystemExit, CellFailed):
        raise
    except Exception as error:  # a node that cannot make the workspace (disk full, a bad clone): the cell failed
        raise CellFailed(f"{stage} failed on {socket.gethostname()}: {type(error).__name__}: {error}\n"
                         f"{''.join(log)[-LOG_TAIL:]}") from None


@contextlib.contextmanager
def cell_folder(build: str, stage: str) -> Iterator[Path]:
    """A new folder for ``stage`` in this build's folder on this node, removed at the end (through a repeated
    cancel)."""
    folder = Path(tempfile.mkdtemp(prefix=f"{stage.replace('@', '-')}-", dir=build_folder(build)))
    try:
        yield folder
    finally:
        _to_the_end(shutil.rmtree, folder, True)


def _to_the_end(function, *args) -> None:
    """``function(*args)``, in a thread, run to its end whatever KeyboardInterrupts Ray raises here meanwhile (a
    cancel may come more than once): a cleanup cut short would leave a cell's commands running or its files behind."""
    thread = threading.Thread(target=function, args=args)
    thread.start()
    while thread.is_alive():
        with contextlib.suppress(KeyboardInterrupt):
            thread.join()


def _interruptible(build_ended: Callable[[], bool], function, *args, **kwargs):
    """``function(*args, **kwargs)`` in a thread, waited for in short slices. Ray cancels a running task by raising
    KeyboardInterrupt in its main thread, which happens between two bytecodes: not while a read of the command's
    output blocks, but between two slices here (`train_on_node` then stops the command). Once ``build_ended()``,
    checked between slices, returns None at once: the caller stops the command."""
    outcome: dict = {}

    def call() -> None:
        try:
            outcome["value"] = function(*args, **kwargs)
        except BaseException as error:  # handed to the caller
            outcome["error"] = error

    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(0.2)
        if build_ended():
            return None
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def _watch(group: int) -> None:
    """A watcher that stops process ``group`` (a cell's command) if this worker dies (its node lost, a SIGKILL): no
    cell trains on, orphaned, beside its retry. Ray stops a dead worker's own children, not their children (the
    stage command under `dvc`), so the watcher is nobody's child here: it detaches at once."""
    subprocess.run([sys.executable, "-c", _WATCHER, str(os.getpid()), str(group)], start_new_session=True,
                   stdin=subprocess.DEVNULL, check=True)


# Forks and returns at once; the fork polls the worker until the group is gone. Once the worker is gone (or a zombie),
# the group gets SIGTERM (the cell's MLflow run ends KILLED), then SIGKILL after 20 s.
_WATCHER = """
import os, signal, sys, time
import psutil
worker, group = int(sys.argv[1]), int(sys.argv[2])
if os.fork():
    os._exit(0)
def alive(pid):
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False
def group_alive():
    try:
        os.killpg(group, 0)
        return True
    except OSError:
        return False
while group_alive() and alive(worker):
    time.sleep(0.2)
for signum, wait_s in ((signal.SIGTERM, 20.0), (signal.SIGKILL, 0.0)):
    deadline = time.monotonic() + wait_s
    if group_alive():
        os.killpg(group, signum)
    while group_alive() and time.monotonic() < deadline:
        time.sleep(0.2)
"""


def build_folder(build: str) -> Path:
    """This build's folder on this node, made if missing."""
    folder = _build_path(build)
    folder.mkdir(mode=0o700, exist_ok=True)
    return folder


def _build_path(build: str) -> Path:
    """This build's folder on this node: in ``layertune-ray-<uid>`` of the temp folder, a private folder of this user
    (checked: not a symbolic link, mode 0700; in a shared temp folder anyone could have made that name first)."""
    from pipelines.warm import private_folder_at

    return private_folder_at(Path(tempfile.gettempdir()) / f"layertune-ray-{os.getuid()}") / build


def remove_build_folder(build: str) -> None:
    """This build's folder on this node, with whatever a dead worker left in it (the driver calls this once every
    cell has left the build's `BuildGate`, or it waited long enough; the last cell to leave a closed gate on a
    machine calls it there)."""
    shutil.rmtree(_build_path(build), ignore_errors=True)


@dataclass(frozen=True)
class Place:
    """Where a cell runs: its Ray node, and the machine (nodes of one machine share its temp folder)."""

    node: str
    host: str


class BuildGate:
    """A Ray actor, one per build, on the driver's node (`RayCluster._start_gate`): which cells are inside the build
    (started, their cleanup not yet ended), and where. Ray reports a cancelled task ended before the task has stopped
    its commands, and may still start a task it was asked to cancel, so the driver cannot learn from Ray when the nodes'
    folders are free to remove. It closes the gate (no cell enters any more) and waits until the cells inside have left;
    a cell that leaves a closed gate last on its machine learns so, and removes the build's folder there."""

    def __init__(self) -> None:
        self.open = True
        self.inside: dict[str, tuple[str, Place]] = {}  # attempt -> (stage, where)

    def enter(self, stage: str, attempt: str, where: Place) -> bool:
        if self.open:
            self.inside[attempt] = (stage, where)
        return self.open

    def is_open(self) -> bool:
        return self.open

    def leave(self, attempt: str) -> bool:
        """True when the gate is closed and no other cell is inside on the leaving cell's machine."""
        left = self.inside.pop(attempt, None)
        return (not self.open and left is not None
                and all(where.host != left[1].host for _, where in self.inside.values()))

    def close(self, alive: Collection[str], completed: Collection[str] = ()) -> list[tuple[str, Place]]:
        """Closed; the (stage, where) of the cells still inside, once those that will never leave are forgotten: on a
        node not ``alive``, or of a ``completed`` stage (a worker that died while Ray's retry of its cell came back:
        the retry left before its result did)."""
        self.open = False
        self.inside = {attempt: (stage, where) for attempt, (stage, where) in self.inside.items()
                       if where.node in alive and stage not in completed}
        return list(self.inside.values())


def _check(command: Sequence[str], what: str) -> None:
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        raise CellFailed(f"{what} failed on {socket.gethostname()}: {done.stderr.strip()}")
