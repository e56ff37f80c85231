"""Parameters checked before a stage runs anything, so that a bad one ends `kedro run` with one message naming it (a
command-line error) rather than a failed node or dataset and Kedro's traceback: params.yaml and the data it names
(and dvc.yaml's train stages) for the plan stage, ``--params study=…,cell=…`` against the plan for the stages after
it."""

from __future__ import annotations

from pathlib import Path

import click
from kedro.framework.hooks import hook_impl

from layertune.errors import choices_hint
from layertune.study import ParamsError
from pipelines.dvc_stages import decided_studies, stale_train_stages
from pipelines.plans import plan_studies

PLAN_NODE = "plan_studies"
# The plan files a stage reads for one study (and cell): the catalog's paths name them by `--params`.
STUDY_INPUTS = ("prepare_plan", "feature_plan", "study_plan", "cell_plan")


class InvalidParams(click.ClickException):
    """Printed by Kedro's command line (click) as ``Error: <message>``, without a traceback; exit status 2, as for
    any other bad command-line input."""

    exit_code = 2


class ParamsCheckHook:
    """Checks params.yaml when a run includes the plan node: all of the plan's checks (the parameters, each study's
    local data, its hub datasets' revisions), so that a bad one ends the run before any node, as one ``Error:``
    line, not a failed node with Kedro's traceback and its advice to resume; the node plans again (for runs outside
    Kedro's command line, with the same message). Also the study and cell a later stage is given."""

    @hook_impl
    def before_pipeline_run(self, run_params, pipeline, catalog) -> None:
        if any(node.name == PLAN_NODE for node in pipeline.nodes):
            parameters = catalog.load("parameters")
            try:
                planned = plan_studies(parameters)
            except ParamsError as error:
                raise InvalidParams(str(error)) from None
            check_train_stages(Path(run_params["project_path"]) / "dvc.yaml",
                               {name: study.spec.grid_axis for name, study in planned.studies.items()},
                               decided_studies(parameters))
        elif inputs := [name for name in STUDY_INPUTS if name in pipeline.inputs()]:
            plans = Path(catalog.get("study_plans").path)
            check_planned(run_params.get("runtime_params") or {}, plans, cell="cell_plan" in inputs)


def check_train_stages(dvc_yaml: Path, studies: dict[str, str], decided: list[str]) -> None:
    """dvc.yaml (where the project has one) has the train stages of the planned ``studies`` ({name: grid axis}):
    else a study added to params.yaml would run prepare and tokenize, then fail in evaluate, its cells never
    trained. DVC's matrix takes each study's grid from params.yaml; only a study's own block is written by a
    command, which the message names (and a decided study's second block, for its recorded rounds)."""
    if dvc_yaml.is_file() and (problem := stale_train_stages(dvc_yaml.read_text(), studies, decided)):
        raise InvalidParams(problem)


def check_planned(runtime: dict, plans: Path, cell: bool) -> None:
    """``--params study=<name>`` (and ``cell=<key>``) name a study (and a cell of it) that the plan wrote below
    ``plans``; else `InvalidParams`, naming them."""
    studies = sorted(path.parent.name for path in plans.glob("*/study.json"))
    study = runtime.get("study")
    if study not in studies:
        raise InvalidParams(f"unknown study {study!r} (--params study=<name>); studies: "
                            f"{', '.join(studies) or 'none'} (those of the last plan, in {plans}: after editing "
                            "params.yaml, run the plan stage first: dvc repro plan)")
    key = runtime.get("cell")
    cells = sorted(path.stem for path in (plans / study / "cells").glob("*.json"))
    if cell and key not in cells:
        raise InvalidParams(f"study {study!r} has no cell {key!r} (--params study={study},cell=<key>)."
                            f"{choices_hint(key, cells)}")
