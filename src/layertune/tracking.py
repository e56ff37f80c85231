"""MLflow tracking: one run per study cell, one experiment per study, and a run ends FINISHED only on success.

Runs are driven through `mlflow.MlflowClient` with explicit run ids, never mlflow's active-run globals: mlflow ends a
still-active run as FINISHED when the interpreter exits, which would mark an interrupted cell as finished.
A failed cell ends FAILED; Ctrl-C or SIGTERM (what ``kill`` and CI timeouts send) ends it KILLED.

The tracking URI is ``$MLFLOW_TRACKING_URI`` when set (a team server, say), else ``sqlite:///mlflow.db`` in the
working directory (MLflow 3 no longer accepts a plain folder as its store); artifacts of a SQLite store go to
``mlartifacts/`` beside the database.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

DEFAULT_TRACKING_URI = "sqlite:///mlflow.db"
HOST_TAG, PID_TAG = "layertune.host", "layertune.pid"  # which process owns a run: a dead owner's run is abandoned
FINISHED, FAILED, KILLED = "FINISHED", "FAILED", "KILLED"
# The kind of experiment the MLflow UI (3.x) shows: a model-training experiment opens on its runs table. Without it
# the UI guesses, and opens ours on its GenAI overview page.
EXPERIMENT_TAGS = {"mlflow.experimentKind": "custom_model_development"}


def tracking_uri() -> str:
    return os.environ.get("MLFLOW_TRACKING_URI") or DEFAULT_TRACKING_URI


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread so that cleanup (and the run's KILLED status) happens as for Ctrl-C."""


@contextlib.contextmanager
def sigterm_raises() -> Iterator[None]:
    """Within the block, SIGTERM raises `Terminated` instead of ending the process silently."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers can only be installed from the main thread
        return

    def handler(signum, frame):
        raise Terminated(f"received signal {signal.Signals(signum).name}")

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def end_status(error: BaseException | None) -> str:
    """FINISHED without an error, KILLED for an interruption (Ctrl-C, SIGTERM, exit), FAILED otherwise."""
    if error is None:
        return FINISHED
    if isinstance(error, (KeyboardInterrupt, SystemExit, GeneratorExit)):
        return KILLED
    return FAILED


class CellRun:
    """One MLflow run. Start it with :meth:`start`; :meth:`end` is idempotent (the first status wins)."""

    def __init__(self, client, run_id: str) -> None:
        self.client = client
        self.run_id = run_id
        self.ended: str | None = None

    @classmethod
    def start(cls, experiment: str, run_name: str, params: Mapping[str, Any], tags: Mapping[str, str] | None = None,
              uri: str | None = None) -> CellRun:
        """A new run ``run_name``; runs of the same name that a dead process left RUNNING end KILLED first."""
        from mlflow.entities import Param

        uri = uri or tracking_uri()
        with _store_lock(uri):  # cells starting together: one creates the store and experiment, the others wait
            client = _client(uri)
            found = client.get_experiment_by_name(experiment)
            experiment_id = found.experiment_id if found else client.create_experiment(
                experiment, artifact_location=_artifact_location(uri, experiment), tags=EXPERIMENT_TAGS)
            if found and any(found.tags.get(k) != v for k, v in EXPERIMENT_TAGS.items()):
                for key, value in EXPERIMENT_TAGS.items():  # an experiment made before the tag existed
                    client.set_experiment_tag(experiment_id, key, value)
        end_abandoned_runs(client, experiment_id, run_name)
        owner = {HOST_TAG: socket.gethostname(), PID_TAG: str(os.getpid())}
        run = client.create_run(experiment_id, run_name=run_name, tags={**(tags or {}), **owner})
        client.log_batch(run.info.run_id, params=[Param(k, _param_text(v)) for k, v in sorted(params.items())])
        logger.info("MLflow run %s (%s) in experiment %r at %s", run.info.run_id, run_name, experiment, uri)
        if uri.startswith(("http://", "https://")):
            logger.info("The study's runs: %s", runs_page(uri, experiment_id))
        return cls(client, run.info.run_id)

    def log_metrics(self, metrics: Mapping[str, Any], step: int = 0,
                    history: list[Mapping[str, Any]] = (), tags: Mapping[str, str] | None = None) -> None:
        """Final ``metrics`` and per-epoch ``history`` records (``step`` = epoch) in as few calls as MLflow allows
        (1,000 metrics each), with ``tags``."""
        from mlflow.entities import Metric, RunTag

        now = int(time.time() * 1000)
        entries = [Metric(k, float(v), now, int(record["epoch"])) for record in history
                   for k, v in sorted(record.items()) if k != "epoch" and _is_number(v)]
        entries += [Metric(k, float(v), now, step) for k, v in sorted(metrics.items()) if _is_number(v)]
        run_tags = [RunTag(k, str(v)) for k, v in sorted((tags or {}).items())]
        for start in range(0, max(len(entries), 1), 1000):
            self.client.log_batch(self.run_id, metrics=entries[start : start + 1000],
                                  tags=run_tags if not start else [])

    def log_dict(self, data: Any, artifact_file: str) -> None:
        self.client.log_dict(self.run_id, data, artifact_file)

    def end(self, status: str) -> None:
        if self.ended is None:
            self.client.set_terminated(self.run_id, status=status)
            self.ended = status
            logger.info("MLflow run %s ended %s", self.run_id, status)


def _client(uri: str):
    """A client whose store exists: MLflow creates (and migrates) its database when the client first opens it."""
    from mlflow import MlflowClient

    client = MlflowClient(uri)
    client.search_experiments(max_results=1)
    return client


@contextlib.contextmanager
def _store_lock(uri: str) -> Iterator[None]:
    """A file lock beside a SQLite store. MLflow's creation and migration of a new database is not safe for several
    processes at once (they fail with 'table already exists'), so store creation is done by one at a time."""
    if not uri.startswith("sqlite:///"):
        yield  # a server serializes on its own
        return
    import fcntl

    database = Path(uri.removeprefix("sqlite:///")).expanduser().absolute()
    database.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{database}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def end_abandoned_runs(client, experiment_id: str, run_name: str) -> list[str]:
    """Runs named ``run_name`` still RUNNING whose process died on this machine (a SIGKILL, a power cut) end KILLED:
    a rerun of a cell leaves one live run, never a run forever RUNNING. Returns the ids it ended."""
    from layertune.io import process_alive

    ended = []
    for run in client.search_runs([experiment_id], filter_string=f"attributes.run_name = '{run_name}' and "
                                                                 "attributes.status = 'RUNNING'"):
        host, pid = run.data.tags.get(HOST_TAG), run.data.tags.get(PID_TAG, "")
        if host == socket.gethostname() and pid.isdigit() and not process_alive(int(pid)):
            client.set_terminated(run.info.run_id, status=KILLED)
            ended.append(run.info.run_id)
            logger.info("MLflow run %s of %s was left RUNNING by a process that died: ended KILLED", run.info.run_id,
                        run_name)
    return ended


def runs_page(uri: str, experiment_id: str) -> str:
    """The MLflow UI's runs table of an experiment, on the server at ``uri``."""
    return f"{uri.rstrip('/')}/#/experiments/{experiment_id}/runs"


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
    return {
        "study": cell.study, "task": cell.task, "encoder": cell.encoder, "tunable_layers": cell.tunable_layers,
        "seed": cell.seed, "models": per_encoder.pop("model"), "combine": spec.combine and spec.combine.method,
        **{k: v for k, v in per_encoder.items() if k != "tunable_layers"},
        "train_size": corpus["train_size"], "dev_size": corpus["dev_size"], "data_seed": corpus["seed"],
        "balanced": corpus["balanced"], **spec.head.model_dump(),
        **(spec.combine.model_dump(exclude={"method"}) if spec.combine else {}),
        **spec.training.model_dump(exclude={"seed"}),
    }


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
    run.log_metrics(final_metrics(result.summary()), history=result.history,
                    tags={"model_path": model_path} if model_path else None)
    run.log_dict(result.summary(), "metrics.json")
    run.log_dict(result.history, "history.json")


def cell_tags(stage: str | None = None, study: str | None = None) -> dict[str, str]:
    tags = {"mlflow.source.type": "JOB"}
    if commit := git_commit():
        tags["mlflow.source.git.commit"] = commit
    if stage:
        tags["dvc_stage"] = stage
    if study:
        tags["study"] = study
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
    database = Path(uri.removeprefix("sqlite:///")).expanduser().absolute()
    return (database.parent / "mlartifacts" / experiment).as_uri()


def _param_text(value: Any) -> str:
    return "None" if value is None else str(value)[:6000]


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
