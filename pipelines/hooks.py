"""Kedro hooks: resolve every stage's models through the model mirror of params.yaml, and track each trained cell,
of every study, as one MLflow run.

Runs are grouped as one MLflow experiment per study (``layertune-<study>``), not as child runs of a study run:
each cell is its own process (its own DVC stage), so a parent run would have no process to own it and end it, and
one experiment per study is what the MLflow UI compares side by side (its runs table, charts and parallel
coordinates over the cells' parameters).

The cell folder is the record and MLflow shows it (`pipelines.tracking`): a cell never fails for its tracking,
and what MLflow does not take is logged later from the folder. A cell, as it starts, logs the folders of its study
that MLflow lacks; so does a stage that reads every cell of a study (evaluate, then aggregate), which runs once each
cell is trained or restored by DVC, and which also ends the runs that killed cells left RUNNING.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import signal
from pathlib import Path

from kedro.framework.hooks import hook_impl

from layertune.model_paths import MODEL_MIRROR_ENV
from pipelines.param_checks import InvalidParams
from pipelines.plans import dvc_stage
from pipelines.processes import STOP_SIGNALS, on_signals, signals_deferred

logger = logging.getLogger(__name__)

MLFLOW_TAG = "mlflow"  # nodes with this tag are tracked: one MLflow run per run of the node
STUDY_CELLS = "study_cells"  # a node that reads every cell of a study syncs their runs (`tracking.sync`)


class ModelMirrorHook:
    """Every stage finds the same model files however it was started (`make study`, a plain `dvc repro` or
    `dvc exp run`, `kedro run`): ``$LAYERTUNE_MODEL_MIRROR``, what the library reads, is set to params.yaml's
    ``download.model_mirror`` unless the environment sets it, as the Kedro context is created: before params.yaml
    is checked (`ParamsCheckHook`, then the plan node) and before any node loads a model."""

    def __init__(self) -> None:
        self.mirror: str | None = None  # what this hook set, so that a later run in this process may set it again

    @hook_impl
    def after_context_created(self, context) -> None:
        download = context.config_loader["parameters"].get("download")
        self.apply(download.get("model_mirror") if isinstance(download, dict) else None, context.project_path)

    def apply(self, configured: object, project: str | os.PathLike) -> None:
        """Set the variable to ``configured`` (relative to ``project``) unless the environment set it itself."""
        current = os.environ.get(MODEL_MIRROR_ENV)
        if current and current != self.mirror:  # the environment's own: it wins
            return
        if not isinstance(configured, str) or not configured:  # null, or a bad value the plan's check reports
            if current:
                del os.environ[MODEL_MIRROR_ENV]
            self.mirror = None
            return
        self.mirror = os.environ[MODEL_MIRROR_ENV] = model_mirror_path(configured, project)


def model_mirror_path(configured: str, project: str | os.PathLike) -> str:
    """``download.model_mirror`` as an absolute path (a relative one is relative to the project folder, as
    `dvc repro` and `kedro run` from any folder of it agree); a folder that does not exist is `InvalidParams`."""
    path = Path(configured).expanduser()
    path = path if path.is_absolute() else Path(project) / path
    if not path.is_dir():
        raise InvalidParams(f"download.model_mirror: {configured!r} is not a folder ({path} is missing); "
                            f"point it at a folder of models, set ${MODEL_MIRROR_ENV}, or set it to null")
    return str(path.resolve())


class StageLockHook:
    """One Kedro run of a stage (its pipelines and ``--params``: one DVC stage, a cell) at a time in a project
    (`pipelines.processes.acquire_stage_lock`), held from before the cell's MLflow run starts until after it ended:
    a rerun started while a killed run is still ending (or one that a SIGKILL orphaned) waits for it, so a cell is
    never trained twice at once, into one folder, with two runs. In a data-parallel cell the main process holds it."""

    def __init__(self) -> None:
        self.lock = None

    @hook_impl(trylast=True)  # after `ParamsCheckHook`: a bad parameter is refused before anything is written
    def before_pipeline_run(self, run_params) -> None:
        from layertune.distributed import is_main_process
        from pipelines.processes import acquire_stage_lock, stage_lock_path

        self.release()  # one left by a run of this process that an interruption ended without a hook
        if not is_main_process():
            return
        pipelines, params = run_params.get("pipeline_names") or [], run_params.get("runtime_params") or {}
        what = f"kedro run --pipelines {','.join(pipelines) or '__default__'}" + (
            f" --params {','.join(f'{k}={v}' for k, v in sorted(params.items()))}" if params else "")
        self.lock = acquire_stage_lock(stage_lock_path(run_params["project_path"], pipelines, params), what)

    @hook_impl(trylast=True)
    def after_pipeline_run(self) -> None:
        self.release()

    @hook_impl(trylast=True)
    def on_pipeline_error(self) -> None:
        self.release()

    def release(self) -> None:
        lock, self.lock = self.lock, None
        if lock is not None:
            lock.release()


class MlflowCellHook:
    """A run per tagged node: parameters and dataset inputs before it runs; once the whole Kedro run succeeded (the
    cell's folder saved), the folder logged onto it (`tracking.log_cell`: history, metrics, the model's path) and
    FINISHED. An error ends it FAILED; Ctrl-C or SIGTERM ends it KILLED (at interpreter exit at the latest, since
    neither reaches Kedro's error hooks)."""

    def __init__(self) -> None:
        self.run = None
        self.folder: Path | None = None  # the folder of the cell being trained, logged onto its run once saved
        self.catalog = None
        self._signals = contextlib.ExitStack()

    @hook_impl
    def after_catalog_created(self, catalog) -> None:
        self.catalog = catalog
        self._signals.close()  # a SIGTERM ignored after an earlier run FINISHED (see _end) counts again

    @hook_impl
    def before_node_run(self, node, inputs) -> None:
        from layertune.distributed import is_main_process

        if not is_main_process():  # a data-parallel cell is one run
            return
        from pipelines import tracking

        if STUDY_CELLS in inputs and "study_plan" in inputs:
            study = inputs["study_plan"].name
            tracking.sync(tracking.experiment_name(study), self._path(STUDY_CELLS) or tracking.MODELS_ROOT / study)
        if MLFLOW_TAG not in node.tags:
            return
        cell = inputs["cell_plan"]
        experiment = tracking.experiment_name(cell.study)
        trained = self._path("trained_cell")  # where the cell's folder is saved (the catalog's trained_cell)
        self.folder = Path(trained) if trained else tracking.MODELS_ROOT / cell.study / cell.key
        tracking.sync(experiment, self.folder.parent)
        corpora = self._path("prepared_corpora")
        datasets = tracking.corpus_datasets(f"{corpora}/{cell.task}", cell.task) if corpora else ()
        self._signals.enter_context(tracking.sigterm_raises())
        # A SIGTERM or Ctrl-C while the run opens is held until the hook knows the run, so that it ends the run
        # KILLED (arriving between the run's creation and `self.run`, it left the run RUNNING).
        with signals_deferred():
            self.run = tracking.CellRun.start(
                experiment=experiment, run_name=cell.key, params=tracking.cell_params(cell),
                tags=tracking.cell_tags(stage=dvc_stage(cell), study=cell.study, spec=cell.spec), datasets=datasets)
            atexit.register(self.end_open_run)

    def _path(self, dataset: str) -> str | None:
        """Where a dataset of the catalog lives (None outside a Kedro run)."""
        found = self.catalog.get(dataset) if self.catalog is not None else None
        return str(found.path) if found is not None else None

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
        from pipelines.tracking import end_status

        run, self.run = self.run, None
        atexit.unregister(self.end_open_run)
        # While the run ends, a stop signal (a second one, whoever sends it) must not cut that short: under the default
        # handler it met once the cell's were gone, it left the run RUNNING. A FINISHED cell keeps ignoring SIGTERM
        # until the process exits: its outputs are saved, and a SIGTERM would fail the process and make DVC discard a
        # stage MLflow calls finished.
        self._signals.enter_context(on_signals(signal.SIG_IGN, [signal.SIGTERM] if error is None else STOP_SIGNALS))
        try:  # a store that does not answer is handled there: an error is a bug of ours
            if error is None:
                run.finish(self.folder)
            else:
                run.end(end_status(error))
        except Exception:  # never hide the cell's own error behind a tracking one
            logger.exception("Could not end MLflow run %s", run.run_id)
        if error is not None:
            self._signals.close()  # the handlers from before the cell: its error goes on as it came
