"""MLflow tracking: the cell folder is the record, and MLflow shows it. One run per study cell, one experiment per
study; a run ends FINISHED only once its cell's folder is saved, and a tracking outage never costs a trained cell.

A cell's run opens as the cell starts (RUNNING, with its parameters and dataset inputs, so the UI shows what
trains). Once the folder is saved, `log_cell` projects it onto the run: per-epoch history, final metrics, the
model's path and the frozen-prefix cache's decision (tags), and the folder's summary, history and run info as
artifacts. Then the run ends FINISHED. A failed cell ends FAILED; Ctrl-C or SIGTERM (what ``kill`` and CI timeouts
send) ends it KILLED.

Runs are driven through `mlflow.MlflowClient` with explicit run ids, never mlflow's active-run globals: mlflow ends a
still-active run as FINISHED when the interpreter exits, which would mark an interrupted cell as finished.

Whatever MLflow could not take is logged later, from the folder, by `sync`. Three callers run it: the next cell of
the study as it starts, the evaluate stage before it reads the cells, and ``python -m pipelines.tracking sync``.
It finds each folder's run by the cell's name and its spec's digest (`SPEC_TAG`; for a folder saved in an earlier
form of the spec, the digest its run was tagged with then matches too):
- a FINISHED run: the folder is logged already, so syncing again changes nothing;
- a run that nobody is left to end (`_Abandoned`: its process died on this machine, or, for a Ray cell, its build's
  parent run has ended) and that began before the folder was written: completed from the folder;
- none: a run is created from the folder.
Any other abandoned RUNNING run ends KILLED. So a server that is down
for a whole build, a killed cell, or outputs that DVC restored from its run-cache all end with one FINISHED run per
cell and none RUNNING. A cell trained again with the same spec (its earlier run FINISHED, but DVC never recorded
it, or ``dvc repro --force``) ends that earlier run KILLED once it FINISHES itself (`end_superseded_runs`).

The tracking URI is ``$MLFLOW_TRACKING_URI`` when set (a team server, say), else ``sqlite:///mlflow.db`` in the
working directory (MLflow 3 no longer accepts a plain folder as its store); artifacts of a SQLite store go to
``mlartifacts/`` beside the database. A store that does not answer costs one warning line per process, and HTTP
calls give up within seconds rather than MLflow's minutes (`HTTP_RETRY_DEFAULTS`, unless you set those variables).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import warnings
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

DEFAULT_TRACKING_URI = "sqlite:///mlflow.db"
HOST_TAG, PID_TAG = "layertune.host", "layertune.pid"  # which process owns a run: a dead owner's run is abandoned
PARENT_RUN_ENV, PARENT_TAG = "LAYERTUNE_PARENT_RUN_ID", "mlflow.parentRunId"  # a cell's run as a build's child
BUILD_ENV, BUILD_TAG = "LAYERTUNE_BUILD", "layertune.build"  # the build a parent run and its cells' runs belong to
SPEC_TAG = "layertune.spec"  # digest of the cell's spec: which folder is this run's (`sync`)
SUPERSEDED_TAG = "layertune.superseded_by"  # a FINISHED run whose cell was trained again: the run that did
LOGGED_FROM_TAG = "layertune.logged_from"  # a run created by `sync` from a folder MLflow had not seen
FINISHED, FAILED, KILLED = "FINISHED", "FAILED", "KILLED"
# The kind of experiment the MLflow UI (3.x) shows: a model-training experiment opens on its runs table. Without it
# the UI guesses, and opens ours on its GenAI overview page.
EXPERIMENT_TAGS = {"mlflow.experimentKind": "custom_model_development"}
# Relative to the project folder, where every stage runs (conf/base/catalog.yml): the cell folders, their specs in
# the study's grid, and their prepared data (a run created from a folder logs these as its parameters and inputs).
MODELS_ROOT, PLANS_ROOT, PREPARED_ROOT = (Path("data") / "04_models", Path("data") / "00_plan",
                                         Path("data") / "02_prepared")
SYNC_LOCKS = Path("data") / ".locks"  # one process at a time syncs an experiment (`sync`)
# MLflow's own defaults retry an unreachable server for about four minutes per call (7 retries, backoff factor 2,
# 120 s timeout). What a run cannot log now is logged later from the cell's folder, so a few seconds are enough.
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


# ---------------------------------------------------------------------------------------------------- a run


class CellRun:
    """One MLflow run. `start` opens it (without a ``run_id`` when the store did not answer: nothing is kept then,
    `sync` logs the cell's folder later); `finish` logs the saved folder onto it and ends it FINISHED; `end` ends it
    with a status. The first ending wins."""

    def __init__(self, uri: str, experiment: str, run_name: str) -> None:
        self.uri, self.experiment, self.run_name = uri, experiment, run_name
        self.client = None
        self.run = None  # the `mlflow.entities.Run` as created
        self.ended: str | None = None

    @property
    def run_id(self) -> str | None:
        return self.run.info.run_id if self.run is not None else None

    @classmethod
    def start(cls, experiment: str, run_name: str, params: Mapping[str, Any], tags: Mapping[str, str] | None = None,
              uri: str | None = None, datasets: Iterable = ()) -> CellRun:
        """A new run ``run_name`` with ``params`` and dataset inputs (`corpus_datasets`); runs of the same name that a
        dead process left RUNNING end KILLED first."""
        run = cls(uri or tracking_uri(), experiment, run_name)
        use_quick_http_retries(run.uri)
        if not _reachable(run.uri):
            return run
        try:
            client = connect(run.uri)
            experiment_id = ensure_experiment(client, run.uri, experiment)
            with _quiet_retries():
                end_abandoned_runs(client, experiment_id, run_name)
                run.run = client.create_run(experiment_id, tags={**(tags or {}), **_owner()}, run_name=run_name)
                run.client = client
                _log_params(client, run.run_id, params)
                if datasets := list(datasets):
                    client.log_inputs(run.run_id, datasets)
        except Exception as error:  # whatever the store's failure (down, refusing, broken), the cell goes on
            _warn_unreachable(run.uri, error)
            return run
        local = not run.uri.startswith(("http://", "https://"))
        logger.info("MLflow run %s (%s) in experiment %r at %s; the study's runs: %s%s", run.run_id, run_name,
                    experiment, run.uri, runs_page(run.uri, experiment_id),
                    f" (mlflow ui --backend-store-uri {run.uri})" if local else "")
        return run

    def finish(self, folder: str | Path) -> None:
        """The saved cell ``folder`` logged onto the run (`log_cell`), which ends FINISHED. Without a run (the store
        did not answer as the cell started), the folder's study is synced instead: whatever the store takes now."""
        if self.ended is None and self.run is None:
            self.ended = FINISHED
            sync(self.experiment, Path(folder).parent, self.uri)
        elif self.ended is None and self._call(log_cell, self.run, SavedCell.read(folder)):
            self.end(FINISHED)

    def end(self, status: str) -> None:
        """Ends the run ``status``; FINISHED also ends earlier FINISHED runs of the same cell and spec KILLED
        (`end_superseded_runs`)."""
        if self.ended is not None:
            return
        self.ended = status
        if self._call(lambda client: client.set_terminated(self.run_id, status=status)):
            if status == FINISHED:
                self._call(end_superseded_runs, self.run_id, self.run.data.tags)
            logger.info("MLflow run %s ended %s", self.run_id, status)

    def _call(self, function, *args) -> bool:
        """``function(client, *args)``, unless the store failed (then, or a moment ago): a warning, no error."""
        if self.client is None or not _reachable(self.uri):
            return False
        try:
            with _quiet_retries():
                function(self.client, *args)
            return True
        except Exception as error:
            _warn_unreachable(self.uri, error)
            return False


# ------------------------------------------------------------------------------ a cell folder, projected


@dataclass(frozen=True)
class SavedCell:
    """What a saved cell folder holds for MLflow, read at once: a folder that is replaced or removed meanwhile is
    an `OSError` or `ValueError` here, never a run logged from half of it."""

    folder: Path  # absolute: every caller logs the same model path
    spec: Any  # its `layertune.specs.CellSpec`
    summary: dict
    history: list
    run_info: dict
    written_ms: int  # when it was written (the folder's or its metrics' time, whichever is later)
    stored_digest: str  # of its cell.json as written: a run tagged by an earlier form of the spec matches it

    @classmethod
    def read(cls, folder: str | Path) -> SavedCell:
        from layertune.cell import CellFolder
        from layertune.specs import CellSpec

        folder = Path(folder).resolve()
        cell = CellFolder(folder)
        written = max(folder.stat().st_mtime, (folder / "metrics.json").stat().st_mtime)  # DVC may keep old times
        text = (folder / "cell.json").read_text()  # read once: the spec and its digest as written are of one file
        spec = CellSpec.model_validate_json(text)
        return cls(folder, spec, cell.metrics(), cell.history(), cell.run_info(), int(written * 1000),
                   _json_digest(json.loads(text)))

    @property
    def digest(self) -> str:
        return spec_digest(self.spec)

    @property
    def digests(self) -> set[str]:
        """The digests a run of this folder may be tagged with: its spec's, and its cell.json's as written."""
        return {self.digest, self.stored_digest}


def log_cell(client, run, saved: SavedCell) -> None:
    """A saved cell projected onto ``run`` (an `mlflow.entities.Run`): per-epoch history (step = epoch) and final
    metrics (`final_metrics`); the model's path and the frozen-prefix cache's decision, and why, as tags; the
    folder's ``metrics.json``, ``history.json`` and ``run_info.json`` as artifacts. Logging it again changes
    nothing: every value carries the run's start time, and MLflow keeps an equal metric, tag or file once."""
    from mlflow.entities import Metric, RunTag

    run_id, when = run.info.run_id, run.info.start_time
    metrics = [Metric(key, float(value), when, int(record["epoch"])) for record in saved.history
               for key, value in sorted(record.items()) if key != "epoch" and _is_number(value)]
    metrics += [Metric(key, float(value), when, 0) for key, value in sorted(final_metrics(saved.summary).items())]
    tags = {"model_path": str(saved.folder / "model")}
    if cache := saved.run_info.get("frozen_prefix_cache"):
        tags |= {"frozen_prefix_cache.used": str(cache["used"]), "frozen_prefix_cache.reason": cache["reason"]}
    client.log_batch(run_id, tags=[RunTag(key, value) for key, value in sorted(tags.items())])
    for start in range(0, len(metrics), 1000):  # MLflow takes at most 1,000 metrics a call
        client.log_batch(run_id, metrics=metrics[start : start + 1000])
    for name, data in (("metrics.json", saved.summary), ("history.json", saved.history),
                       ("run_info.json", saved.run_info)):
        if data:
            client.log_dict(run_id, data, name)


def sync(experiment: str, cells: str | Path, uri: str | None = None, wait_s: float = 0) -> dict[str, str]:
    """Brings ``experiment`` up to date with the cell folders right below ``cells`` (see the module's docstring):
    every saved folder gets a FINISHED run of its spec, and runs a dead process left RUNNING without saving theirs
    end KILLED. Returns ``{run id: status}`` for each run it ended. A store that does not answer changes nothing
    (one warning); nor does another process syncing the same experiment, unless it is done within ``wait_s``."""
    uri = uri or tracking_uri()
    if not _reachable(uri):
        return {}  # a store that failed a moment ago
    with _sync_lock(experiment, wait_s) as locked:
        folders = saved_cells(cells) if locked else []
        if not locked or (uri.startswith("sqlite:///") and not _database(uri).exists() and not folders):
            return {}  # another process is syncing this experiment; or no store, and nothing to log
        try:
            client = connect(uri)
            experiment_id = ensure_experiment(client, uri, experiment)
            with _quiet_retries():
                return _sync_runs(client, experiment_id, folders)
        except Exception as error:  # the store's: a folder's own errors are handled in `_sync_runs`
            _warn_unreachable(uri, error)
            return {}


def saved_cells(cells: str | Path) -> list[Path]:
    """The complete cell folders right below ``cells`` (an unfinished write is dot-named)."""
    return [spec.parent for spec in sorted(Path(cells).glob("*/cell.json"))
            if not spec.parent.name.startswith(".") and (spec.parent / "metrics.json").is_file()]


def _sync_runs(client, experiment_id: str, folders: list[Path]) -> dict[str, str]:
    runs, abandoned = _all_runs(client, experiment_id), _Abandoned(client)
    ended: dict[str, str] = {}
    for folder in folders:
        try:
            saved = SavedCell.read(folder)
        except (OSError, ValueError) as error:  # removed or replaced meanwhile (a parallel rerun), or not a cell's
            logger.warning("%s is not logged to MLflow: %s", folder, _cause(error))
            continue
        of_spec = sorted((run for run in runs if run.info.run_name == folder.name and
                          run.data.tags.get(SPEC_TAG) in saved.digests), key=lambda run: -run.info.start_time)
        if any(run.info.status == FINISHED or run.info.status == "RUNNING" and not abandoned(run) for run in of_spec):
            continue  # logged already, or its own process is about to log it
        # A run whose process died after it saved this folder is completed (unless its process ended it meanwhile);
        # any other folder gets a run of its own (a crashed run is not credited with an older folder's results).
        run = next((run for run in of_spec if run.info.status == "RUNNING" and _outputs_of(saved, run)), None)
        if run is not None and client.get_run(run.info.run_id).info.status != "RUNNING":
            continue
        run = run or _run_from_folder(client, experiment_id, saved, earlier=of_spec[0] if of_spec else None)
        log_cell(client, run, saved)
        client.set_terminated(run.info.run_id, status=FINISHED)
        ended[run.info.run_id] = FINISHED
        logger.info("MLflow run %s of %s: logged from its folder %s", run.info.run_id, folder.name, saved.folder)
    for run in runs:
        if run.info.status == "RUNNING" and run.info.run_id not in ended and abandoned(run) and \
                client.get_run(run.info.run_id).info.status == "RUNNING":  # not ended meanwhile by its process
            client.set_terminated(run.info.run_id, status=KILLED)
            ended[run.info.run_id] = KILLED
            logger.info("MLflow run %s of %s was left RUNNING by a process that died: ended KILLED", run.info.run_id,
                        run.info.run_name)
    return ended


class _Abandoned:
    """Whether a RUNNING run has nobody left to end it: its process died on this machine, or (a cell of a Ray build,
    whose process another machine ran) the build's parent run has ended."""

    def __init__(self, client) -> None:
        from layertune.io import process_alive

        self.client, self.process_alive, self.parents = client, process_alive, {}

    def __call__(self, run) -> bool:
        if not _owner_alive(run.data.tags, self.process_alive):
            return True
        parent = run.data.tags.get(PARENT_TAG)
        if parent and parent not in self.parents:
            self.parents[parent] = self._ended(parent)
        return bool(parent) and self.parents[parent]

    def _ended(self, run_id: str) -> bool:
        from mlflow.exceptions import MlflowException

        try:
            return self.client.get_run(run_id).info.status != "RUNNING"
        except MlflowException as error:  # deleted and collected (`mlflow gc`): it ended
            if error.error_code == "RESOURCE_DOES_NOT_EXIST":
                return True
            raise


def _all_runs(client, experiment_id: str) -> list:
    runs, token = [], None
    while True:
        page = client.search_runs([experiment_id], max_results=50_000, page_token=token)
        runs += page
        if not (token := page.token):
            return runs


def _run_from_folder(client, experiment_id: str, saved: SavedCell, earlier=None):
    """A new run for a folder MLflow never saw (the store did not answer while its cell trained), with the
    parameters, tags and inputs the cell's own run would have had: its place in the grid comes from the plan
    beside it (``data/00_plan/<study>/cells/<cell>.json``). ``earlier``: the newest run of the same cell and spec
    (one that ended without logging the folder): its build, and its place under the build's parent run, carry over."""
    from layertune.study import StudyCell
    from pipelines.plans import dvc_stage

    folder, study = saved.folder, saved.folder.parent.name
    data = folder.parents[2]  # data/04_models/<study>/<cell>
    try:
        cell = StudyCell.model_validate_json((data / PLANS_ROOT.name / study / "cells" / f"{folder.name}.json")
                                            .read_text())
    except (OSError, ValueError):  # no plan beside it
        cell = None
    cell = cell if cell is not None and cell.spec == saved.spec else None  # a plan that moved on does not describe it
    nesting = {key: earlier.data.tags[key] for key in (PARENT_TAG, BUILD_TAG) if earlier and key in earlier.data.tags}
    tags = {**cell_tags(stage=cell and dvc_stage(cell), study=study, spec=saved.spec), **nesting, **_owner(),
            LOGGED_FROM_TAG: f"its folder {folder}: MLflow did not answer while the cell trained"}
    run = client.create_run(experiment_id, start_time=saved.written_ms, tags=tags, run_name=folder.name)
    _log_params(client, run.info.run_id, cell_params(cell) if cell else {"study": study})
    if cell and (datasets := corpus_datasets(data / PREPARED_ROOT.name / study / cell.task, cell.task)):
        client.log_inputs(run.info.run_id, datasets)
    return run


def _outputs_of(saved: SavedCell, run) -> bool:
    """Whether ``saved`` is what ``run``'s process saved: written after the run began."""
    return saved.written_ms >= run.info.start_time


@contextlib.contextmanager
def _sync_lock(experiment: str, wait_s: float = 0) -> Iterator[bool]:
    """Whether this process may sync ``experiment``: one process at a time does (two would create a run for one
    folder twice)."""
    from filelock import FileLock, Timeout

    SYNC_LOCKS.mkdir(parents=True, exist_ok=True)
    try:
        lock = FileLock(SYNC_LOCKS / f"tracking-sync-{experiment}.lock").acquire(timeout=wait_s)
    except Timeout:
        yield False
        return
    with lock:
        yield True


def end_abandoned_runs(client, experiment_id: str, run_name: str) -> list[str]:
    """Runs named ``run_name`` still RUNNING with nobody left to end them (`_Abandoned`) end KILLED: a cell trained
    again leaves one live run, even when another process's `sync` holds the lock. Returns the ids it ended."""
    abandoned, ended = _Abandoned(client), []
    for run in client.search_runs([experiment_id], f"attributes.run_name = '{run_name}' and "
                                                   "attributes.status = 'RUNNING'"):
        if abandoned(run):
            client.set_terminated(run.info.run_id, status=KILLED)
            ended.append(run.info.run_id)
    return ended


def _log_params(client, run_id: str, params: Mapping[str, Any]) -> None:
    from mlflow.entities import Param

    client.log_batch(run_id, params=[Param(key, _param_text(value)) for key, value in sorted(params.items())])


def _owner() -> dict[str, str]:
    """The tags that name the process owning a run: a run whose owner died on this machine is abandoned."""
    return {HOST_TAG: socket.gethostname(), PID_TAG: str(os.getpid())}


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


def _owner_alive(tags: Mapping[str, str], process_alive) -> bool:
    """Whether the process that owns a run may still be running: it does unless it is known dead on this machine
    (another machine's processes cannot be checked)."""
    host, pid = tags.get(HOST_TAG), tags.get(PID_TAG, "")
    return not (host == socket.gethostname() and pid.isdigit() and not process_alive(int(pid)))


def spec_digest(spec) -> str:
    """A `CellSpec` (or its JSON)'s digest: equal specs, however their JSON is laid out, give the same one."""
    from layertune.specs import CellSpec

    if isinstance(spec, str):
        spec = CellSpec.model_validate_json(spec)
    return _json_digest(spec.model_dump(mode="json"))


def _json_digest(data: Any) -> str:
    """Of JSON data as pydantic writes it compactly (so a spec's digest is that of its saved JSON read back)."""
    import pydantic_core

    return hashlib.sha256(pydantic_core.to_json(data)).hexdigest()[:16]


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
        logger.warning("MLflow at %s failed (%s): cells go on, and their folders are logged once it answers (by the "
                       "next cell of the study, its evaluate stage, or: python -m pipelines.tracking sync)",
                       uri, _cause(error))


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


def corpus_datasets(folder: str | Path, task: str) -> list:
    """A prepared corpus's train and dev splits (``<folder>/<split>.parquet``) as MLflow dataset inputs: name
    (``<task>-<split>``), MLflow's digest of the data, the file as source, schema and row count; context training
    or eval."""
    import mlflow.data
    import pandas as pd
    from mlflow.entities import Dataset, DatasetInput, InputTag

    inputs = []
    for split, context in (("train", "training"), ("dev", "eval")):
        path = Path(folder) / f"{split}.parquet"
        if not path.is_file():
            continue
        with warnings.catch_warnings():  # mlflow's hints on inferring a schema, and on its two local source kinds
            warnings.simplefilter("ignore")
            entity = mlflow.data.from_pandas(pd.read_parquet(path), source=str(path.absolute()),
                                             name=f"{task}-{split}").to_dict()  # what MLflow's entity is made of
        dataset = Dataset(entity["name"], entity["digest"], entity["source_type"], entity["source"],
                          entity.get("schema"), entity.get("profile"))
        inputs.append(DatasetInput(dataset, tags=[InputTag("mlflow.data.context", context)]))
    return inputs


def final_metrics(summary: Mapping[str, Any]) -> dict[str, float]:
    """A cell's summary as run metrics: the best epoch's scores as ``best_eval_*`` (the unprefixed names hold the
    per-epoch history), test scores, time, throughput and parameter counts as they are."""
    metrics = {}
    for key, value in summary.items():
        if not _is_number(value) or key in ("seed", "tunable_layers"):
            continue
        metrics[f"best_{key}" if key.startswith("eval_") else key] = value
    return metrics


def cell_tags(stage: str | None = None, study: str | None = None, spec=None) -> dict[str, str]:
    """The tags of a cell's run; a child of the run ``$LAYERTUNE_PARENT_RUN_ID`` names (a build on a Ray cluster
    opens one per study: `pipelines.ray_cluster`), as MLflow's nested runs are, and tagged with the build
    ``$LAYERTUNE_BUILD`` names (to find a build's runs in the runs table)."""
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


# ------------------------------------------------------------------------------------------- command line


def main(argv: list[str] | None = None) -> int:
    """``python -m pipelines.tracking sync [--study NAME]``, in the project folder: every saved cell folder that
    ``$MLFLOW_TRACKING_URI`` (else ``sqlite:///mlflow.db``) lacks is logged there, and runs that killed cells left
    RUNNING are ended (see `sync`). Exit status 1 if the store did not answer."""
    parser = argparse.ArgumentParser(prog="python -m pipelines.tracking", description=main.__doc__)
    parser.add_argument("command", choices=["sync"])
    parser.add_argument("--study", action="append", help="only this study (repeatable; default: every study)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    uri = tracking_uri()
    studies = args.study or sorted(p.name for p in MODELS_ROOT.glob("*") if p.is_dir())
    ended = [status for study in studies
             for status in sync(experiment_name(study), MODELS_ROOT / study, uri, wait_s=120).values()]
    if not _reachable(uri):
        print(f"MLflow at {uri} did not answer: nothing was logged; run this again once it does")
        return 1
    logged = ended.count(FINISHED)
    print(f"{logged} cell folder(s) logged to {uri} as FINISHED runs; {len(ended) - logged} run(s) left RUNNING by "
          "killed cells ended KILLED")
    return 0


if __name__ == "__main__":
    sys.exit(main())
