"""What a stage is given, checked before any node runs, so that a bad value ends `kedro run` with one message naming
it (a command-line error) rather than a failed node and Kedro's traceback."""

from __future__ import annotations

import contextlib
from pathlib import Path

import click
from kedro.framework.hooks import hook_impl

from layertune.study import ParamsError
from pipelines.plans import plan_studies

PLAN_NODE = "plan_files"
PLAN = "plan"  # the catalog's in-memory dataset that holds the plan once it is checked
# The plan files a stage reads for one study: the catalog's paths name them by `--params study=<name>`.
STUDY_INPUTS = ("prepare_plan", "feature_plan", "study_plan", "train_plan")
FEATURE_CACHE = "feature_cache"  # the catalog's content-keyed cache folder (tokenized splits, frozen-prefix states)


class InvalidParams(click.ClickException):
    """Printed by Kedro's command line (click) as ``Error: <message>``, without a traceback; exit status 2, as for
    any bad command-line input."""

    exit_code = 2


class StageStopped(InvalidParams):
    """What stops a stage that is no bad input and no bug (a full disk): printed the same way, one line, exit
    status 1."""

    exit_code = 1


class ParamsCheckHook:
    """With the plan node, plans params.yaml (every check: parameters, local data, hub revisions) once, into the
    catalog's ``plan`` for the node that writes its files; for a later stage, checks the study it is given; for a
    stage that writes the feature cache, its folder. Then the stage holds the lock of each study whose folders it
    writes (`pipelines.processes.one_study_build`) until it ends."""

    def __init__(self) -> None:
        self._locks = contextlib.ExitStack()

    @hook_impl
    def before_pipeline_run(self, run_params, pipeline, catalog) -> None:
        studies: list[str] = []
        if any(node.name == PLAN_NODE for node in pipeline.nodes):
            try:
                plan = plan_studies(catalog.load("parameters"))
            except ParamsError as error:
                raise InvalidParams(f"{error}{_experiment_note()}") from None
            catalog.save(PLAN, plan)
            studies = list(plan.studies)
        elif any(name in pipeline.inputs() for name in STUDY_INPUTS):
            plans = Path(catalog.get("study_plans").path)
            studies = [check_planned(run_params.get("runtime_params") or {}, plans)]
        if FEATURE_CACHE in pipeline.inputs():
            check_cache_folder(Path(catalog.get(FEATURE_CACHE).path))
        self._hold(Path(run_params["project_path"]), studies)

    def _hold(self, project: Path, studies: list[str]) -> None:
        """The locks of ``studies``, held until the run ends; `StageStopped` naming the holder of one that another
        process holds. In a cell trained by several processes (`accelerate launch`), by the main one alone."""
        from layertune.distributed import is_main_process
        from pipelines.processes import BuildRunning, one_study_build

        if not studies or not is_main_process():
            return
        try:
            self._locks.enter_context(one_study_build(project, studies))
        except BuildRunning as error:
            raise StageStopped(str(error)) from None

    @hook_impl
    def after_pipeline_run(self) -> None:
        self._locks.close()

    @hook_impl
    def on_pipeline_error(self, error: Exception) -> None:
        """The study locks let go; a full disk, wherever the stage met it (a cell's model, a cache entry, tokenized
        data, a report), ends it as one `StageStopped` line naming the folder and the bytes needed, not Kedro's
        traceback (`layertune.io.disk_full_error`)."""
        from layertune.io import disk_full_error

        self._locks.close()
        if (full := disk_full_error(error)) is not None:
            raise StageStopped(full.strerror) from None


def _experiment_note() -> str:
    """Under `dvc exp run` (DVC names the experiment in ``DVC_EXP_NAME``), what DVC has done to the parameter files
    before this refusal: it applies ``-S`` values to them before any stage runs, and leaves them so when one fails."""
    import os

    if not (name := os.environ.get("DVC_EXP_NAME")):
        return ""
    return (f"\n  (dvc exp run {name}: DVC wrote any -S values into params.yaml and rounds.yaml before this check, "
            "and leaves them there: git diff params.yaml rounds.yaml shows them; undo them, or git checkout the two "
            "files if they held no edits of yours)")


def check_cache_folder(folder: Path) -> None:
    """The feature cache's folder can be written (made if missing); else `InvalidParams` naming it and the fix."""
    from layertune.io import CacheNotWritable, check_writable

    try:
        check_writable(folder)
    except CacheNotWritable as error:
        raise InvalidParams(error.advising("Point the catalog's feature_cache (conf/base/catalog.yml) at a folder "
                                           "you can write.").strerror) from None


def check_planned(runtime: dict, plans: Path) -> str:
    """The study ``--params study=<name>`` names, one that the plan wrote below ``plans``; else `InvalidParams`,
    naming the planned ones."""
    studies = sorted(path.parent.name for path in plans.glob("*/study.json"))
    study = runtime.get("study")
    if study not in studies:
        raise InvalidParams(f"unknown study {study!r} (--params study=<name>); studies: "
                            f"{', '.join(studies) or 'none'} (those of the last plan, in {plans}: after editing "
                            "params.yaml, run the plan stage first: dvc repro plan)")
    return study
