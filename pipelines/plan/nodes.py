"""plan: what each later stage reads, and each stage's code fingerprint. The plan itself is computed by the check
before any node (`pipelines.param_checks.ParamsCheckHook`); `plan_files` only splits it into the stages' files."""

from pathlib import Path

import layertune
import pipelines
from pipelines.plans import Plan, TrainPlan
from pipelines.provenance import code_fingerprint, stage_fingerprint

PROJECT = Path(pipelines.__file__).resolve().parent.parent
LIBRARY = Path(layertune.__file__).resolve().parent
# What every stage runs besides its own pipeline: hooks, settings and the datasets module, followed into their
# imports (of the datasets module, into what the stage's own datasets import); the registry and the catalog, hashed
# as they are (the registry imports every stage's pipeline, but runs only one). conf/logging.yml is not: log levels
# change no output.
FOLLOWED = ("pipelines/hooks.py", "pipelines/param_checks.py", "pipelines/datasets.py", "pipelines/settings.py")
DATASETS = "pipelines/datasets.py"
HASHED = ("pipelines/pipeline_registry.py", "conf/base/catalog.yml")


def plan_files(plan: Plan) -> tuple:
    """The download plan, and per study: its plan, prepare, tokenize and train slices."""
    code = cell_code_fingerprint()
    train = {name: TrainPlan(study=name, cells=study.cells, code=code) for name, study in plan.studies.items()}
    return plan.download, plan.studies, plan.prepare, plan.features, train


def code_fingerprints() -> dict[str, dict]:
    """Per stage, the digest of every source file it runs (`pipelines.provenance`): editing a module that a stage
    does not run reruns no stage."""
    packages = {"layertune": LIBRARY, "pipelines": PROJECT / "pipelines"}
    followed, hashed = [PROJECT / name for name in FOLLOWED], [PROJECT / name for name in HASHED]
    classes = dataset_classes()
    return {stage: stage_fingerprint(PROJECT / "pipelines" / stage, followed, hashed, packages, PROJECT,
                                     {PROJECT / DATASETS: classes[stage]})
            for stage in pipelines.STAGES if stage != "plan"}


def dataset_classes() -> dict[str, frozenset[str]]:
    """Per stage, the classes of `pipelines.datasets` that its pipeline's catalog entries are."""
    from pipelines.catalog import catalog_entries
    from pipelines.pipeline_registry import register_pipelines

    entries, registered = catalog_entries("-", PROJECT), register_pipelines()
    module = "pipelines.datasets."
    return {stage: frozenset(entries[name]["type"].removeprefix(module) for name in registered[stage].datasets()
                             if name in entries and entries[name]["type"].startswith(module))
            for stage in pipelines.STAGES}


def cell_code_fingerprint() -> str:
    """One digest of every library file that training a cell runs (`layertune.cell` and its imports), read as code
    (a comment or docstring edited retrains no cell)."""
    return code_fingerprint([LIBRARY / "cell.py"], {"layertune": LIBRARY})
