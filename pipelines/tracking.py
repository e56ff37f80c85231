"""MLflow tracking: one run per study cell, one experiment per study; a run ends FINISHED only on success, and a
tracking outage never costs a trained cell.

Runs are driven through `mlflow.MlflowClient` with explicit run ids, never mlflow's active-run globals: mlflow ends a
still-active run as FINISHED when the interpreter exits, which would mark an interrupted cell as finished.
A failed cell ends FAILED; Ctrl-C or SIGTERM (what ``kill`` and CI timeouts send) ends it KILLED.

The tracking URI is ``$MLFLOW_TRACKING_URI`` when set (a team server, say), else ``sqlite:///mlflow.db`` in the
working directory (MLflow 3 no longer accepts a plain folder as its store); artifacts of a SQLite store go to
``mlartifacts/`` beside the database.

A store that does not answer (a server that is down, or killed mid-cell) does not fail the cell: the first failed
call logs one warning, and from then on the run's calls are kept, in order, in a journal in the project,
``data/09_tracking/<experiment>/<run name>.json`` (a `PendingRun`). `sync` replays the journals of cells that have
ended once the store answers again: the next cell of the study does it as it starts, and so does
``python -m pipelines.tracking sync``. HTTP calls give up within seconds rather than MLflow's minutes
(`HTTP_RETRY_DEFAULTS`, unless you set those variables yourself).

A cell killed with SIGKILL leaves its run RUNNING. Its next run ends it KILLED (`end_abandoned_runs`); if the cell
is not trained again (DVC restored its outputs from its run-cache), `settle`, run by the evaluate stage and by
``sync``, ends it: FINISHED, with the metrics of its folder, if the folder was written after the run began and holds
that run's spec and metrics; KILLED otherwise. A cell trained again with the same spec (its earlier run FINISHED,
but DVC never recorded it, or ``dvc repro --force``) ends that earlier run KILLED once it FINISHES itself
(`end_superseded_runs`): one FINISHED run per cell.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel

logger = logging.getLogger(__name__)

DEFAULT_TRACKING_URI = "sqlite:///mlflow.db"
HOST_TAG, PID_TAG = "layertune.host", "layertune.pid"  # which process owns a run: a dead owner's run is abandoned
PARENT_RUN_ENV, PARENT_TAG = "LAYERTUNE_PARENT_RUN_ID", "mlflow.parentRunId"  # a cell's run as a build's child
BUILD_ENV, BUILD_TAG = "LAYERTUNE_BUILD", "layertune.build"  # the build a parent run and its cells' runs belong to
SPEC_TAG = "layertune.spec"  # digest of the cell's spec: which outputs are this run's (`settle`)
SUPERSEDED_TAG = "layertune.superseded_by"  # a FINISHED run whose cell was trained again: the run that did
FINISHED, FAILED, KILLED = "FINISHED", "FAILED", "KILLED"
# The kind of experiment the MLflow UI (3.x) shows: a model-training experiment opens on its runs table. Without it
# the UI guesses, and opens ours on its GenAI overview page.
EXPERIMENT_TAGS = {"mlflow.experimentKind": "custom_model_development"}
# Relative to the project folder, where every stage runs; Kedro's layer for tracking data. Not a DVC output.
JOURNAL_ROOT = Path("data") / "09_tracking"
MODELS_ROOT = Path("data") / "04_models"  # the cell folders, data/04_models/<study>/<cell> (conf/base/catalog.yml)
# MLflow's own defaults retry an unreachable server for about four minutes per call (7 retries, backoff factor 2,
# 120 s timeout). A cell keeps what it cannot log, so a few seconds are enough.
HTTP_RETRY_DEFAULTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
                       "MLFLOW_HTTP_REQUEST_BACKOFF_JITTER": "0.5", "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}
RETRY_AFTER_S = 60.0  # a store that failed is not called again by this process for this long
_failed: dict[str, float] = {}  # tracking URI -> when a call to it last failed in this process


def tracking_uri() -> str:
    return os.environ.get("MLFLOW_TRACKING_URI") or DEFAULT_TRACKING_URI


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread so that cleanup (and the run's KILLED status) happens as for Ctrl-C."""


@contextlib.contextmanager
def sigterm_raises() -> Iterator[None]:
    """Within the block, SIGTERM raises `Terminated` instead of ending the process silently (in the main thread;
    elsewhere nothing changes)."""
    from pipelines.processes import on_signals

    def handler(signum, frame):
        raise Terminated(f"received signal {signal.Signals(signum).name}")

    with on_signals(handler, [signal.SIGTERM]):
        yield


def end_status(error: BaseException | None) -> str:
    """FINISHED without an error, KILLED for an interruption (Ctrl-C, SIGTERM, exit), FAILED otherwise."""
    if error is None:
        return FINISHED
    if isinstance(error, (KeyboardInterrupt, SystemExit, GeneratorExit)):
        return KILLED
    return FAILED


# ------------------------------------------------------------------------------------------ what a run logs


class MetricRecord(BaseModel):
    key: str
    value: float
    timestamp: int
    step: int


class DatasetRecord(BaseModel):
    """A dataset input of a run (`mlflow.entities.Dataset`) and its context (training, eval)."""

    name: str
    digest: str
    source_type: str
    source: str
    data_schema: str | None = None
    profile: str | None = None
    context: str


class Operation(BaseModel):
    """One logging call of a run: a batch (params, metrics, tags), dataset inputs, or a JSON artifact. Replaying
    one is harmless: MLflow keeps a metric, a dataset or a same-valued param once, and overwrites tags and files."""

    params: dict[str, str] = {}
    metrics: list[MetricRecord] = []
    tags: dict[str, str] = {}
    datasets: list[DatasetRecord] = []
    artifact: str | None = None  # the file name `data` is logged as
    data: Any = None


class PendingRun(BaseModel):
    """What a run could not log yet: its creation (when ``run_id`` is None), its calls in order, and its end."""

    uri: str
    experiment: str
    run_name: str
    run_id: str | None = None
    start_time: int
    tags: dict[str, str]  # the run's tags at creation, its owner's host and pid included
    operations: list[Operation] = []
    status: str | None = None  # set once the cell ended
    end_time: int | None = None


def apply(client, run_id: str, operation: Operation) -> None:
    """One `Operation` on the run, in as few calls as MLflow's limits allow (1,000 metrics a batch)."""
    from mlflow.entities import Dataset, DatasetInput, InputTag, Metric, Param, RunTag

    if operation.params or operation.tags:
        client.log_batch(run_id, params=[Param(k, v) for k, v in sorted(operation.params.items())],
                         tags=[RunTag(k, v) for k, v in sorted(operation.tags.items())])
    metrics = [Metric(m.key, m.value, m.timestamp, m.step) for m in operation.metrics]
    for start in range(0, len(metrics), 1000):
        client.log_batch(run_id, metrics=metrics[start : start + 1000])
    if operation.datasets:
        client.log_inputs(run_id, [DatasetInput(
            Dataset(d.name, d.digest, d.source_type, d.source, d.data_schema, d.profile),
            tags=[InputTag("mlflow.data.context", d.context)]) for d in operation.datasets])
    if operation.artifact:
        client.log_dict(run_id, operation.data, operation.artifact)


def metric_records(metrics: Mapping[str, Any], step: int = 0, history: Iterable[Mapping[str, Any]] = ()
                   ) -> list[MetricRecord]:
    """Final ``metrics`` at ``step`` and per-epoch ``history`` records (``step`` = epoch)."""
    now = _now()
    records = [MetricRecord(key=k, value=float(v), timestamp=now, step=int(record["epoch"])) for record in history
               for k, v in sorted(record.items()) if k != "epoch" and _is_number(v)]
    return records + [MetricRecord(key=k, value=float(v), timestamp=now, step=step)
                      for k, v in sorted(metrics.items()) if _is_number(v)]


def result_operations(summary: Mapping[str, Any], history: list[Mapping[str, Any]],
                      model_path: str | None = None, run_info: Mapping[str, Any] | None = None) -> list[Operation]:
    """What a cell's results log: per-epoch history, final metrics, the model's path and the frozen-prefix cache's
    decision (tags), and the summary, history and run info (the decision's estimates) as JSON artifacts."""
    tags = {"model_path": model_path} if model_path else {}
    operations = [Operation(artifact="metrics.json", data=dict(summary)),
                  Operation(artifact="history.json", data=list(history))]
    if run_info:
        cache = run_info["frozen_prefix_cache"]
        tags.update({"frozen_prefix_cache.used": str(cache["used"]), "frozen_prefix_cache.reason": cache["reason"]})
        operations.append(Operation(artifact="run_info.json", data=dict(run_info)))
    return [Operation(metrics=metric_records(final_metrics(summary), history=history), tags=tags), *operations]


# ---------------------------------------------------------------------------------------------------- a run


class CellRun:
    """One MLflow run. Start it with :meth:`start`; :meth:`end` is idempotent (the first status wins). Once the
    store fails to answer, the run is offline: what is left to log goes to its journal (`PendingRun`)."""

    def __init__(self, pending: PendingRun, journal: Path, client=None) -> None:
        self.pending = pending
        self.journal = journal
        self.client = client  # None: offline
        self.ended: str | None = None

    @property
    def run_id(self) -> str | None:
        return self.pending.run_id

    @classmethod
    def start(cls, experiment: str, run_name: str, params: Mapping[str, Any], tags: Mapping[str, str] | None = None,
              uri: str | None = None, datasets: Iterable[DatasetRecord] = (),
              journal_root: str | Path = JOURNAL_ROOT) -> CellRun:
        """A new run ``run_name`` with ``params`` and dataset inputs; runs of the same name that a dead process left
        RUNNING end KILLED first."""
        uri = uri or tracking_uri()
        use_quick_http_retries(uri)
        owner = {HOST_TAG: socket.gethostname(), PID_TAG: str(os.getpid())}
        pending = PendingRun(uri=uri, experiment=experiment, run_name=run_name, start_time=_now(),
                             tags={**(tags or {}), **owner})
        run = cls(pending, journal_path(experiment, run_name, journal_root))
        if _reachable(uri):
            try:
                run._create()
            except Exception as error:  # whatever the store's failure (down, refusing, broken), the cell goes on
                _warn_unreachable(uri, error)
        run._log(Operation(params={k: _param_text(v) for k, v in params.items()}))
        if datasets := list(datasets):
            run._log(Operation(datasets=datasets))
        return run

    def _create(self) -> None:
        pending = self.pending
        client = connect(pending.uri)
        experiment_id = ensure_experiment(client, pending.uri, pending.experiment)
        end_abandoned_runs(client, experiment_id, pending.run_name)
        with _quiet_retries():
            run = client.create_run(experiment_id, start_time=pending.start_time, tags=pending.tags,
                                    run_name=pending.run_name)
        pending.run_id, self.client = run.info.run_id, client
        logger.info("MLflow run %s (%s) in experiment %r at %s", run.info.run_id, pending.run_name,
                    pending.experiment, pending.uri)
        local = not pending.uri.startswith(("http://", "https://"))
        logger.info("The study's runs: %s%s", runs_page(pending.uri, experiment_id),
                    f" (mlflow ui --backend-store-uri {pending.uri})" if local else "")

    def _log(self, operation: Operation) -> None:
        if self.client is not None:
            try:
                with _quiet_retries():
                    apply(self.client, self.run_id, operation)
                return
            except Exception as error:
                self._go_offline(error)
        self.pending.operations.append(operation)
        self._keep()

    def _go_offline(self, error: Exception) -> None:
        self.client = None
        _warn_unreachable(self.pending.uri, error)

    def _keep(self) -> None:
        """The journal, rewritten whole and atomically: a reader never sees half of it."""
        try:
            write_pending(self.journal, self.pending)
        except OSError as error:
            logger.error("Could not keep the MLflow run of %s in %s (%s): its tracking is lost, the cell is not",
                         self.pending.run_name, self.journal, error)

    def log_metrics(self, metrics: Mapping[str, Any], step: int = 0,
                    history: Iterable[Mapping[str, Any]] = (), tags: Mapping[str, str] | None = None) -> None:
        """Final ``metrics`` and per-epoch ``history`` records (``step`` = epoch), with ``tags``."""
        self._log(Operation(metrics=metric_records(metrics, step, history), tags=dict(tags or {})))

    def log_dict(self, data: Any, artifact_file: str) -> None:
        self._log(Operation(artifact=artifact_file, data=data))

    def log_operations(self, operations: Iterable[Operation]) -> None:
        for operation in operations:
            self._log(operation)

    def end(self, status: str) -> None:
        if self.ended is not None:
            return
        self.ended = status
        if self.client is not None:
            try:
                with _quiet_retries():
                    self.client.set_terminated(self.run_id, status=status)
                    if status == FINISHED:
                        end_superseded_runs(self.client, self.run_id, self.pending.tags)
                logger.info("MLflow run %s ended %s", self.run_id, status)
                return
            except Exception as error:
                self._go_offline(error)
        self.pending.status, self.pending.end_time = status, _now()
        self._keep()
        logger.info("MLflow run of %s ended %s, kept in %s until MLflow answers", self.pending.run_name, status,
                    self.journal)


def connect(uri: str):
    """A client whose store exists: MLflow creates (and migrates) its database when the client first opens it."""
    from mlflow import MlflowClient

    use_quick_http_retries(uri)
    with _store_lock(uri), _quiet_retries():  # cells starting together: one creates the store, the others wait
        client = MlflowClient(uri)
        client.search_experiments(max_results=1)
    return client


def ensure_experiment(client, uri: str, experiment: str) -> str:
    """The id of ``experiment``, created (with `EXPERIMENT_TAGS`) if new."""
    with _store_lock(uri), _quiet_retries():  # cells starting together: one creates the experiment
        found = client.get_experiment_by_name(experiment)
        experiment_id = found.experiment_id if found else client.create_experiment(
            experiment, artifact_location=_artifact_location(uri, experiment), tags=EXPERIMENT_TAGS)
        if found and any(found.tags.get(k) != v for k, v in EXPERIMENT_TAGS.items()):
            for key, value in EXPERIMENT_TAGS.items():  # an experiment made before the tag existed
                client.set_experiment_tag(experiment_id, key, value)
    return experiment_id


@contextlib.contextmanager
def _store_lock(uri: str) -> Iterator[None]:
    """A file lock beside a SQLite store. MLflow's creation and migration of a new database is not safe for several
    processes at once (they fail with 'table already exists'), so store creation is done by one at a time."""
    if not uri.startswith("sqlite:///"):
        yield  # a server serializes on its own
        return
    from filelock import FileLock

    database = _database(uri)
    database.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(f"{database}.lock"):
        yield


def end_abandoned_runs(client, experiment_id: str, run_name: str) -> list[str]:
    """Runs named ``run_name`` still RUNNING whose process died on this machine (a SIGKILL, a power cut) end KILLED:
    a rerun of a cell leaves one live run, never a run forever RUNNING. Returns the ids it ended."""
    ended = []
    for run in _abandoned_runs(client, experiment_id, f"attributes.run_name = '{run_name}'"):
        client.set_terminated(run.info.run_id, status=KILLED)
        ended.append(run.info.run_id)
        logger.info("MLflow run %s of %s was left RUNNING by a process that died: ended KILLED", run.info.run_id,
                    run_name)
    return ended


def end_superseded_runs(client, run_id: str, tags: Mapping[str, str]) -> list[str]:
    """Earlier FINISHED runs of the same cell and spec as ``run_id`` (just FINISHED), whose process is gone from this
    machine, end KILLED, tagged `SUPERSEDED_TAG`: DVC deleted their outputs before it trained the cell again. So a
    cell keeps one FINISHED run when a SIGKILL of `dvc repro` fell after the cell's run ended and before DVC recorded
    the stage (the rerun trains it again), and after `dvc repro --force`. Returns the ids it ended."""
    if SPEC_TAG not in tags:
        return []
    run = client.get_run(run_id)
    condition = (f"attributes.run_name = '{run.info.run_name}' and attributes.status = 'FINISHED' and "
                 f"tags.`{SPEC_TAG}` = '{tags[SPEC_TAG]}'")
    ended = []
    from layertune.io import process_alive

    for earlier in client.search_runs([run.info.experiment_id], filter_string=condition):
        if earlier.info.run_id == run_id or _owner_alive(earlier.data.tags, process_alive):
            continue
        client.set_tag(earlier.info.run_id, SUPERSEDED_TAG, run_id)
        client.set_terminated(earlier.info.run_id, status=KILLED, end_time=earlier.info.end_time)
        ended.append(earlier.info.run_id)
        logger.info("MLflow run %s of %s: the cell was trained again (run %s), its outputs replaced: ended KILLED",
                    earlier.info.run_id, run.info.run_name, run_id)
    return ended


def end_children(uri: str, parent_run_id: str) -> list[str]:
    """Children of ``parent_run_id`` still RUNNING end KILLED: once a build is over, such a run is an attempt whose
    process died on a node that is gone (its retry ran elsewhere). Returns the ids it ended."""
    ended = []
    try:
        client = connect(uri)
        with _quiet_retries():
            parent = client.get_run(parent_run_id)
            for run in client.search_runs([parent.info.experiment_id], filter_string=(
                    f"tags.`{PARENT_TAG}` = '{parent_run_id}' and attributes.status = 'RUNNING'")):
                client.set_terminated(run.info.run_id, status=KILLED)
                ended.append(run.info.run_id)
    except Exception as error:  # a store that does not answer: the runs stay as they are
        _warn_unreachable(uri, error)
    return ended


def _abandoned_runs(client, experiment_id: str, condition: str | None = None) -> list:
    from layertune.io import process_alive

    running = "attributes.status = 'RUNNING'"
    with _quiet_retries():
        runs = client.search_runs([experiment_id], filter_string=f"{condition} and {running}" if condition else running)
    return [run for run in runs if not _owner_alive(run.data.tags, process_alive)]


def _owner_alive(tags: Mapping[str, str], process_alive) -> bool:
    """Whether the process that owns a run may still be running: it does unless it is known dead on this machine
    (another machine's processes cannot be checked)."""
    host, pid = tags.get(HOST_TAG), tags.get(PID_TAG, "")
    return not (host == socket.gethostname() and pid.isdigit() and not process_alive(int(pid)))


# ------------------------------------------------------------------------------- the journal, and its replay


def journal_path(experiment: str, run_name: str, root: str | Path = JOURNAL_ROOT) -> Path:
    return Path(root) / experiment / f"{run_name}.json"


def write_pending(path: Path, pending: PendingRun) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=f".{path.name}.", delete=False) as staging:
        staging.write(pending.model_dump_json(indent=1) + "\n")
    os.replace(staging.name, path)


def sync(uri: str | None = None, experiment: str | None = None, root: str | Path = JOURNAL_ROOT) -> list[str]:
    """Replays, to ``uri``, the journals of runs kept while their store did not answer (of ``experiment``, else of
    every experiment), then removes them. A journal is replayed once its cell has ended, or its process has died
    (then its run stays RUNNING until `settle` or the cell's next run). Returns the ids of the runs it completed;
    a store that still does not answer leaves every journal in place, with one warning."""
    uri = uri or tracking_uri()
    paths = sorted(Path(root).glob(f"{experiment}/*.json" if experiment else "*/*.json"))
    if not (ready := [path for path in paths if _ready(path, uri)]) or not _reachable(uri):
        return []
    done = []
    with _sync_lock(Path(root)) as locked:
        if not locked:
            return []  # another process is replaying these journals
        try:
            client = connect(uri)
            for path in ready:
                if path.exists():  # read again: a process that held the lock before may have replayed it, or begun
                    done.append(replay(client, path, PendingRun.model_validate_json(path.read_text())))
        except Exception as error:
            _warn_unreachable(uri, error)
    return done


def _ready(path: Path, uri: str) -> PendingRun | None:
    from pydantic import ValidationError

    from layertune.io import process_alive

    try:
        pending = PendingRun.model_validate_json(path.read_text())
    except (OSError, ValidationError) as error:
        logger.warning("Skipping %s, not a journal of an MLflow run: %s", path, str(error).splitlines()[0])
        return None
    if pending.uri != uri:
        logger.info("%s is kept for MLflow at %s (set MLFLOW_TRACKING_URI to it to send it there)", path, pending.uri)
        return None
    return pending if pending.status or not _owner_alive(pending.tags, process_alive) else None


def replay(client, path: Path, pending: PendingRun) -> str:
    """One journal to its store, in order; the journal is removed once all of it is there."""
    with _quiet_retries():
        if pending.run_id is None:
            experiment_id = ensure_experiment(client, pending.uri, pending.experiment)
            pending.run_id = client.create_run(experiment_id, start_time=pending.start_time, tags=pending.tags,
                                               run_name=pending.run_name).info.run_id
            write_pending(path, pending)  # replayed again after an interruption, it must not create a second run
        for operation in pending.operations:
            apply(client, pending.run_id, operation)
        if pending.status:
            client.set_terminated(pending.run_id, status=pending.status, end_time=pending.end_time)
            if pending.status == FINISHED:
                end_superseded_runs(client, pending.run_id, pending.tags)
        if BUILD_TAG in pending.tags:
            _nest(client, pending.run_id, pending.tags)
    path.unlink()
    logger.info("MLflow run %s (%s): logged what %s kept, %s", pending.run_id, pending.run_name, path,
                pending.status or "still RUNNING (its process died)")
    return pending.run_id


def _nest(client, run_id: str, tags: Mapping[str, str]) -> None:
    """A replayed run of a build, nested as if the server had never been down: a cell's run under its build's parent
    run, or a parent run over the cells of its build that reached MLflow without a parent (the parent was kept in a
    journal when the build opened it, so the cells could not name it). Whichever comes first, the other links them."""
    experiment_id = client.get_run(run_id).info.experiment_id
    runs = client.search_runs([experiment_id], f"tags.`{BUILD_TAG}` = '{tags[BUILD_TAG]}'")
    if "dvc_stage" in tags:  # a cell's run
        parent = next((run.info.run_id for run in runs if "dvc_stage" not in run.data.tags), None)
        if parent and PARENT_TAG not in tags:
            client.set_tag(run_id, PARENT_TAG, parent)
        return
    for run in runs:
        if "dvc_stage" in run.data.tags and PARENT_TAG not in run.data.tags:
            client.set_tag(run.info.run_id, PARENT_TAG, run_id)


@contextlib.contextmanager
def _sync_lock(root: Path) -> Iterator[bool]:
    """Whether this process may replay the journals below ``root``: one process at a time does."""
    from filelock import FileLock, Timeout

    root.mkdir(parents=True, exist_ok=True)
    try:
        lock = FileLock(root / ".sync.lock").acquire(timeout=0)
    except Timeout:
        yield False
        return
    with lock:
        yield True


# ------------------------------------------------------------------------------------ runs left RUNNING


def settle(experiment: str, cells: str | Path, uri: str | None = None) -> dict[str, str]:
    """Ends the runs of ``experiment`` that a process which died on this machine left RUNNING, for cells whose
    folders are in ``cells``: FINISHED, with the folder's metrics, if the folder was written after the run began
    and holds that run's spec and final metrics (DVC restored the cell's outputs from its run-cache, so its
    training did not run again); KILLED otherwise. Returns ``{run id: status}``. Run it once every cell is settled
    (the evaluate stage does): a cell that is trained again ends its own abandoned runs."""
    uri = uri or tracking_uri()
    if (uri.startswith("sqlite:///") and not _database(uri).exists()) or not _reachable(uri):
        return {}  # no store, no run to settle
    try:
        client = connect(uri)
        with _quiet_retries():
            found = client.get_experiment_by_name(experiment)
        return _settle_runs(client, found.experiment_id, Path(cells)) if found else {}
    except Exception as error:
        _warn_unreachable(uri, error)
        return {}


def _settle_runs(client, experiment_id: str, cells: Path) -> dict[str, str]:
    from layertune.cell import CellFolder

    ended = {}
    for run in _abandoned_runs(client, experiment_id):
        folder = cells / run.info.run_name
        status = FINISHED if _outputs_of(folder, run) else KILLED
        with _quiet_retries():
            if status == FINISHED:
                cell = CellFolder(folder)
                for operation in result_operations(cell.metrics(), cell.history(), str(folder / "model"),
                                                   cell.run_info()):
                    apply(client, run.info.run_id, operation)
                client.set_tag(run.info.run_id, "layertune.settled", f"its process died; outputs found in {folder}")
            client.set_terminated(run.info.run_id, status=status)
        ended[run.info.run_id] = status
        logger.info("MLflow run %s of %s was left RUNNING by a process that died: ended %s", run.info.run_id,
                    run.info.run_name, status)
    return ended


def _outputs_of(folder: Path, run) -> bool:
    """Whether ``folder`` holds the outputs of ``run``'s cell: written after the run began (older outputs are not
    the run's), of the same spec, with its final metrics."""
    spec, metrics = folder / "cell.json", folder / "metrics.json"
    if not (spec.is_file() and metrics.is_file()):
        return False
    written = max(folder.stat().st_mtime, metrics.stat().st_mtime)  # DVC may link files, keeping their old times
    return written * 1000 >= run.info.start_time and run.data.tags.get(SPEC_TAG) == spec_digest(spec.read_text())


def spec_digest(spec) -> str:
    """A `CellSpec` (or its JSON)'s digest: equal specs, however their JSON is laid out, give the same one."""
    from layertune.specs import CellSpec

    if isinstance(spec, str):
        spec = CellSpec.model_validate_json(spec)
    return hashlib.sha256(spec.model_dump_json().encode()).hexdigest()[:16]


# ------------------------------------------------------------------------------------------- a failing store


def use_quick_http_retries(uri: str) -> None:
    """`HTTP_RETRY_DEFAULTS` for an HTTP store, each only where the environment does not set it already."""
    if uri.startswith(("http://", "https://")):
        for key, value in HTTP_RETRY_DEFAULTS.items():
            os.environ.setdefault(key, value)


def _reachable(uri: str) -> bool:
    """False for a store that failed in this process less than `RETRY_AFTER_S` ago."""
    return time.monotonic() - _failed.get(uri, -RETRY_AFTER_S) >= RETRY_AFTER_S


def _warn_unreachable(uri: str, error: BaseException) -> None:
    """One line per store and process, naming the cause (not a chain of tracebacks)."""
    warned = uri in _failed
    _failed[uri] = time.monotonic()
    if not warned:
        logger.warning("MLflow at %s failed (%s): tracking goes on offline, in %s/, and reaches MLflow once it "
                       "answers (the next cell of the study sends it, or: python -m pipelines.tracking sync)",
                       uri, _cause(error), JOURNAL_ROOT)


def _cause(error: BaseException) -> str:
    """The innermost exception of a chain, on one line: 'ConnectionRefusedError: [Errno 111] Connection refused'."""
    seen = {id(error)}
    while (inner := error.__cause__ or error.__context__) is not None and id(inner) not in seen:
        error = inner
        seen.add(id(error))
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text[:200]}" if text else type(error).__name__


@contextlib.contextmanager
def _quiet_retries() -> Iterator[None]:
    """Without urllib3's warning for each retry of an MLflow call, nor the traceback MLflow's SQL store logs for a
    database error (a read-only mlflow.db printed ~70 lines of SQLAlchemy): a failure is reported once, in one
    line, by this module (`_warn_unreachable`)."""
    quieted = {logging.getLogger("urllib3.connectionpool"): logging.ERROR,
               logging.getLogger("mlflow.store.db.utils"): logging.CRITICAL}
    levels = {logger: logger.level for logger in quieted}
    for logger, level in quieted.items():
        logger.setLevel(level)
    try:
        yield
    finally:
        for logger, level in levels.items():
            logger.setLevel(level)


# ------------------------------------------------------------------------------------------- a study's runs


def runs_page(uri: str, experiment_id: str) -> str:
    """The MLflow UI's runs table of an experiment, on the server at ``uri`` (``mlflow ui``'s for a SQLite store)."""
    base = uri if uri.startswith(("http://", "https://")) else "http://127.0.0.1:5000"
    return f"{base.rstrip('/')}/#/experiments/{experiment_id}/runs"


def experiment_name(study: str) -> str:
    """One MLflow experiment per study."""
    return f"layertune-{study}"


def cell_params(cell) -> dict[str, Any]:
    """Flat, stable parameter names for comparing a study's runs (a `layertune.study.StudyCell`): its place in the
    grid, then every setting of its spec; per-encoder settings of a combination are lists, one value per model."""
    spec = cell.spec
    encoders = [encoder.model_dump() for encoder in spec.encoders]
    per_encoder = {key: [e[key] for e in encoders] if len(encoders) > 1 else encoders[0][key] for key in encoders[0]}
    corpus = spec.corpus.model_dump()
    # The tuning method as its name and one param per setting (method_r, method_alpha, ...): comparable in the UI.
    methods = [encoder.method for encoder in spec.encoders]
    method = {"method": methods[0].name} | {f"method_{k}": v for k, v in methods[0].model_dump(exclude={"name"}).items()}
    per_encoder.pop("method")
    return {
        "study": cell.study, "task": cell.task, "encoder": cell.encoder, "tunable_layers": cell.tunable_layers,
        "seed": cell.seed, "models": per_encoder.pop("model"), "combine": spec.combine and spec.combine.method,
        **({"method_setting": cell.method} if cell.method is not None else {}), **method,
        **({"dataset": spec.corpus.source} if spec.corpus.task is None else {}),
        **{k: v for k, v in per_encoder.items() if k != "tunable_layers"},
        "train_size": corpus["train_size"], "dev_size": corpus["dev_size"], "data_seed": corpus["seed"],
        "balanced": corpus["balanced"], **spec.head.model_dump(),
        **(spec.combine.model_dump(exclude={"method"}) if spec.combine else {}),
        **spec.training.model_dump(exclude={"seed"}),
    }


def corpus_datasets(folder: str | Path, task: str) -> list[DatasetRecord]:
    """A prepared corpus's train and dev splits (``<folder>/<split>.parquet``) as dataset inputs: name
    (``<task>-<split>``), MLflow's digest of the data, the file as source, schema and row count."""
    import mlflow.data
    import pandas as pd

    records = []
    for split, context in (("train", "training"), ("dev", "eval")):
        path = Path(folder) / f"{split}.parquet"
        if not path.is_file():
            continue
        with warnings.catch_warnings():  # mlflow's hints on inferring a schema, and on its two local source kinds
            warnings.simplefilter("ignore")
            entity = mlflow.data.from_pandas(pd.read_parquet(path), source=str(path.absolute()),
                                             name=f"{task}-{split}").to_dict()  # what MLflow's entity is made of
        records.append(DatasetRecord(name=entity["name"], digest=entity["digest"], source_type=entity["source_type"],
                                     source=entity["source"], data_schema=entity.get("schema"),
                                     profile=entity.get("profile"), context=context))
    return records


def final_metrics(summary: Mapping[str, Any]) -> dict[str, float]:
    """A cell's summary as run metrics: the best epoch's scores as ``best_eval_*`` (the unprefixed names hold the
    per-epoch history), test scores, time, throughput and parameter counts as they are."""
    metrics = {}
    for key, value in summary.items():
        if not _is_number(value) or key in ("seed", "tunable_layers"):
            continue
        metrics[f"best_{key}" if key.startswith("eval_") else key] = value
    return metrics


def log_result(run: CellRun, result, model_path: str | None = None) -> None:
    """What a cell's `TrainingResult` reports: per-epoch history, final metrics, the saved model's path (a tag), and
    the summary and history as JSON artifacts."""
    run.log_operations(result_operations(result.summary(), result.history, model_path,
                                         {"frozen_prefix_cache": result.frozen_prefix_cache}))


def cell_tags(stage: str | None = None, study: str | None = None, spec=None) -> dict[str, str]:
    """The tags of a cell's run; a child of the run ``$LAYERTUNE_PARENT_RUN_ID`` names (a build on a Ray cluster
    opens one per study: `pipelines.ray_cluster`), as MLflow's nested runs are, and tagged with the build
    ``$LAYERTUNE_BUILD`` names (which nests it when the parent run could only be kept in a journal: `_nest`)."""
    tags = {"mlflow.source.type": "JOB"}
    if parent := os.environ.get(PARENT_RUN_ENV):
        tags[PARENT_TAG] = parent
    if build := os.environ.get(BUILD_ENV):
        tags[BUILD_TAG] = build
    if commit := git_commit():
        tags["mlflow.source.git.commit"] = commit
    if stage:
        tags["dvc_stage"] = stage
    if study:
        tags["study"] = study
    if spec is not None:
        tags[SPEC_TAG] = spec_digest(spec)
    return tags


def git_commit(directory: str | Path = ".") -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=directory, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def _artifact_location(uri: str, experiment: str) -> str | None:
    """Beside a SQLite database; elsewhere the server decides."""
    if not uri.startswith("sqlite:///"):
        return None
    return (_database(uri).parent / "mlartifacts" / experiment).as_uri()


def _database(uri: str) -> Path:
    return Path(uri.removeprefix("sqlite:///")).expanduser().absolute()


def _param_text(value: Any) -> str:
    return "None" if value is None else str(value)[:6000]


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _now() -> int:
    return int(time.time() * 1000)


# ------------------------------------------------------------------------------------------- command line


def main(argv: list[str] | None = None) -> int:
    """``python -m pipelines.tracking sync [--study NAME]``, in the project folder: what cells kept while MLflow did
    not answer is sent to ``$MLFLOW_TRACKING_URI`` (else ``sqlite:///mlflow.db``), and runs that killed cells left
    RUNNING are ended (see `settle`)."""
    parser = argparse.ArgumentParser(prog="python -m pipelines.tracking", description=main.__doc__)
    parser.add_argument("command", choices=["sync"])
    parser.add_argument("--study", action="append", help="only this study (repeatable; default: every study)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    uri = tracking_uri()
    studies = args.study or sorted({p.name.removeprefix("layertune-") for p in JOURNAL_ROOT.glob("layertune-*")}
                                   | {p.name for p in MODELS_ROOT.glob("*") if p.is_dir()})
    synced = [run for study in studies for run in sync(uri, experiment_name(study))]
    settled = {run: status for study in studies
               for run, status in settle(experiment_name(study), MODELS_ROOT / study, uri).items()}
    left = sorted(str(p) for study in studies for p in (JOURNAL_ROOT / experiment_name(study)).glob("*.json"))
    print(f"{len(synced)} kept run(s) sent to {uri}; {len(settled)} run(s) left RUNNING by killed cells ended "
          f"({sum(s == FINISHED for s in settled.values())} FINISHED from their saved outputs)"
          + (f"; still kept: {', '.join(left)}" if left else ""))
    return 1 if left else 0


if __name__ == "__main__":
    sys.exit(main())
