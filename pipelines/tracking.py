"""MLflow tracking: the cell folder is the record, and MLflow shows it (docs/pipeline.md, "MLflow"). Runs are driven
through `mlflow.MlflowClient` with explicit run ids, never mlflow's active-run globals: mlflow ends a still-active
run FINISHED when the interpreter exits, which would mark an interrupted cell as finished.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import socket
import subprocess
import sys
import time
import uuid
import warnings
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from pipelines.plans import dvc_stage
from pipelines.processes import signals_deferred

logger = logging.getLogger(__name__)

DEFAULT_TRACKING_URI = "sqlite:///mlflow.db"
HOST_TAG, PID_TAG = "layertune.host", "layertune.pid"  # the process owning a run: a dead owner's run is abandoned
PARENT_TAG = "mlflow.parentRunId"  # a cell's run as its build's child
BUILD_TAG = "layertune.build"  # the build a parent run and its cells' runs belong to
SPEC_TAG = "layertune.spec"  # digest of the cell's spec
BUILD_KEY_TAG = "layertune.build_key"  # the cell folder's build key (`pipelines.trained_cells`): which folder it logs
SUPERSEDED_TAG = "layertune.superseded_by"  # a FINISHED run whose cell was trained again: the run that did
LOGGED_FROM_TAG = "layertune.logged_from"  # a run created by `sync` from a folder MLflow had not seen
COPIED_FROM_TAG = "layertune.copied_from"  # a cell copied from another study's folder of the same build: which
FINISHED, FAILED, KILLED = "FINISHED", "FAILED", "KILLED"
# The kind of experiment the MLflow UI (3.x) shows: a model-training experiment opens on its runs table. Without it
# the UI guesses, and opens ours on its GenAI overview page.
EXPERIMENT_TAGS = {"mlflow.experimentKind": "custom_model_development"}
# MLflow's own defaults retry an unreachable server for about four minutes per call (7 retries, backoff factor 2,
# 120 s timeout). What a run cannot log now is logged later from the cell's folder, so a few seconds are enough.
HTTP_RETRY_DEFAULTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
                       "MLFLOW_HTTP_REQUEST_BACKOFF_JITTER": "0.5", "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}
RETRY_AFTER_S = 60.0  # a store that failed is not called again by this process for this long
_failed: dict[str, float] = {}  # tracking URI -> when a call to it last failed in this process


def tracking_uri() -> str:
    return os.environ.get("MLFLOW_TRACKING_URI") or DEFAULT_TRACKING_URI


def end_status(error: BaseException | None) -> str:
    """FINISHED without an error, KILLED for an interruption (Ctrl-C, SIGTERM, exit), FAILED otherwise."""
    if error is None:
        return FINISHED
    if isinstance(error, (KeyboardInterrupt, SystemExit, GeneratorExit)):
        return KILLED
    return FAILED


# ---------------------------------------------------------------------------------------------------- a run


class Store:
    """One tracking store and one experiment in it, as this process reaches them: every call goes through `call`,
    which turns a store's failure into no error and one warning line (per store and process), and skips the store
    for a while after one (`RETRY_AFTER_S`)."""

    def __init__(self, experiment: str, uri: str | None = None) -> None:
        self.experiment, self.uri = experiment, uri or tracking_uri()
        self.client = None
        self.experiment_id: str | None = None
        if self.uri.startswith(("http://", "https://")):
            for key, value in HTTP_RETRY_DEFAULTS.items():
                os.environ.setdefault(key, value)

    def call(self, function, *args, **kwargs):
        """``function(client, experiment_id, *args, **kwargs)``'s result, or None if the store failed (now, or a
        moment ago)."""
        if time.monotonic() - _failed.get(self.uri, -RETRY_AFTER_S) < RETRY_AFTER_S:
            return None
        try:
            with signals_deferred(), _quiet_retries():
                if self.client is None:
                    client = connect(self.uri)
                    self.experiment_id = ensure_experiment(client, self.uri, self.experiment)
                    self.client = client
                return function(self.client, self.experiment_id, *args, **kwargs)
        except Exception as error:  # whatever the store's failure (down, refusing, broken), the cells go on
            if self.uri not in _failed:
                logger.warning("MLflow at %s failed (%s): cells go on, and their folders are logged once it answers "
                               "(by the next cell of the study, its evaluate stage, or: python -m pipelines.tracking "
                               "sync)", self.uri, _cause(error))
            _failed[self.uri] = time.monotonic()
            return None


class CellRun:
    """One MLflow run in a `Store`; none when the store did not answer as it started (`sync` logs the cell's folder
    later). The first ending wins."""

    def __init__(self, store: Store, run_name: str) -> None:
        self.store, self.run_name = store, run_name
        self.run = None  # the `mlflow.entities.Run` as created
        self.ended: str | None = None

    @property
    def run_id(self) -> str | None:
        return self.run.info.run_id if self.run is not None else None

    @classmethod
    def start(cls, store: Store, run_name: str, params: Mapping[str, Any], tags: Mapping[str, str] | None = None,
              datasets: Iterable = (), start_time: int | None = None) -> CellRun:
        """A new run ``run_name`` with ``params`` and dataset inputs (`corpus_datasets`), owned by this process."""
        run = cls(store, run_name)
        run.run = store.call(_create_run, run_name, params, tags or {}, datasets, start_time)
        return run

    def finish(self, saved: SavedCell) -> None:
        """The saved cell logged onto the run (`log_cell`), which ends FINISHED; nothing without a run."""
        if self.ended is None and self.run is not None and \
                self.store.call(lambda client, _: log_cell(client, self.run, saved) or True):
            self.end(FINISHED)

    def end(self, status: str) -> None:
        if self.ended is not None:
            return
        self.ended = status
        if self.run is not None and self.store.call(
                lambda client, _: client.set_terminated(self.run_id, status=status) or True):
            logger.debug("MLflow run %s (%s) ended %s", self.run_id, self.run_name, status)


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
    build_key: str | None  # what `pipelines.trained_cells` recorded with it (None: a folder written elsewhere)
    copied_from: str | None = None  # ``<study>/<cell>``: the folder it was copied from, not trained (`copy_built`)

    @classmethod
    def read(cls, folder: str | Path) -> SavedCell:
        """The folder's files; a `ValueError` naming the file and what is wrong with it (a missing one is an
        `OSError` naming it)."""
        from layertune.specs import CellSpec
        from pipelines.trained_cells import read_record

        folder = Path(folder).resolve()

        def read_json(name: str, default: Any = None) -> Any:
            path = folder / name
            if default is not None and not path.is_file():
                return default
            try:
                return json.loads(path.read_text())
            except json.JSONDecodeError as error:
                raise ValueError(f"{name} is not valid JSON ({error.msg}, line {error.lineno} column "
                                 f"{error.colno})") from None

        try:
            spec = CellSpec.model_validate(read_json("cell.json"))
        except ValidationError as error:
            raise ValueError(f"cell.json is not a cell's spec ({error.error_count()} error(s), the first: "
                             f"{error.errors()[0]['msg']})") from None
        record = read_record(folder) or {}
        return cls(folder, spec, read_json("metrics.json"), read_json("history.json"), read_json("run_info.json", {}),
                   record.get("key"), record.get("copied_from"))

    def tags(self) -> dict[str, str]:
        from pipelines.trained_cells import spec_digest

        return {SPEC_TAG: spec_digest(self.spec), **({BUILD_KEY_TAG: self.build_key} if self.build_key else {}),
                **({COPIED_FROM_TAG: self.copied_from} if self.copied_from else {})}


def log_cell(client, run, saved: SavedCell) -> None:
    """A saved cell projected onto ``run`` (an `mlflow.entities.Run`): its history (step = epoch), final metrics,
    tags and files. Logging it again changes nothing: every value carries the run's start time, and MLflow keeps an
    equal metric, tag or file once."""
    from mlflow.entities import Metric, RunTag

    run_id, when = run.info.run_id, run.info.start_time
    metrics = [Metric(key, float(value), when, int(record["epoch"])) for record in saved.history
               for key, value in sorted(record.items()) if key != "epoch" and _is_number(value)]
    # The best epoch's scores as best_eval_* (the unprefixed names hold the history); the rest as they are.
    metrics += [Metric(f"best_{key}" if key.startswith("eval_") else key, float(value), when, 0)
                for key, value in sorted(saved.summary.items())
                if _is_number(value) and key not in ("seed", "tunable_layers")]
    tags = {"model_path": str(saved.folder / "model"), **saved.tags()}
    # How the cell trained, as words: the precision it computed in, what stopped it, what chose its weights.
    tags |= {key: str(saved.summary[key]) for key in ("mixed_precision", "stopped_by", "selection_metric")
             if key in saved.summary}
    if cache := saved.run_info.get("frozen_prefix_cache"):
        tags |= {"frozen_prefix_cache.used": str(cache["used"]), "frozen_prefix_cache.reason": cache["reason"]}
    # MlflowClient.log_batch splits into calls MLflow's limits allow (1,000 metrics, 100 tags)
    client.log_batch(run_id, metrics=metrics, tags=[RunTag(key, value) for key, value in sorted(tags.items())])
    for name, data in (("metrics.json", saved.summary), ("history.json", saved.history),
                       ("run_info.json", saved.run_info)):
        if data:
            client.log_dict(run_id, data, name)


# ------------------------------------------------------------------------------------------- a study's build


class StudyRuns:
    """The MLflow runs of one build of a study, all owned by this process: the build's parent run, each cell's run
    as its child. Entering settles the runs an earlier build left RUNNING (`settle_abandoned_runs`); leaving ends
    every run still open, the parent by how the block ended, and syncs the study's folders unless interrupted."""

    def __init__(self, study: str, cells, planned: Mapping[str, Any], prepared: Mapping[str, Path],
                 build_keys: Mapping[str, str] | None = None, uri: str | None = None, enabled: bool = True) -> None:
        self.study, self.cells, self.planned, self.prepared = study, cells, planned, prepared
        self.build_keys = build_keys or {}  # cell key -> the build key its folder will record
        self.enabled = enabled  # False: a process that does not own runs (one of several training a cell)
        self.store = Store(experiment_name(study), uri)
        self.build = f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
        self.parent: CellRun | None = None
        self.open: dict[str, CellRun] = {}  # cell key -> its run, until it ends
        self.done: list[str] = []  # the cells finished in this build
        self._datasets: dict[str, list] = {}  # per task, its MLflow dataset inputs (read once a build)

    def __enter__(self) -> StudyRuns:
        if self.enabled:
            self.store.call(settle_abandoned_runs, self.cells)
        return self

    def open_build(self, params: Mapping[str, Any]) -> None:
        """The build's parent run, with ``params`` (what it trains, and where)."""
        if not self.enabled:
            return
        with signals_deferred():  # a stop signal ends the run it meant to stop, once this process knows it
            self.parent = CellRun.start(self.store, f"build {self.build}", {"commit": git_commit(), **params},
                                        tags={**cell_tags(study=self.study), BUILD_TAG: self.build})
        if self.store.experiment_id:  # the MLflow UI's runs table (`mlflow ui`'s address for a local store)
            remote = self.store.uri.startswith(("http://", "https://"))
            base = self.store.uri.rstrip("/") if remote else "http://127.0.0.1:5000"
            logger.info("MLflow: the study's runs are at %s/#/experiments/%s/runs%s", base, self.store.experiment_id,
                        "" if remote else f" (mlflow ui --backend-store-uri {self.store.uri})")

    def started(self, key: str, start_time: int | None = None) -> None:
        """Cell ``key`` started training (``start_time``: when, in ms, if not now)."""
        if not self.enabled:
            return
        cell = self.planned[key]
        with signals_deferred():  # as for the build's run
            self.open[key] = CellRun.start(self.store, key, cell_params(cell), tags=self._tags(cell),
                                           datasets=self._inputs(cell.task), start_time=start_time)

    def finished(self, key: str, start_time: int | None = None) -> None:
        """Cell ``key``'s folder is saved: logged onto its run, which ends FINISHED."""
        self.done.append(key)
        if not self.enabled:
            return
        if key not in self.open:
            self.started(key, start_time)
        self.open.pop(key).finish(SavedCell.read(self.cells[key].path))

    def copied(self, key: str) -> None:
        """Cell ``key``'s folder was copied from another study's (`TrainedCells.copy_built`): a run of this build,
        as a trained cell's, FINISHED at once (its tags name the source)."""
        if not self.enabled:
            return
        cell = self.planned[key]
        with signals_deferred():
            run = CellRun.start(self.store, key, cell_params(cell), tags=self._tags(cell),
                                datasets=self._inputs(cell.task))
        run.finish(SavedCell.read(self.cells[key].path))

    def __exit__(self, kind, error, traceback) -> None:
        if not self.enabled:
            return
        with signals_deferred():  # a second stop signal must not cut the ending short (it left runs RUNNING)
            self._end(end_status(error), error)

    def _end(self, status: str, error: BaseException | None) -> None:
        failed = getattr(error, "cell", None)  # a `pipelines.scheduling.CellFailed`
        if failed in self.planned and failed not in self.open:  # a cell that failed elsewhere (a Ray node)
            self.started(failed)
        for key, run in self.open.items():
            run.end(FAILED if key == failed else KILLED)
        if self.parent is not None:
            self.parent.end(status)
        if status != KILLED:
            self.store.call(sync, self.cells, self.planned, self.prepared)

    def _tags(self, cell) -> dict[str, str]:
        return {**cell_tags(study=cell.study, spec=cell.spec), BUILD_TAG: self.build,
                **({PARENT_TAG: self.parent.run_id} if self.parent and self.parent.run_id else {}),
                **({BUILD_KEY_TAG: self.build_keys[cell.key]} if cell.key in self.build_keys else {})}

    def _inputs(self, task: str) -> list:
        if task not in self._datasets:
            self._datasets[task] = corpus_datasets(self.prepared[task], task) if task in self.prepared else []
        return self._datasets[task]


def sync(client, experiment_id: str, cells: Mapping[str, Any], planned: Mapping[str, Any],
         prepared: Mapping[str, Path]) -> dict[str, str]:
    """Brings the experiment up to date with a study's cell folders (``cells``: {key: `CellFolder`}; docs/pipeline.md,
    "MLflow"): each that proves its build has one FINISHED run of its build key, created from the folder where there
    is none (with the parameters and inputs of its place in ``planned``, {key: `StudyCell`}); every other FINISHED
    run of the cell ends KILLED, tagged `SUPERSEDED_TAG`. A folder that does not prove its build is named in a
    warning, not logged. Returns ``{run id: status}`` for each run it created or ended."""
    from pipelines.trained_cells import proof_problem, recorded_build_key

    changed = settle_abandoned_runs(client, experiment_id, cells)
    finished: dict[str, list] = {}
    for run in _all_runs(client, experiment_id, "attributes.status = 'FINISHED'"):
        finished.setdefault(run.info.run_name, []).append(run)
    for key in cells:
        folder = cells[key].path
        if problem := proof_problem(folder):
            logger.warning("%s is not logged to MLflow: it does not prove its build (%s)", folder, problem)
            continue
        runs = sorted(finished.get(key, []), key=lambda run: run.info.start_time or 0, reverse=True)
        build_key = recorded_build_key(folder)
        kept = next((run for run in runs if run.data.tags.get(BUILD_KEY_TAG) == build_key), None)
        if kept is None:
            try:
                saved = SavedCell.read(folder)
            except (OSError, ValueError) as error:  # replaced meanwhile
                logger.warning("%s is not logged to MLflow: %s", folder, error)
                continue
            kept = _run_from_folder(client, experiment_id, saved, planned.get(key), prepared)
            log_cell(client, kept, saved)
            client.set_terminated(kept.info.run_id, status=FINISHED)
            changed[kept.info.run_id] = FINISHED
            logger.info("MLflow run %s of %s: logged from its folder %s", kept.info.run_id, key, saved.folder)
        for other in runs:  # the newest run of the folder's build stands for it; every other one is superseded
            if other.info.run_id != kept.info.run_id:
                client.set_tag(other.info.run_id, SUPERSEDED_TAG, kept.info.run_id)
                client.set_terminated(other.info.run_id, status=KILLED, end_time=other.info.end_time)
                changed[other.info.run_id] = KILLED
    return changed


def settle_abandoned_runs(client, experiment_id: str, cells) -> dict[str, str]:
    """Runs left RUNNING by a process of this machine that is gone: a cell's run whose folder holds the build it was
    training is completed from it, FINISHED; any other ends KILLED, the parent run included. Another machine's runs
    are left to its next build (its processes cannot be checked from here). Returns ``{run id: status}``."""
    from layertune.io import process_alive
    from pipelines.trained_cells import proof_problem, recorded_build_key

    settled = {}
    for run in _all_runs(client, experiment_id, "attributes.status = 'RUNNING'"):
        host, pid = run.data.tags.get(HOST_TAG), run.data.tags.get(PID_TAG, "")
        if host != socket.gethostname() or not pid.isdigit() or process_alive(int(pid)):
            continue
        key, folder = run.info.run_name, Path(cells.path) / run.info.run_name
        built = key in cells and run.data.tags.get(BUILD_KEY_TAG) == recorded_build_key(folder) \
            and proof_problem(folder) is None
        if built:
            try:
                log_cell(client, run, SavedCell.read(folder))
            except (OSError, ValueError) as error:  # replaced meanwhile, or damaged
                logger.warning("%s is not logged to MLflow: %s", folder, error)
                built = False
        settled[run.info.run_id] = FINISHED if built else KILLED
        client.set_terminated(run.info.run_id, status=settled[run.info.run_id])
        logger.info("MLflow run %s (%s) was left RUNNING by a process that is gone: %s", run.info.run_id, key,
                    "completed from its folder" if built else "ended KILLED")
    return settled


def _all_runs(client, experiment_id: str, condition: str = "") -> list:
    # MlflowClient.search_runs returns one page; mlflow.search_runs pages for itself, but on the global tracking URI
    from mlflow.utils import get_results_from_paginated_fn

    return get_results_from_paginated_fn(lambda count, token: client.search_runs(
        [experiment_id], condition, max_results=count, page_token=token), 50_000)


def _run_from_folder(client, experiment_id: str, saved: SavedCell, cell, prepared: Mapping[str, Path]):
    """A new run for a folder MLflow never saw, with the parameters, tags and inputs of the cell's own run where the
    plan has the cell as it was trained (``cell``, a `StudyCell`, or None)."""
    study = saved.folder.parent.name
    cell = cell if cell is not None and cell.spec == saved.spec else None  # a plan that moved on does not describe it
    tags = {**cell_tags(study=study, spec=saved.spec), **saved.tags(), LOGGED_FROM_TAG: f"its folder {saved.folder}"}
    datasets = corpus_datasets(prepared[cell.task], cell.task) if cell and cell.task in prepared else []
    return _create_run(client, experiment_id, saved.folder.name, cell_params(cell) if cell else {"study": study},
                       tags, datasets)


def _create_run(client, experiment_id: str, run_name: str, params: Mapping[str, Any], tags: Mapping[str, str],
                datasets: Iterable = (), start_time: int | None = None):
    """A new run with ``params``, ``tags`` and dataset inputs, owned by this process (`HOST_TAG`, `PID_TAG`)."""
    from mlflow.entities import Param

    owner = {HOST_TAG: socket.gethostname(), PID_TAG: str(os.getpid())}
    run = client.create_run(experiment_id, start_time=start_time, tags={**tags, **owner}, run_name=run_name)
    # MLflow takes a parameter value of at most 6,000 characters
    client.log_batch(run.info.run_id, params=[Param(key, str(value)[:6000]) for key, value in sorted(params.items())])
    if inputs := list(datasets):
        client.log_inputs(run.info.run_id, inputs)
    return run


def connect(uri: str):
    """A client whose store exists: MLflow creates (and migrates) its database when the client first opens it.
    (Quick HTTP retries are set by `Store`, the one caller.)"""
    from mlflow import MlflowClient

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


# ------------------------------------------------------------------------------------------- a failing store


def _cause(error: BaseException) -> str:
    """The innermost exception of a chain, on one line: 'ConnectionRefusedError: [Errno 111] Connection refused'."""
    seen = {id(error)}
    # An exception raised `from None` says all there is: what it replaced is not the cause.
    while (inner := error.__cause__ or (None if error.__suppress_context__ else error.__context__)) is not None \
            and id(inner) not in seen:
        error = inner
        seen.add(id(error))
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text[:200]}" if text else type(error).__name__


@contextlib.contextmanager
def _quiet_retries() -> Iterator[None]:
    """Without urllib3's warning for each retry, nor the traceback MLflow's SQL store logs for a database error (~70
    lines for a read-only mlflow.db): `Store.call` reports a failure once, in one line."""
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
        "train_size": corpus["train_size"], "validation_size": corpus["validation_size"],
        "dev_size": corpus["dev_size"], "data_seed": corpus["seed"],
        "balanced": corpus["balanced"], **spec.head.model_dump(),
        **(spec.combine.model_dump(exclude={"method"}) if spec.combine else {}),
        **spec.training.model_dump(exclude={"seed"}),
    }


def corpus_datasets(folder: str | Path, task: str) -> list:
    """A prepared corpus's train, validation and dev splits (``<folder>/<split>.parquet``) as MLflow dataset
    inputs."""
    import mlflow.data
    import pandas as pd
    from mlflow.entities import Dataset, DatasetInput, InputTag

    inputs = []
    for split, context in (("train", "training"), ("validation", "validation"), ("dev", "eval")):
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


def cell_tags(study: str, spec=None) -> dict[str, str]:
    """The tags of a run: the commit and the study; for a cell's run (``spec`` given), its DVC stage and the spec's
    digest."""
    tags = {"mlflow.source.type": "JOB", "study": study}
    if commit := git_commit():
        tags["mlflow.source.git.commit"] = commit
    if spec is not None:
        from pipelines.trained_cells import spec_digest

        tags |= {"dvc_stage": dvc_stage(study), SPEC_TAG: spec_digest(spec)}
    return tags


def git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
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


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# ------------------------------------------------------------------------------------------- command line


def main(argv: list[str] | None = None) -> int:
    """``python -m pipelines.tracking sync [--study NAME]``, in the project folder: every cell folder of a study
    that ``$MLFLOW_TRACKING_URI`` (else ``sqlite:///mlflow.db``) lacks is logged there, as the train stage does at
    its end (`sync`). Exit status 1 if the store did not answer."""
    from pipelines.catalog import catalog_path
    from pipelines.plans import TrainPlan
    from pipelines.trained_cells import TrainedCells

    parser = argparse.ArgumentParser(prog="python -m pipelines.tracking", description=main.__doc__)
    parser.add_argument("command", choices=["sync"])
    parser.add_argument("--study", action="append", help="only this study (repeatable; default: every study)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    models = catalog_path("study_cells", "-").parent  # where the catalog puts every study's cells
    studies = args.study or sorted(p.name for p in models.glob("*") if p.is_dir() and not p.name.startswith("."))
    changed = []
    for study in studies:
        plan = catalog_path("train_plan", study)
        planned = {cell.key: cell for cell in TrainPlan.model_validate_json(plan.read_text()).cells} \
            if plan.is_file() else {}
        cells = TrainedCells(catalog_path("study_cells", study), catalog_path("study_cells", study, key="retired"))
        prepared = {task.name: task for task in catalog_path("prepared_corpora", study).glob("*")}
        store = Store(experiment_name(study))
        found = store.call(sync, cells, planned, prepared)
        if found is None:
            print(f"MLflow at {store.uri} did not answer: nothing was logged; run this again once it does")
            return 1
        changed += found.values()
    logged = changed.count(FINISHED)
    print(f"{logged} cell folder(s) logged to {tracking_uri()} as FINISHED runs; {len(changed) - logged} run(s) of "
          "cells trained again since ended KILLED")
    return 0


if __name__ == "__main__":
    sys.exit(main())
