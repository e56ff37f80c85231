"""Kedro hooks: check params.yaml before any stage runs, and track each train cell as an MLflow run."""

from __future__ import annotations

import atexit
import contextlib
import logging

from kedro.framework.hooks import hook_impl

from layertune.study import Cell, validate_params

logger = logging.getLogger(__name__)

MLFLOW_TAG = "mlflow"  # nodes with this tag are tracked: one MLflow run per run of the node


class ValidateParamsHook:
    """Every ``kedro run`` checks the whole of params.yaml first, so a typo fails before any work, key named."""

    @hook_impl
    def after_context_created(self, context) -> None:
        validate_params(context.params)


class MlflowCellHook:
    """A run per tagged node: params before it runs; history, final metrics and artifacts after it; FINISHED
    only once the whole Kedro run (outputs saved included) succeeded. An error ends it FAILED; Ctrl-C or SIGTERM
    ends it KILLED (at interpreter exit at the latest, since neither reaches Kedro's error hooks)."""

    def __init__(self) -> None:
        self.params: dict = {}
        self.run = None
        self._signals = contextlib.ExitStack()

    @hook_impl
    def after_context_created(self, context) -> None:
        self.params = context.params

    @hook_impl
    def before_node_run(self, node, inputs) -> None:
        if MLFLOW_TAG not in node.tags:
            return
        from layertune import tracking

        cell = Cell.from_params(inputs.get("params:cell", self.params.get("cell", {})))
        study = self.params.get("study", {}).get("name", "study")
        self.run = tracking.CellRun.start(
            experiment=f"layertune-{study}",
            run_name=f"{cell.task}-{cell.model.split('/')[-1]}-layers{cell.tunable_layers}-seed{cell.seed}",
            params=tracking.cell_params(cell.as_dict(), self.params),
            tags=tracking.cell_tags(stage=cell.dvc_stage, study=study),
        )
        self._signals.enter_context(tracking.sigterm_raises())
        atexit.register(self.end_open_run)

    @hook_impl
    def after_node_run(self, node, outputs) -> None:
        if MLFLOW_TAG not in node.tags or self.run is None:
            return
        from layertune import tracking

        summary, history, drift = outputs["cell_metrics"], outputs["cell_history"], outputs["cell_drift"]
        self.run.log_history(history)
        self.run.log_metrics(tracking.final_metrics(summary))
        self.run.log_dict(summary, "metrics.json")
        self.run.log_dict(history, "history.json")
        self.run.log_text(drift.to_csv(index=False), "drift.csv")

    @hook_impl
    def on_node_error(self, error, node) -> None:
        self._end(error)

    @hook_impl
    def on_pipeline_error(self, error) -> None:
        self._end(error)

    @hook_impl
    def after_pipeline_run(self) -> None:
        self._end(None)

    def end_open_run(self) -> None:
        """At exit, a run still open was interrupted: it ends KILLED, never FINISHED."""
        self._end(KeyboardInterrupt())

    def _end(self, error: BaseException | None) -> None:
        if self.run is None:
            return
        from layertune.tracking import end_status

        run, self.run = self.run, None
        self._signals.close()
        atexit.unregister(self.end_open_run)
        try:
            run.end(end_status(error))
        except Exception:  # never hide the cell's own error behind a tracking one
            logger.exception("Could not end MLflow run %s", run.run_id)
