"""``layertune repro --ray [ADDRESS]``: a study's cells as tasks on a Ray cluster; DVC keeps the record. The
driver's side (`RayCluster`); what a task does on its node is `pipelines.ray_node`.

Ray schedules, DVC records. The driver (``layertune repro`` in the user's workspace) builds the stages every cell
reads (plan … tokenize) and pushes their outputs to the DVC remote. Each changed cell is then a Ray task that trains
it on some node, in a clone of the driver's commit, and pushes its outputs and run-cache entry to the remote. The
driver then restores every cell from the run-cache (``dvc repro --pull``: nothing trains there), evaluates and
aggregates: it is the only writer of dvc.lock, and its workspace ends as after a serial build.

Faults. A task whose worker or node dies is retried by Ray (``max_retries``); an actor is not, so the build's one
actor, its gate, lives on the driver's node, which lasts as long as the build; a cell trained twice gives the same
outputs and the same run-cache entry, and the first attempt's MLflow run ends KILLED. A cell that fails is not
retried (its error would repeat): the build stops, printing the cell's log; its run ends FAILED, the other cells'
tasks are cancelled (their runs end KILLED). Ctrl-C does the same. The nodes' workspaces are removed when the build
ends, however it ends, once every cell has stopped (`pipelines.ray_node.BuildGate`): by the driver, and again by the
last cell to leave a closed build on its machine, however late.

MLflow: cells log to the driver's tracking server (a team server for a real cluster: every node must reach it). For
each study the driver opens a parent run for the build; each cell's run is its child (``mlflow.parentRunId``), so the
runs table shows a build as one row that opens into its cells. A cell whose run the server did not take comes back
as its folder, like any other, and is logged from it later (`pipelines.tracking.sync`: the study's evaluate stage,
or ``python -m pipelines.tracking sync``), outside the build's parent run.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path

from pipelines.dvc_stages import cell_stage_study
from pipelines.parallel import Interrupted, StageFailed
from pipelines.processes import STOP_SIGNALS, on_signals
from pipelines.ray_node import (
    LOG_TAIL,
    BuildGate,
    CellFailed,
    CellResult,
    NodeWorkspace,
    remove_build_folder,
    train_on_node,
)
from pipelines.tracking import BUILD_ENV, BUILD_TAG, PARENT_RUN_ENV

# Passed on to each cell's commands: where models, data and the tracking server are, and how to reach them.
FORWARDED_ENV = ("LAYERTUNE_", "MLFLOW_", "HF_", "TRANSFORMERS_", "TQDM_")
RETRIES = 3  # attempts after a worker or node died (Ray's own default, said here)


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
        check_reachable(address)
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
        self.gate = self._start_gate()
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

    def _start_gate(self):
        """The build's `BuildGate`, on the driver's node and only there (no CPU taken: a head may have none): Ray
        retries a task whose node died, not an actor, so a gate on a worker node would die with it, and with it
        every cell that calls it. The driver's node lives as long as the build does."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        here = self.ray.get_runtime_context().get_node_id()
        return self.ray.remote(BuildGate).options(
            num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(here, soft=False)).remote()

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
            raise StageFailed(f"dvc push {' '.join(stages)} failed:\n"
                              f"{push.stdout[-LOG_TAIL:]}{push.stderr[-LOG_TAIL:]}")
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

    def _cancel(self, pending: dict) -> None:
        """Every task not done is cancelled: the gate closed first (a running cell that finds it closed stops: under
        load Ray was seen not to deliver a cancel), then Ray's cancel, which raises KeyboardInterrupt in a running
        one. Either way the cell's process group is stopped (its run ends KILLED) and its workspace removed. Waits
        until Ray reports them ended (which may come before a cancelled cell has stopped its commands: `close` waits
        for those, through the gate)."""
        ray = self.ray
        print(f"layertune repro: cancelling {len(pending)} cell(s): {', '.join(sorted(pending.values()))}",
              file=sys.stderr, flush=True)
        self.gate.close.remote([node["NodeID"] for node in ray.nodes() if node["Alive"]], sorted(self.completed))
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
        with contextlib.suppress(Exception):  # the gate lost (the driver's node with it): nothing could answer
            while time.monotonic() < deadline:
                alive = [node["NodeID"] for node in ray.nodes() if node["Alive"]]
                if not ray.get(self.gate.close.remote(alive, sorted(self.completed)), timeout=30):
                    return
                time.sleep(0.5)


def _study_of(stage: str) -> str:
    return cell_stage_study(stage) or stage


@contextlib.contextmanager
def _signals_noted() -> Iterator[list[int]]:
    """Within the block SIGINT, SIGTERM and SIGHUP are only noted, in the list it yields (in the main thread)."""
    noted: list[int] = []
    with on_signals(lambda signum, frame: noted.append(signum), STOP_SIGNALS):
        yield noted


CONNECT_TIMEOUT_S = 10.0  # for the cluster's address to answer; `ray.init` itself retries for minutes
RAY_CLIENT_PORT = 10001  # Ray's default for a ray:// address without one
# An HTTP/2 client's preface and an empty SETTINGS frame (RFC 9113, 3.4): a gRPC server (Ray's GCS, Ray Client's
# server) answers with a SETTINGS frame of its own. A bare TCP connect proves less: a proxy or firewall may accept it.
HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])
SETTINGS_FRAME = 4


def check_reachable(address: str | None) -> None:
    """A `ValueError` naming ``address`` (None or "auto": $RAY_ADDRESS, if set, as Ray reads it) unless a gRPC server
    answers there within `CONNECT_TIMEOUT_S`: `ray.init` would retry an unreachable address for minutes, printing only
    its own warnings (which name the node's IP for a loopback address). "local", and no address at all: Ray looks on
    this machine, and says so itself when it finds nothing."""
    given = f"--ray {address}"
    if address in (None, "", "auto") and os.environ.get("RAY_ADDRESS"):
        address = os.environ["RAY_ADDRESS"]
        given = f"$RAY_ADDRESS={address}"
    if not address or address in ("auto", "local"):
        return
    host, port = cluster_endpoint(address, given)
    try:
        first_frame = _first_http2_frame(host, port, time.monotonic() + CONNECT_TIMEOUT_S)
    except OSError as error:
        first_frame, reason = None, (f"no answer within {CONNECT_TIMEOUT_S:.0f} s" if isinstance(error, TimeoutError)
                                     else (error.strerror or str(error)).lower())
    else:
        reason = "it answers, but not as a Ray cluster does (gRPC)"
    if first_frame != SETTINGS_FRAME:
        raise ValueError(f"{given}: no Ray cluster reachable at {host}:{port} ({reason}); check the address, and "
                         "that the head runs (ray start --head) with its port open to this machine")


def _first_http2_frame(host: str, port: int, deadline: float) -> int | None:
    """The type of the first frame the server at (host, port) sends after an HTTP/2 preface; None if it sends none."""
    with socket.create_connection((host, port), timeout=max(deadline - time.monotonic(), 0.1)) as connection:
        connection.sendall(HTTP2_PREFACE)
        header = b""
        while len(header) < 4:  # length (3 bytes), then the type
            connection.settimeout(max(deadline - time.monotonic(), 0.1))
            if not (received := connection.recv(9 - len(header))):
                return None
            header += received
        return header[3]


def cluster_endpoint(address: str, given: str) -> tuple[str, int]:
    """(host, port) of a Ray address: HOST:PORT (the head's GCS) or ray://HOST[:PORT] (Ray Client)."""
    from urllib.parse import urlsplit

    client = address.startswith("ray://")
    try:
        parts = urlsplit(address if client else f"//{address}")
        host, port = parts.hostname, parts.port or (RAY_CLIENT_PORT if client else None)
    except ValueError:  # a port that is no number
        host = port = None
    if not host or not port:
        raise ValueError(f"{given}: a Ray address is HOST:PORT (the head's, e.g. head:6379), ray://HOST[:PORT], "
                         "auto or local")
    return host, port


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
