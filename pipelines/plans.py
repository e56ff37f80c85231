"""What each stage reads, derived from params.yaml by the plan stage: one file per slice, so that a stage reruns
exactly when what it reads changes (docs/pipeline.md, "Dependencies that cannot drift"). A study's own data is checked
here, before any training: local files are loaded as prepare will load them, and a hub dataset is pinned to the
commit its revision names today."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, PositiveInt

from layertune.specs import CorpusSpec, DatasetSpec, EncoderSpec, Spec
from layertune.model_specs import cache_boundary, states_spec
from layertune.model_paths import model_fingerprint
from layertune.study import ParamsError, StudyCell, StudyPlan, StudySpec, study_cells
from pipelines.params import validate_params

COMMIT = re.compile(r"^[0-9a-f]{40}$")


def dvc_stage(study: str) -> str:
    """The DVC stage that trains the cells of ``study`` (dvc.yaml's matrix names it so)."""
    return f"train@{study}"


class PreparePlan(Spec):
    """What the prepare stage reads: per task, its corpus (dataset and subsample), the downloaded folder it reads
    (None: local files, read where they are) and a fingerprint of those local files (an edited row reruns it)."""

    corpora: dict[str, CorpusSpec]
    downloaded: dict[str, str | None]
    fingerprints: dict[str, str | None]


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
    cache_dtype: Literal["auto", "float32", "float16", "bfloat16"]
    mixed_precision: Literal["auto", "no", "fp16", "bf16"] = "auto"  # the cells' autocast, which the pass computes in
    fingerprints: list[str | None] = []  # per model, `model_fingerprint` of its files: the states depend on them


class TrainPlan(Spec):
    """What the train stage reads: the study's cells in the order they train (the grid's, then a decided study's
    later rounds), and ``code``, the fingerprint of the library code that trains a cell (part of each cell's build
    key: `pipelines.trained_cells`)."""

    study: str
    cells: list[StudyCell]
    code: str


class DownloadPlan(Spec):
    """Built-in tasks (from the data mirror or the hub) and hub datasets (at a pinned commit), by download folder."""

    tasks: list[str]
    mirror: str | None
    hub: dict[str, DatasetSpec] = {}


def download_folder(dataset: DatasetSpec) -> str | None:
    """Where the download stage puts ``dataset`` under data/01_raw: the built-in task's name, or the hub id, config
    and commit (``owner--name--config@commit``); None for local files (read where they are)."""
    from layertune.corpora.sources import resolve_task

    if dataset.task is not None:
        return resolve_task(dataset.task, dataset.config).name
    if dataset.hub is not None:
        return "--".join(filter(None, (*dataset.hub.split("/"), dataset.config))) + f"@{dataset.revision}"
    return None


def pin_revision(dataset: DatasetSpec, where: str) -> DatasetSpec:
    """A hub dataset at the commit its revision (default: main) names now; a 40-hex commit is kept as given."""
    if dataset.hub is None or dataset.revision is not None and COMMIT.match(dataset.revision):
        return dataset
    try:
        from huggingface_hub import HfApi

        commit = HfApi().dataset_info(dataset.hub, revision=dataset.revision).sha
    except Exception as error:  # offline, unknown dataset or revision: all say the same to the user
        at = f" at revision {dataset.revision!r}" if dataset.revision else ""
        raise ParamsError(f"{where}.hub: cannot resolve hub dataset {dataset.hub!r}{at} ({type(error).__name__}: "
                          f"{error}). Give revision: <40-hex commit> to pin it without asking the hub, or point "
                          "path: at a local copy.") from None
    return dataset.model_copy(update={"revision": commit})


def check_local_data(corpus: CorpusSpec, where: str) -> str | None:
    """Load ``corpus`` from local files as the prepare stage will (columns, labels, subsample), and return a
    fingerprint of the files it reads (names and contents); None when it reads none. An error names the key."""
    import xxhash

    from layertune.errors import CorpusArgumentError
    from layertune.io import file_digest

    if corpus.path is None:
        return None
    try:
        corpus.load()
        files = corpus.data_files()
    except CorpusArgumentError as error:
        raise ParamsError(f"{where}.{error.argument}: {error}") from None
    except (ValueError, OSError) as error:
        raise ParamsError(f"{where}: {error}") from None
    digest = xxhash.xxh3_128()
    for path in files:
        digest.update(f"{path.name}\0{file_digest(path)}\n".encode())
    return digest.hexdigest()


class Plan(BaseModel):
    """Everything the stages read, derived from params.yaml."""

    download: DownloadPlan
    studies: dict[str, StudyPlan]
    prepare: dict[str, PreparePlan]
    features: dict[str, FeaturePlan]

    def cells(self) -> list[StudyCell]:
        return [cell for study in self.studies.values() for cell in study.cells]


def feature_plan(study: StudySpec, cells: list[StudyCell]) -> FeaturePlan:
    """Every cache entry the study's cells read: per distinct frozen part (`states_spec`), the boundaries its cells
    train from (`cache_boundary`), and per setting which of them it reads."""
    models: list[EncoderSpec] = []
    boundaries: list[set[int]] = []
    layout: dict[str, CellFeatures] = {}
    for cell in cells:
        indices, cell_boundaries = [], []
        for spec in cell.spec.encoders:
            base = states_spec(spec)
            if base not in models:
                models.append(base)
                boundaries.append(set())
            indices.append(models.index(base))
            cell_boundaries.append(boundary := cache_boundary(spec, cell.spec.training.frozen_prefix_cache))
            if boundary is not None:
                boundaries[indices[-1]].add(boundary)
        layout[cell.setting_key] = CellFeatures(task=cell.task, models=indices, boundaries=cell_boundaries)
    return FeaturePlan(tasks=list(study.tasks), models=models, boundaries=[sorted(b) for b in boundaries], settings=layout,
                       max_length=study.training.max_length, cache_dtype=study.training.cache_dtype,
                       mixed_precision=study.training.mixed_precision,
                       fingerprints=[model_fingerprint(model.model) for model in models])


def prepare_plan(name: str, study: StudySpec) -> PreparePlan:
    corpora = {task: study.corpus_spec(task) for task in study.tasks}
    return PreparePlan(corpora=corpora, downloaded={task: download_folder(c) for task, c in corpora.items()},
                       fingerprints={task: check_local_data(c, f"studies.{name}.tasks.{task}")
                                     for task, c in corpora.items()})


def plan_studies(params: Mapping[str, Any]) -> Plan:
    """params.yaml → the `Plan`: validated once, hub datasets pinned, local data checked, every cell resolved to
    its `CellSpec`."""
    checked = validate_params(params)
    pinned = {name: study.model_copy(update={"tasks": {
                  task: pin_revision(dataset, f"studies.{name}.tasks.{task}") for task, dataset in study.tasks.items()}})
              for name, study in checked.studies.items()}
    studies = {name: StudyPlan(name=name, spec=study, cells=study_cells(name, study)) for name, study in pinned.items()}
    datasets = [dataset for study in pinned.values() for dataset in study.tasks.values()]
    download = DownloadPlan(
        tasks=list(dict.fromkeys(download_folder(d) for d in datasets if d.task is not None)),
        mirror=checked.download.mirror, hub={download_folder(d): d for d in datasets if d.hub is not None})
    return Plan(download=download, studies=studies,
                prepare={name: prepare_plan(name, study) for name, study in pinned.items()},
                features={name: feature_plan(s.spec, s.cells) for name, s in studies.items()})
