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
import subprocess
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

DEFAULT_TRACKING_URI = "sqlite:///mlflow.db"
FINISHED, FAILED, KILLED = "FINISHED", "FAILED", "KILLED"


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
        from mlflow import MlflowClient
        from mlflow.entities import Param

        uri = uri or tracking_uri()
        client = MlflowClient(uri)
        found = client.get_experiment_by_name(experiment)
        experiment_id = found.experiment_id if found else client.create_experiment(
            experiment, artifact_location=_artifact_location(uri, experiment))
        run = client.create_run(experiment_id, run_name=run_name, tags=dict(tags or {}))
        client.log_batch(run.info.run_id, params=[Param(k, _param_text(v)) for k, v in sorted(params.items())])
        logger.info("MLflow run %s (%s) in experiment %r at %s", run.info.run_id, run_name, experiment, uri)
        return cls(client, run.info.run_id)

    def log_metrics(self, metrics: Mapping[str, Any], step: int = 0) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        entries = [Metric(k, float(v), now, step) for k, v in sorted(metrics.items()) if _is_number(v)]
        for start in range(0, len(entries), 1000):  # log_batch takes at most 1000 metrics
            self.client.log_batch(self.run_id, metrics=entries[start : start + 1000])

    def log_history(self, history: list[Mapping[str, Any]]) -> None:
        """Per-epoch records as metric histories, ``step`` = epoch."""
        for record in history:
            self.log_metrics({k: v for k, v in record.items() if k != "epoch"}, step=int(record["epoch"]))

    def log_dict(self, data: Any, artifact_file: str) -> None:
        self.client.log_dict(self.run_id, data, artifact_file)

    def log_text(self, text: str, artifact_file: str) -> None:
        self.client.log_text(self.run_id, text, artifact_file)

    def end(self, status: str) -> None:
        if self.ended is None:
            self.client.set_terminated(self.run_id, status=status)
            self.ended = status
            logger.info("MLflow run %s ended %s", self.run_id, status)

    @property
    def status(self) -> str:
        return self.client.get_run(self.run_id).info.status


@contextlib.contextmanager
def track_run(experiment: str, run_name: str, params: Mapping[str, Any], tags: Mapping[str, str] | None = None,
              uri: str | None = None) -> Iterator[CellRun]:
    """A run for the block: FINISHED if it completes, FAILED on an exception, KILLED on Ctrl-C or SIGTERM."""
    run = CellRun.start(experiment, run_name, params, tags, uri)
    try:
        with sigterm_raises():
            yield run
    except BaseException as error:
        run.end(end_status(error))
        raise
    run.end(FINISHED)


# --------------------------------------------------------------------------------------- what a cell reports


def cell_params(cell: Mapping[str, Any], sections: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """Flat, stable parameter names for comparing runs: task, model, tunable_layers, seed, learning_rate, …"""
    prepare, tokenize = sections.get("prepare", {}), sections.get("tokenize", {})
    return {
        **cell,
        **sections.get("train", {}),
        "train_size": prepare.get("train_size"), "dev_size": prepare.get("dev_size"),
        "data_seed": prepare.get("seed"), "balanced": prepare.get("balanced"),
        "max_length": tokenize.get("max_length"), "frozen_prefix_cache": tokenize.get("frozen_prefix"),
        "cache_dtype": tokenize.get("cache_dtype"), "study": sections.get("study", {}).get("name"),
    }


def final_metrics(summary: Mapping[str, Any]) -> dict[str, float]:
    """A cell's summary as run metrics: the best epoch's scores as ``best_eval_*`` (the unprefixed names hold the
    per-epoch history), plus time, throughput and parameter counts as they are."""
    metrics = {}
    for key, value in summary.items():
        if not _is_number(value) or key in ("seed", "tunable_layers"):
            continue
        metrics[f"best_{key}" if key.startswith("eval_") else key] = value
    return metrics


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
