"""``layertune repro --ray [ADDRESS]``: a study's cells as tasks on a Ray cluster, from its one train stage, whose
process is the driver (`RayCluster`); nodes need no clone, DVC or MLflow. docs/pipeline.md, "Scaling out".
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import stat
import tempfile
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from pipelines.processes import signals_noted
from pipelines.scheduling import CellFailed, CellJob, Finished, loaded

RAY_ENV = "LAYERTUNE_RAY"  # the cluster's address ("" for `ray.init`'s own choice); `layertune repro --ray` sets it
CPUS_ENV = "LAYERTUNE_CPUS_PER_CELL"  # `layertune repro --cpus-per-cell`
# Passed on to each cell: where models and data are, and how to reach them.
FORWARDED_ENV = ("LAYERTUNE_MODEL_MIRROR", "LAYERTUNE_DATA_MIRROR", "HF_", "TRANSFORMERS_", "TQDM_")
RETRIES = 3  # attempts after a worker or node died (Ray's own default, said here)
CANCEL_TIMEOUT_S = 30.0  # for cancelled cells' workers to exit before their work folders are cleaned


@dataclass(frozen=True)
class NodeJob:
    """One cell for a node; ``project`` is where relative model paths resolve (if the node sees that path)."""

    cell: object  # a `layertune.study.StudyCell`
    build: dict
    project: str
    session: str  # the build's, in the name of its work folder (`work_folder`)


@dataclass(frozen=True)
class NodeResult:
    archive: bytes  # the cell's folder (`pipelines.trained_cells.pack`)
    started_ms: int


class RayCluster:
    """The driver's side: `cells` sends every cell as a task and yields each as its folder comes back."""

    def __init__(self, address: str, cpus_per_cell: int | None = None) -> None:
        self.address, self.cpus_per_cell = address, cpus_per_cell
        self.description = f"on the Ray cluster at {address or 'the default address'}"

    def cells(self, jobs: Sequence[CellJob]) -> Iterator[Finished]:
        if not jobs:
            return
        ray = connect(self.address)
        session = uuid.uuid4().hex[:12]
        # Where to clean after the job (`_clean_nodes`): a Ray Client address as given, else the cluster's own (that
        # `ray.init` may have found or started)
        given = ray_address(self.address) or ""
        cluster = given if "://" in given else ray.get_runtime_context().gcs_address
        pending: dict = {}  # task -> its job
        try:
            with signals_noted() as signals:  # a signal inside Ray's wait would break it: checked between waits
                forwarded = {key: value for key, value in os.environ.items() if key.startswith(FORWARDED_ENV)}
                task = ray.remote(train_on_node).options(**self._resources(ray), max_retries=RETRIES,
                                                         retry_exceptions=False, runtime_env={"env_vars": forwarded})
                corpora = {}  # each corpus sent once, by reference
                for job in jobs:
                    if job.corpus not in corpora:
                        corpora[job.corpus] = ray.put(loaded(job.corpus))
                    pending[task.remote(NodeJob(job.cell, job.build, str(Path.cwd()), session),
                                        corpora[job.corpus])] = job
                while pending:
                    done, _ = ray.wait(list(pending), num_returns=1, timeout=0.5)
                    if signals:
                        raise KeyboardInterrupt(f"stopped by {signal.Signals(signals[0]).name}")
                    for ref in done:
                        job = pending.pop(ref)
                        try:
                            result = ray.get(ref)
                        except Exception as error:  # the task's own error, or a node lost more often than retried
                            cause = getattr(error, "cause", None) or error  # a RayTaskError wraps the task's error
                            raise CellFailed(job.key, f"{type(cause).__name__}: {cause}") from None
                        try:
                            job.cells.receive(job.key, result.archive, job.build["key"])
                        except ValueError as error:  # not a packed cell, or one that does not prove its build
                            raise CellFailed(job.key, str(error)) from None
                        yield Finished(job.key, result.started_ms)
        finally:
            for ref in pending:  # kills the worker of a running one: the cell trains no further
                with contextlib.suppress(Exception):
                    ray.cancel(ref, force=True)
            ray.shutdown()  # the job ends: Ray stops its workers still running, one that a cancel missed too
            if pending:
                with contextlib.suppress(Exception):  # the build's own error is the one to report
                    _clean_nodes(cluster, session)

    def _resources(self, ray) -> dict:
        """A GPU per cell where the cluster has GPUs; ``cpus_per_cell`` CPUs (default: 1 beside a GPU, else every CPU
        of the smallest node, as a build on one machine uses them)."""
        nodes = [node["Resources"] for node in ray.nodes() if node["Alive"]]
        gpus = any(node.get("GPU", 0) >= 1 for node in nodes)
        cpus = [int(node.get("CPU", 0)) for node in nodes if node.get("CPU", 0) >= 1]
        if not cpus:
            raise ValueError("the Ray cluster has no node with a CPU to train on")
        wanted = self.cpus_per_cell or (1 if gpus else min(cpus))
        if wanted > max(cpus):
            raise ValueError(f"--cpus-per-cell {wanted}: no node of the cluster has that many CPUs (they have "
                             f"{', '.join(map(str, sorted(set(cpus))))})")
        return {"num_cpus": wanted, "num_gpus": 1 if gpus else 0}


def connect(address: str):
    """Ray, connected to the cluster at ``address`` ("": `ray.init`'s own choice), once `check_reachable` passes."""
    try:
        import ray
    except ImportError:
        raise ValueError('--ray needs Ray: pip install "layertune[cluster]"') from None
    check_reachable(address or None)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # nothing leaves the cluster unasked
    ray.init(address=address or None, include_dashboard=False, log_to_driver=False, logging_level="WARNING",
             configure_logging=True)
    return ray


def _clean_nodes(cluster: str, session: str) -> None:
    """Removes the work folders that build ``session``'s killed workers left on the nodes of ``cluster``, from a job
    of its own once the build's job has ended: then none of that job's tasks can start any more, not even one a
    cancel missed (`ray.cancel` can lose the race with a task being handed to its worker). A node that does not
    answer in time keeps them until its next cell."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    try:
        ray = connect(cluster)
    except Exception:  # nothing answers (the build's own cluster, stopped), or Ray cannot connect: this machine's
        remove_work_folders(session, CANCEL_TIMEOUT_S)
        return
    try:
        clean = ray.remote(num_cpus=0)(remove_work_folders)
        tasks = [clean.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node["NodeID"], soft=False)
                               ).remote(session, CANCEL_TIMEOUT_S) for node in ray.nodes() if node["Alive"]]
        ray.wait(tasks, num_returns=len(tasks), timeout=2 * CANCEL_TIMEOUT_S)  # each node's, whatever another's does
    finally:
        ray.shutdown()


# ------------------------------------------------------------------------------------------- on a node


def node_folder() -> Path:
    """This machine's private folder for cells, created if missing; a `ValueError` unless it is a real folder of this
    user that nobody else may enter: in a shared temp folder anyone may have created that name first."""
    folder = Path(tempfile.gettempdir()) / f"layertune-ray-{os.getuid()}"
    os.makedirs(folder, mode=0o700, exist_ok=True)
    info = os.lstat(folder)
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
        raise ValueError(f"{folder} is {'a symbolic link' if stat.S_ISLNK(info.st_mode) else 'not a folder'}, not a "
                         "private folder of this user")
    if info.st_uid != os.getuid():
        raise ValueError(f"{folder} belongs to uid {info.st_uid}, not to this user (uid {os.getuid()})")
    if info.st_mode & 0o077:
        raise ValueError(f"{folder} has mode {info.st_mode & 0o777:04o}; it must be private to its user (0700)")
    return folder


def remove_work_folders(session: str | None = None, wait_s: float = 0.0) -> None:
    """The work folders of workers that are gone (killed: a cancel, or their job's end). Those of build
    ``session``'s workers still alive are waited for, up to ``wait_s``: a killed worker may still be exiting."""
    from layertune.io import remove_stale_partials

    deadline = time.monotonic() + wait_s
    while (any(f"-{session}-" in folder.name for folder in remove_stale_partials(node_folder()))
           and time.monotonic() < deadline):
        time.sleep(0.2)


def work_folder(session: str) -> tempfile.TemporaryDirectory:
    """A new folder for one cell of build ``session`` in this machine's private folder, named after its worker and
    build (for `remove_work_folders`), removed after."""
    return tempfile.TemporaryDirectory(prefix=f".cell.partial-{os.getpid()}-{session}-", dir=node_folder(),
                                       ignore_cleanup_errors=True)


def train_on_node(job: NodeJob, corpus) -> NodeResult:
    """The Ray task: the cell trained in a `work_folder`, its folder sent back."""
    from layertune.cell import train_cell
    from pipelines.trained_cells import TrainedCells, pack

    started = int(time.time() * 1000)
    remove_work_folders()
    cache_dir = os.environ.get("LAYERTUNE_CACHE") or node_folder() / "cache"
    here = Path.cwd()
    try:
        with work_folder(job.session) as name:
            work = Path(name)
            if Path(job.project).is_dir():  # a model given as a path relative to the project resolves as it did there
                os.chdir(job.project)
            check_models(job.cell)
            trained = train_cell(job.cell.spec, corpus=corpus, cache_dir=cache_dir)
            folder = TrainedCells(work, work / ".retired").write(job.cell.key, trained, job.build)
            return NodeResult(pack(folder), started)
    finally:
        os.chdir(here)


def check_models(cell) -> None:
    """Each base model of ``cell`` as this node finds it has the files the plan fingerprinted; else a `ValueError`
    naming the model and the node."""
    from layertune.model_paths import model_fingerprint

    for spec, planned in zip(cell.spec.encoders, cell.model_fingerprints):
        if planned is not None and model_fingerprint(spec.model) != planned:
            raise ValueError(f"model {spec.model!r} on node {socket.gethostname()} has other files than the plan "
                             "fingerprinted: give every node the same copy (a shared model mirror, "
                             "$LAYERTUNE_MODEL_MIRROR) or the hub")


# ------------------------------------------------------------------------------------------- the address


CONNECT_TIMEOUT_S = 10.0  # for the cluster's address to answer; `ray.init` itself retries for minutes
RAY_CLIENT_PORT = 10001  # Ray's default for a ray:// address without one
# An HTTP/2 client's preface and an empty SETTINGS frame (RFC 9113, 3.4): a gRPC server (Ray's GCS, Ray Client's
# server) answers with a SETTINGS frame of its own. A bare TCP connect proves less: a proxy or firewall may accept it.
HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])
SETTINGS_FRAME = 4


def ray_address(address: str | None) -> str | None:
    """The address `ray.init` reads for ``address``: $RAY_ADDRESS, if set, for none or "auto"."""
    if address in (None, "", "auto") and os.environ.get("RAY_ADDRESS"):
        return os.environ["RAY_ADDRESS"]
    return address


def check_reachable(address: str | None) -> None:
    """A `ValueError` naming ``address`` unless a gRPC server answers there within `CONNECT_TIMEOUT_S`: `ray.init`
    would retry for minutes, printing only its own warnings. None or "auto" mean $RAY_ADDRESS; without it, and for
    "local", nothing is checked: Ray looks on this machine, and says so itself when it finds nothing."""
    given = f"--ray {address}"
    if (resolved := ray_address(address)) != address:
        address, given = resolved, f"$RAY_ADDRESS={resolved}"
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
