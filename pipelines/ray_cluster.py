"""``layertune repro --ray [ADDRESS]``: a study's cells as tasks on a Ray cluster; DVC keeps the record.

Ray schedules, DVC records. The driver (``layertune repro`` in the user's workspace) builds the stages every cell
reads (plan … tokenize) and pushes their outputs to the DVC remote. Each changed cell is then a Ray task that runs on
some node, in a workspace of its own (`NodeWorkspace`): a clone of the driver's commit with the driver's dvc.lock
and DVC remote, where ``dvc pull`` fetches the cell's inputs, ``dvc repro --pull --single-item <cell>`` trains it
(or restores it, when the remote's run-cache holds it already) and ``dvc push --run-cache`` sends its outputs and
run-cache entry back. The driver then restores every cell from the run-cache (``dvc repro --pull``: nothing trains
there), evaluates and aggregates: it is the only writer of dvc.lock, and its workspace ends as after a serial build.

Faults. A task whose worker or node dies is retried by Ray (``max_retries``); a cell trained twice gives the same
outputs and the same run-cache entry, and the first attempt's MLflow run ends KILLED. A cell that fails is not
retried (its error would repeat): the build stops, printing the cell's log; its run ends FAILED, the other cells'
tasks are cancelled (their runs end KILLED). Ctrl-C does the same. A cell's commands run in a process group of their
own (`pipelines.parallel.Children`), which a cancelled task stops; a watchdog process stops it if the task's worker
dies. The nodes' workspaces (and this build's DVC and frozen-prefix caches on them) are removed when the build ends,
however it ends, once every cell has stopped (`BuildGate`: a cancelled task may still be stopping its commands, or
even starting, when Ray reports it ended): by the driver, and again by the last cell to leave a closed build on its
machine, however late.

MLflow: cells log to the driver's tracking server (a team server for a real cluster: every node must reach it). For
each study the driver opens a parent run for the build; each cell's run is its child (``mlflow.parentRunId``), so the
runs table shows a build as one row that opens into its cells. A run a cell kept while the server did not answer is
sent back with the cell's result and replayed here.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from pipelines.parallel import Children, Interrupted, StageFailed
from pipelines.tracking import BUILD_ENV, BUILD_TAG, PARENT_RUN_ENV

# Passed on to each cell's commands: where models, data and the tracking server are, and how to reach them.
FORWARDED_ENV = ("LAYERTUNE_", "MLFLOW_", "HF_", "TRANSFORMERS_", "TQDM_")
LOG_TAIL = 6000  # characters of a failed cell's log shown by the driver
RETRIES = 3  # attempts after a worker or node died (Ray's own default, said here)


class CellFailed(RuntimeError):
    """A cell's commands failed on its node; the message holds its log."""


@dataclass(frozen=True)
class CellResult:
    stage: str
    node: str
    seconds: float
    trained: bool  # False: restored from the remote's run-cache
    steps: dict[str, float] = field(default_factory=dict)  # seconds of each step: workspace, pull, repro, push
    journals: dict[str, str] = field(default_factory=dict)  # runs kept while MLflow did not answer: path -> JSON


# ------------------------------------------------------------------------------------------------ on a node


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
        """``folder``: a clone of the commit with the driver's dvc.lock and remote; DVC's cache and the frozen-prefix
        cache are shared by this build's cells on this node (each writes its entries atomically)."""
        _check(["git", "clone", "--quiet", "--no-checkout", self.repository, str(folder)], "git clone")
        _check(["git", "-C", str(folder), "checkout", "--quiet", self.commit], f"git checkout {self.commit}")
        shared = build_folder(self.build)
        (folder / ".dvc" / "config.local").write_text(
            f"{self.remote_config}[cache]\n    dir = {shared / 'dvc-cache'}\n")
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
    counts as a worker death, and retries); either way the cell's process group is stopped first."""
    import ray

    attempt = uuid.uuid4().hex
    try:
        where = Place(node=ray.get_runtime_context().get_node_id(), host=socket.gethostname())
        if not ray.get(gate.enter.remote(stage, attempt, where)):
            raise CellFailed(f"{stage}: not started, the build has ended")
        return _train_on_node(workspace, stage, study, env)
    finally:  # after the cell's cleanup; sent even if `enter` was interrupted (the gate takes calls in order)
        _to_the_end(_leave, gate, attempt, workspace.build)


def _leave(gate, attempt: str, build: str) -> None:
    import ray

    with contextlib.suppress(Exception):  # the driver, and the gate with it, may be gone
        if ray.get(gate.leave.remote(attempt), timeout=30):
            remove_build_folder(build)


def _train_on_node(workspace: NodeWorkspace, stage: str, study: str, env: dict[str, str]) -> CellResult:
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
                    done = _interruptible(children.run, command, started=_watch, cwd=folder, env=env, text=True,
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
                    steps[command[3]] = time.monotonic() - began
                    log.append(f"$ dvc {' '.join(command[3:])}\n{done.stdout}")
                    if done.returncode:
                        raise CellFailed(f"{stage} failed on {socket.gethostname()}:\n{''.join(log)[-LOG_TAIL:]}")
                journals = {str(path.relative_to(folder)): path.read_text()
                            for path in sorted((folder / "data" / "09_tracking").glob("*/*.json"))}
                return CellResult(stage=stage, node=ray.get_runtime_context().get_node_id()[:8],
                                  seconds=time.monotonic() - started, trained="Running stage" in log[1],
                                  steps=steps, journals=journals)
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


def _interruptible(function, *args, **kwargs):
    """``function(*args, **kwargs)`` in a thread, waited for in short slices. Ray cancels a running task by raising
    KeyboardInterrupt in its main thread, which happens between two bytecodes: not while a read of the command's
    output blocks, but between two slices here (`train_on_node` then stops the command)."""
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
worker, group = int(sys.argv[1]), int(sys.argv[2])
if os.fork():
    os._exit(0)
def alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
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
    """A Ray actor, one per build: which cells are inside the build (started, their cleanup not yet ended), and where.
    Ray reports a cancelled task ended before the task has stopped its commands, and may still start a task it was
    asked to cancel, so the driver cannot learn from Ray when the nodes' folders are free to remove. It closes the
    gate (no cell enters any more) and waits until the cells inside have left; a cell that leaves a closed gate last
    on its machine learns so, and removes the build's folder there."""

    def __init__(self) -> None:
        self.open = True
        self.inside: dict[str, tuple[str, Place]] = {}  # attempt -> (stage, where)

    def enter(self, stage: str, attempt: str, where: Place) -> bool:
        if self.open:
            self.inside[attempt] = (stage, where)
        return self.open

    def leave(self, attempt: str) -> bool:
        """True when the gate is closed and no other cell is inside on the leaving cell's machine."""
        left = self.inside.pop(attempt, None)
        return (not self.open and left is not None
                and all(where.host != left[1].host for _, where in self.inside.values()))

    def close(self, alive: Collection[str] = (), completed: Collection[str] = ()) -> list[tuple[str, Place]]:
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


# ----------------------------------------------------------------------------------------------- the driver


class RayCluster:
    """The driver's side: `connect` checks everything a node will need before any work; `train` runs the cells and
    returns once each is in the remote's run-cache; `close` ends the build's parent runs and removes its folders on
    every node."""

    def __init__(self, ray, inputs: dict[str, list[str]], cpus_per_cell: int, gpus: bool, repository: str,
                 commit: str) -> None:
        self.ray, self.inputs, self.cpus_per_cell, self.gpus = ray, inputs, cpus_per_cell, gpus
        self.studies = list(inputs)
        self.repository, self.commit = repository, commit
        self.build = f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
        self.tracking_uri = ""  # set by `connect`: the store every cell logs to
        self.remote = ""  # set by `connect`: the default DVC remote, as the nodes' .dvc/config.local
        self.parents: dict[str, object] = {}  # study -> its build's parent run (pipelines.tracking.CellRun)
        self.gate = None  # the build's `BuildGate` actor, once cells are sent
        self.completed: set[str] = set()  # the cells whose result came back

    @classmethod
    def connect(cls, address: str | None, inputs: dict[str, list[str]],
                cpus_per_cell: int | None = None) -> RayCluster:
        """Connected to the cluster at ``address`` (None: `ray.init`'s own choice), for the studies ``inputs`` names
        (each with the stages whose outputs its cells read), once the workspace is committed,
        a DVC remote is set and the tracking store is one every node reaches; else a `ValueError` saying what to do."""
        if cpus_per_cell is not None and cpus_per_cell < 1:
            raise ValueError(f"--cpus-per-cell must be at least 1; got {cpus_per_cell}")
        try:
            import ray
        except ImportError:
            raise ValueError('--ray needs Ray: pip install "layertune[cluster]"') from None
        commit_is_clean()
        commit = git("rev-parse", "HEAD")  # what every node builds, read once
        remote = remote_config(Path.cwd())
        repository = repository_of(commit)
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # nothing leaves the cluster unasked
        ray.init(address=address, include_dashboard=False, log_to_driver=False,
                 logging_level="WARNING", configure_logging=True)
        try:
            nodes = [node for node in ray.nodes() if node["Alive"]]
            gpus = any(node["Resources"].get("GPU", 0) >= 1 for node in nodes)
            cpus = [int(node["Resources"].get("CPU", 0)) for node in nodes if node["Resources"].get("CPU", 0) >= 1]
            if not cpus:
                raise ValueError("the Ray cluster has no node with a CPU to train on")
            cpus_per_cell = cpus_per_cell or (1 if gpus else min(cpus))
            if cpus_per_cell > max(cpus):
                raise ValueError(f"--cpus-per-cell {cpus_per_cell}: no node of the cluster has that many CPUs "
                                 f"(they have {', '.join(map(str, sorted(set(cpus))))})")
            others = sorted({node["NodeManagerHostname"] for node in nodes} - {socket.gethostname()})
            uri = reachable_tracking_uri(others)
            warn_if_local_to_this_machine(others, repository, remote)
        except BaseException:
            ray.shutdown()
            raise
        cluster = cls(ray, inputs, cpus_per_cell, gpus, repository, commit)
        cluster.tracking_uri, cluster.remote = uri, remote
        return cluster

    def train(self, cells: list[str]) -> None:
        """Each cell a task; each reported as it ends, with a progress bar. Raises `StageFailed` with the log of the
        first cell that fails (or the task's error), once the other tasks are cancelled; `Interrupted` on a signal."""
        from tqdm.auto import tqdm

        ray = self.ray
        nodes = len([node for node in ray.nodes() if node["Alive"]])
        print(f"layertune repro: {len(cells)} cell(s) to train on the Ray cluster ({nodes} nodes; a cell takes "
              f"{self.cpus_per_cell} CPU{'s' if self.cpus_per_cell > 1 else ''}{' and a GPU' if self.gpus else ''})",
              flush=True)
        if not cells:
            return
        workspace = self._workspace()
        task = ray.remote(train_on_node).options(num_cpus=self.cpus_per_cell, num_gpus=1 if self.gpus else 0,
                                                 max_retries=RETRIES, retry_exceptions=False)
        self.gate = ray.remote(num_cpus=0)(BuildGate).remote()
        pending: dict = {}  # task -> its cell's stage
        # Signals are only noted from here on (`_next` raises `Interrupted`): a second Ctrl-C cannot cut the
        # cancelling short.
        with _signals_noted() as signals, tqdm(total=len(cells), unit="cell", desc="layertune repro",
                                               dynamic_ncols=True) as bar:
            try:
                for study in self.studies:
                    self.parents[study] = self._parent_run(study, sum(_study_of(stage) == study for stage in cells))
                for stage in cells:
                    parent = self.parents[_study_of(stage)].run_id
                    env = {"OMP_NUM_THREADS": str(self.cpus_per_cell), BUILD_ENV: self.build,
                           **({PARENT_RUN_ENV: parent} if parent else {})}
                    pending[task.remote(workspace, stage, _study_of(stage), env, self.gate)] = stage
                for finished in range(1, len(cells) + 1):
                    result = self._next(pending, signals)
                    self.completed.add(result.stage)
                    self._keep_journals(result)
                    bar.update()
                    steps = ", ".join(f"{step} {seconds:.1f}" for step, seconds in result.steps.items())
                    bar.write(f"layertune repro: [{finished}/{len(cells)}] {result.stage} "
                              f"{'trained' if result.trained else 'restored from the run-cache'} on node "
                              f"{result.node} in {result.seconds:.1f} s ({steps})")
            finally:
                if pending:
                    self._cancel(pending)
        if signals:  # one that came after the last cell ended
            raise Interrupted(signals[0])

    def _next(self, pending: dict, signals: list[int]) -> CellResult:
        """The next task to end, taken out of ``pending``; `Interrupted` once a signal came (checked between waits:
        an exception raised by a signal handler inside Ray's wait breaks it); `StageFailed` for a task that failed,
        whatever the cause (its cell's commands, or a node lost more often than Ray retries)."""
        while True:
            done, _ = self.ray.wait(list(pending), num_returns=1, timeout=0.5)
            if signals:
                raise Interrupted(signals[0])
            if done:
                stage = pending.pop(done[0])
                try:
                    return self.ray.get(done[0])
                except CellFailed as error:  # Ray raises the task's own error (as a subclass of both)
                    raise StageFailed(str(error.args[0]) if error.args else str(error)) from None
                except Exception as error:
                    raise StageFailed(f"{stage} failed: {type(error).__name__}: {error}") from None

    def _workspace(self) -> NodeWorkspace:
        """The shared stages' outputs pushed; what a node needs to build a cell from them."""
        inputs = self.inputs
        stages = sorted({stage for study in inputs.values() for stage in study})
        push = subprocess.run(["dvc", "push", "--quiet", *stages], capture_output=True, text=True)
        if push.returncode:
            raise StageFailed(f"dvc push {' '.join(stages)} failed:\n{push.stdout[-LOG_TAIL:]}{push.stderr[-LOG_TAIL:]}")
        env = {key: value for key, value in os.environ.items() if key.startswith(FORWARDED_ENV)}
        env["MLFLOW_TRACKING_URI"] = self.tracking_uri
        if mirror := model_mirror():
            env["LAYERTUNE_MODEL_MIRROR"] = mirror
        return NodeWorkspace(repository=self.repository, commit=self.commit, dvc_lock=Path("dvc.lock").read_text(),
                             remote_config=self.remote, inputs=inputs, build=self.build, env=env)

    def _parent_run(self, study: str, cells: int):
        from pipelines import tracking

        return tracking.CellRun.start(
            experiment=tracking.experiment_name(study), run_name=f"build {self.build}", uri=self.tracking_uri,
            params={"commit": self.commit, "studies": ",".join(self.studies), "cells": cells,
                    "cpus_per_cell": self.cpus_per_cell, "gpus_per_cell": int(self.gpus)},
            tags={**tracking.cell_tags(study=study), BUILD_TAG: self.build})

    def _keep_journals(self, result: CellResult) -> None:
        """Runs a cell kept while MLflow did not answer, written here and replayed (or kept for a later sync)."""
        from pipelines import tracking

        for path, text in result.journals.items():
            tracking.write_pending(Path(path), tracking.PendingRun.model_validate_json(text))
        if result.journals:
            tracking.sync(uri=self.tracking_uri)

    def _cancel(self, pending: dict) -> None:
        """Every task not done is cancelled: a running one gets KeyboardInterrupt, which stops its cell's process
        group (the cell's run ends KILLED) and removes its workspace. Waits until Ray reports them ended (which
        may come before a cancelled cell has stopped its commands: `close` waits for those, through the gate)."""
        ray = self.ray
        print(f"layertune repro: cancelling {len(pending)} cell(s): {', '.join(sorted(pending.values()))}",
              file=sys.stderr, flush=True)
        for ref in pending:
            ray.cancel(ref)
        ray.wait(list(pending), num_returns=len(pending), timeout=60)

    def close(self, status: str) -> None:
        """The build's parent runs end ``status`` (FINISHED, FAILED or KILLED), after a child a lost node left
        RUNNING ends KILLED; this build's folders are removed on every live node; the connection closed. Signals
        are only noted meanwhile: a second Ctrl-C cannot leave the nodes uncleaned."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from pipelines import tracking

        ray = self.ray
        with _signals_noted():
            try:
                for run in self.parents.values():
                    if run.run_id is not None:
                        tracking.end_children(self.tracking_uri, run.run_id)
                    run.end(status)
                self._wait_until_cells_left()
                remove = ray.remote(remove_build_folder)
                with contextlib.suppress(Exception):
                    ray.get([remove.options(num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(
                        node["NodeID"], soft=False)).remote(self.build) for node in ray.nodes() if node["Alive"]],
                        timeout=60)
            finally:
                ray.shutdown()


    def _wait_until_cells_left(self, timeout_s: float = 60.0) -> None:
        """The gate closed; waits until no cell is inside (`BuildGate.close` forgets those that never will leave). A
        cell still inside after ``timeout_s`` removes its machine's folder itself when it leaves, last there."""
        if self.gate is None:
            return
        ray, deadline = self.ray, time.monotonic() + timeout_s
        with contextlib.suppress(Exception):  # the gate's node lost: nothing to wait for that could answer
            while time.monotonic() < deadline:
                alive = [node["NodeID"] for node in ray.nodes() if node["Alive"]]
                if not ray.get(self.gate.close.remote(alive, sorted(self.completed)), timeout=30):
                    return
                time.sleep(0.5)


def _study_of(stage: str) -> str:
    return stage.split("@")[0].removeprefix("train-")


@contextlib.contextmanager
def _signals_noted() -> Iterator[list[int]]:
    """Within the block SIGINT, SIGTERM and SIGHUP are only noted, in the list it yields (in the main thread)."""
    noted: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield noted
        return
    previous = {signum: signal.signal(signum, lambda signum, frame: noted.append(signum))
                for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        yield noted
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def commit_is_clean() -> None:
    """The nodes build the commit: a tracked file changed here (but dvc.lock, which the driver sends), or a file the
    code stages read that git does not track, would make their cells differ from this workspace's."""
    status = subprocess.run(["git", "status", "--porcelain", "-z", "--untracked-files=all", "--", ".",
                             ":!dvc.lock"], capture_output=True, text=True, check=True).stdout
    entries, changed = iter(status.split("\0")), []
    for entry in entries:  # "XY path", NUL-separated (X may be a space); a rename's old path follows as its own entry
        if not entry:
            continue
        if entry[0] in "RC":
            next(entries, None)
        if not entry.startswith("??") or entry[3:].startswith(CODE_FOLDERS):
            changed.append(entry[3:])
    if changed:
        raise ValueError(f"--ray builds the commit on every node, and these files differ from it: {', '.join(changed)}"
                         "; commit them (or stash them) first")


CODE_FOLDERS = ("src/", "pipelines/", "conf/")  # what the plan fingerprints: an untracked file there counts


def repository_of(commit: str) -> str:
    """Where nodes clone the commit from: the ``origin`` remote when the commit is on one of its branches, else this
    repository's folder (nodes on this machine, or on a shared filesystem, reach it)."""
    origin = subprocess.run(["git", "remote", "get-url", "origin"], capture_output=True, text=True).stdout.strip()
    if origin and git("branch", "--remotes", "--list", "origin/*", "--contains", commit):
        return origin
    return str(Path(git("rev-parse", "--show-toplevel")).resolve())


def remote_config(project: Path) -> str:
    """The default DVC remote, as ``.dvc/config.local`` lines with its URL resolved (relative paths are relative to
    ``.dvc/``); a `ValueError` when there is none: nodes share outputs through it. Its options, credentials
    included, go to the nodes as they are set here."""
    from dvc.repo import Repo

    with Repo(str(project)) as repo:
        name = repo.config["core"].get("remote")
        if not name:
            raise ValueError("--ray needs a default DVC remote, which every node reaches (nodes share inputs and "
                             "outputs through it): dvc remote add -d NAME URL (docs/pipeline.md, 'Scaling out')")
        options = dict(repo.config["remote"][name])

    def text(value) -> str:
        value = str(value).lower() if isinstance(value, bool) else str(value)
        return json.dumps(value) if any(c in value for c in "#'\",") else value  # configobj's quoting

    return "".join([f"[core]\n    remote = {name}\n", f"['remote \"{name}\"']\n",
                    *(f"    {key} = {text(value)}\n" for key, value in options.items())])


def reachable_tracking_uri(other_hosts: Sequence[str]) -> str:
    """The tracking store cells log to (a relative SQLite path made absolute: cells run in other folders); a
    `ValueError` when nodes on ``other_hosts`` could not reach it: a file store, or a server on this machine's
    loopback address."""
    from urllib.parse import urlparse

    from pipelines import tracking

    uri = tracking.tracking_uri()
    if uri.startswith("sqlite:///") and not uri.startswith("sqlite:////"):
        uri = f"sqlite:///{Path(uri.removeprefix('sqlite:///')).absolute()}"
    parsed = urlparse(uri)
    local = parsed.scheme in ("", "file", "sqlite") or parsed.hostname in ("localhost", "127.0.0.1", "::1")
    if other_hosts and local:
        raise ValueError(f"MLflow's store {uri} is on this machine, which the cluster's nodes "
                         f"{', '.join(other_hosts)} cannot reach: set MLFLOW_TRACKING_URI to a server every node "
                         "reaches (docs/pipeline.md, 'A team MLflow server')")
    return uri


def warn_if_local_to_this_machine(other_hosts: Sequence[str], repository: str, remote: str) -> None:
    """One line for a repository or DVC remote that is a folder, when nodes are other machines: right on a shared
    filesystem, else every cell will fail to clone or pull."""
    if not other_hosts:
        return
    url = next((line.split("=", 1)[1].strip() for line in remote.splitlines() if line.strip().startswith("url =")), "")
    folders = [f"{what} {where}" for what, where in (("repository", repository), ("DVC remote", url))
               if "://" not in where and not where.partition(":")[0].count("@")]
    if folders:
        print(f"layertune repro: the nodes {', '.join(other_hosts)} must see {' and '.join(folders)} at the same "
              "path (a shared filesystem)", file=sys.stderr, flush=True)


def model_mirror() -> str | None:
    """``download.model_mirror`` resolved here ($LAYERTUNE_MODEL_MIRROR wins), for nodes whose workspaces are
    elsewhere: each node must have the models at that path (or reach the hub)."""
    import yaml

    from pipelines.hooks import MODEL_MIRROR_ENV, model_mirror_path

    if mirror := os.environ.get(MODEL_MIRROR_ENV):
        return mirror
    configured = ((yaml.safe_load(Path("params.yaml").read_text()) or {}).get("download") or {}).get("model_mirror")
    return model_mirror_path(configured, Path.cwd()) if configured else None


def git(*arguments: str) -> str:
    return subprocess.run(["git", *arguments], capture_output=True, text=True, check=True).stdout.strip()
