"""What each pipeline stage reads, derived from params.yaml by the plan stage: one file per slice, so that a stage
reruns exactly when what it reads changes (download: the tasks; prepare: a study's tasks and subsample; tokenize:
its language models and the frozen-prefix boundaries its cells train from; train: one `StudyCell`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, PositiveInt

from layertune.cell import EncoderSpec, SampleSpec, Spec
from layertune.model_paths import model_fingerprint, model_layers
from layertune.study import StudyCell, StudyPlan, StudySpec, study_cells
from pipelines.params import validate_params


def dvc_stage(cell: StudyCell) -> str:
    """The DVC stage that trains ``cell``: ``train-<study>@<key>`` (dvc.yaml's matrix names it so)."""
    return f"train-{cell.study}@{cell.key}"


class PreparePlan(Spec):
    """What the prepare stage reads: the study's tasks and subsample."""

    tasks: list[str]
    data: SampleSpec


class CellFeatures(Spec):
    """The cached features the cells of one setting read (whatever their seed): the task, and per language model
    the index of the model in its `FeaturePlan` and the frozen-prefix boundary it trains from (None: no cache)."""

    task: str
    models: list[int]
    boundaries: list[int | None]


class FeaturePlan(Spec):
    """What the tokenize stage reads: each language model of the study (as its cells build it, less what does not
    change its frozen output), every boundary its cells train from, and how they tokenize and cache."""

    tasks: list[str]
    models: list[EncoderSpec]
    boundaries: list[list[int]]  # per model, every boundary any cell needs
    settings: dict[str, CellFeatures]  # by setting key (`StudyCell.setting_key`): adding a seed changes nothing here
    max_length: PositiveInt | None
    cache_dtype: Literal["float32", "float16", "bfloat16"]
    fingerprints: list[str | None] = []  # per model, `model_fingerprint` of its files: the states depend on them


class DownloadPlan(Spec):
    tasks: list[str]
    mirror: str | None


class Plan(BaseModel):
    """Everything the stages read, derived from params.yaml."""

    download: DownloadPlan
    studies: dict[str, StudyPlan]
    prepare: dict[str, PreparePlan]
    features: dict[str, FeaturePlan]

    def cells(self) -> list[StudyCell]:
        return [cell for study in self.studies.values() for cell in study.cells]


def feature_plan(study: StudySpec, cells: list[StudyCell]) -> FeaturePlan:
    from layertune.training_config import cache_decision

    models: list[EncoderSpec] = []
    boundaries: list[set[int]] = []
    layout: dict[str, CellFeatures] = {}
    for cell in cells:
        indices, cell_boundaries = [], []
        for spec in cell.spec.encoders:
            # The frozen states depend on the weights and config, not on which top layers train or how they pool.
            base = spec.model_copy(update={"tunable_layers": "all", "pooling": "cls", "learning_rate": None})
            if base not in models:
                models.append(base)
                boundaries.append(set())
            indices.append(models.index(base))
            frozen = None if spec.tunable_layers == "all" else model_layers(spec.model) - spec.tunable_layers
            used, _ = cache_decision(frozen, spec.frozen_dropout, cell.spec.training.frozen_prefix_cache)
            cell_boundaries.append(frozen if used else None)
            if used:
                boundaries[indices[-1]].add(frozen)
        layout[cell.setting_key] = CellFeatures(task=cell.task, models=indices, boundaries=cell_boundaries)
    return FeaturePlan(tasks=study.tasks, models=models, boundaries=[sorted(b) for b in boundaries], settings=layout,
                       max_length=study.training.max_length, cache_dtype=study.training.cache_dtype,
                       fingerprints=[model_fingerprint(model.model) for model in models])


def plan_studies(params: Mapping[str, Any]) -> Plan:
    """params.yaml → the `Plan`: validated once, every cell resolved to its `CellSpec`."""
    checked = validate_params(params)
    studies = {name: StudyPlan(name=name, spec=study, cells=study_cells(name, study))
               for name, study in checked.studies.items()}
    tasks = list(dict.fromkeys(task for study in checked.studies.values() for task in study.tasks))
    return Plan(download=DownloadPlan(tasks=tasks, mirror=checked.download.mirror), studies=studies,
                prepare={name: PreparePlan(tasks=s.tasks, data=s.data) for name, s in checked.studies.items()},
                features={name: feature_plan(s.spec, s.cells) for name, s in studies.items()})
