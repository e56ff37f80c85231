"""plan: params.yaml checked once and resolved into what each later stage reads (with a fingerprint of the files of
every base model a cell starts from), plus each stage's code fingerprint. Stages depend on these files, not on
params.yaml, the source tree or the models, so a stage reruns exactly when what it reads changes."""

from pathlib import Path

import layertune
import pipelines
from pipelines.plans import plan_studies as plan
from pipelines.provenance import stage_fingerprint

PROJECT = Path(pipelines.__file__).resolve().parent.parent
# What every stage runs besides its own pipeline: hooks, datasets and settings, followed into their imports; the
# registry and configuration, hashed as they are (the registry imports every stage's pipeline, but runs only one).
FOLLOWED = ("pipelines/hooks.py", "pipelines/param_checks.py", "pipelines/datasets.py", "pipelines/settings.py")
HASHED = ("pipelines/pipeline_registry.py", "conf/base/catalog.yml", "conf/logging.yml")


def plan_studies(parameters: dict) -> tuple:
    """The download plan, and per study: its plan, prepare and tokenize slices, and one spec per cell."""
    planned = plan(parameters)
    cells = {f"{cell.study}/cells/{cell.key}": cell for cell in planned.cells()}
    return planned.download, planned.studies, planned.prepare, planned.features, cells


def code_fingerprints() -> dict[str, dict]:
    """Per stage, the hash of every source file it runs (see `pipelines.provenance`)."""
    packages = {"layertune": Path(layertune.__file__).resolve().parent, "pipelines": PROJECT / "pipelines"}
    followed, hashed = [PROJECT / name for name in FOLLOWED], [PROJECT / name for name in HASHED]
    return {stage: stage_fingerprint(PROJECT / "pipelines" / stage, followed, hashed, packages, PROJECT)
            for stage in pipelines.STAGES if stage != "plan"}
