"""Studies: grids of cells declared in ``params.yaml``, checked once, and the plan every pipeline stage works from.

Every study under ``studies:`` has the same shape::

    studies:
      <name>:
        report: {kind: layers, tolerance: 0.01}     # which report function, and its options
        tasks: [sst2, stsb]                          # ┐
        encoders: {<encoder name>: <model>, ...}     # │ the grid: one cell per
        tunable_layers: [0, 1, 2, all]               # │ task × encoder × tunable layers × seed
        seeds: [1, 2]                                # ┘
        data: {train_size: 300, dev_size: null}      # CorpusSpec (less the task)
        encoder: {pooling: mean}                     # LanguageModel arguments for every encoder
        head: {head: linear}                         # the task head's arguments
        training: {learning_rate: 2.0e-4, ...}       # ModelTrainer.train arguments (the seed comes from seeds)
        per_tunable_layers: {0: {head_learning_rate: 3.0e-3}}   # training overrides for one K

An encoder is a model (``minilm: sentence-transformers/all-MiniLM-L6-v2``), a model with its own settings and
learning rate (``roberta: {model: roberta-base, hidden_dropout_prob: 0.4, learning_rate: 1.0e-5}``), or several of
the study's encoders combined (``dme: {combine: dme, members: [minilm, roberta]}``). Encoder names name folders and
DVC stages, so each cell has a readable key: ``<task>-<encoder>-<tunable_layers>-<seed>``, the name DVC's matrix
gives the cell's ``train-<study>`` stage.

`validate_params` checks the whole file once and names every bad key by its dotted path. `plan_studies` turns it
into typed objects: one `StudyCell` per cell (the `CellSpec` it trains) and, per study, the slice of the study each
stage reads, so that a stage reruns exactly when what it reads changes.
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Annotated, Any, Literal, get_args, get_origin

from pydantic import (
    BaseModel,
    Discriminator,
    Field,
    NonNegativeFloat,
    PositiveFloat,
    PositiveInt,
    Tag,
    ValidationError,
    field_validator,
    model_validator,
)

from layertune.cell import (
    CellSpec,
    CombineSpec,
    CorpusSpec,
    EncoderSettings,
    EncoderSpec,
    HeadSpec,
    Spec,
    TunableLayers,
)
from layertune.errors import choices_hint, describe_validation_error
from layertune.training_config import TrainingConfig

# Names of studies, encoders and tasks name folders and DVC stages, and reach Kedro as `--params study=<name>`,
# which reads each value as YAML: so a letter first (never a number: `01` would arrive as 1), no dots (DVC reads
# `${studies.<name>.tasks}` as a path) and none of YAML's words for true, false and null (`yes` would arrive as
# True). Study and task names are lower case; encoder names may name their model (`all-MiniLM-L6-v2`).
NAME = re.compile(r"^[a-z][a-z0-9_-]*$")
ENCODER_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_-]*$")
YAML_WORDS = frozenset({"y", "n", "yes", "no", "on", "off", "true", "false", "null"})
# What numpy and torch take as a seed.
MAX_SEED = 2**32 - 1
Seed = Annotated[int, Field(ge=0, le=MAX_SEED)]
_LAYER_ATTRIBUTES = ("num_hidden_layers", "n_layers", "num_layers")
_POSITION_ATTRIBUTES = ("max_position_embeddings", "n_positions")
# Layer counts and longest inputs (tokens) of common hub models, so that a study can be checked offline (the hub is
# asked only for others).
KNOWN_MODELS = {name: (layers, 512) for name, layers in {
    "bert-base-cased": 12, "bert-base-uncased": 12, "bert-large-cased": 24, "bert-large-uncased": 24,
    "google-bert/bert-base-cased": 12, "google-bert/bert-base-uncased": 12, "SpanBERT/spanbert-base-cased": 12,
    "roberta-base": 12, "roberta-large": 24, "FacebookAI/roberta-base": 12, "FacebookAI/roberta-large": 24,
    "google/electra-base-discriminator": 12, "distilbert-base-uncased": 6, "distilbert-base-cased": 6,
    "distilbert/distilbert-base-uncased": 6,
}.items()}


# Training keys that decide what the tokenize stage caches for every cell, and the seed (the seeds axis).
STUDY_WIDE_TRAINING = {"max_length", "cache_dtype", "frozen_prefix_cache", "seed"}


class ParamsError(ValueError):
    """``params.yaml`` is invalid; the message names every bad key by its dotted path."""


def name_problem(name: object, pattern: re.Pattern = NAME) -> str | None:
    """Why ``name`` cannot name a study, encoder or task (see `NAME`), or None."""
    letters = "lower-case letters" if pattern is NAME else "letters"
    rule = f"{letters}, digits, '_' and '-', starting with a letter (it names folders, DVC stages and `kedro run " \
           "--params` values)"
    if not isinstance(name, str):
        kind = {bool: "a boolean", int: "a number", float: "a number", type(None): "null"}.get(type(name), "a date")
        return f"{name!r} is not a valid name: YAML read it as {kind}, not as text; a name is {rule}"
    if not pattern.match(name):
        return f"{name!r} is not a valid name: a name is {rule}"
    if name.lower() in YAML_WORDS:
        return f"{name!r} is not a valid name: YAML reads it as a boolean or null, not as text"
    return None


def _unique(values: list, what: str) -> list:
    repeated = sorted({str(v) for v in values if values.count(v) > 1})
    if repeated:
        raise ValueError(f"{what} must not repeat; {', '.join(repeated)} appear more than once")
    return values


def layers_order(values: Iterable[TunableLayers]) -> list[TunableLayers]:
    """0, 1, 2, … then 'all': the row order of an ablation table."""
    return sorted(set(values), key=lambda k: (k == "all", k if k != "all" else 0))


# ------------------------------------------------------------------------------------------------------- schema


# The report functions of `layertune.reports.REPORTS` (named here too: checking params.yaml imports no reports).
ReportKind = Literal["layers", "ner", "encoders"]


class ReportSpec(Spec):
    """Which report function builds the study's report (`layertune.reports.REPORTS`), and its options."""

    kind: ReportKind
    tolerance: NonNegativeFloat = Field(0.01, description="a setting within this of the best (metric units: 0.01 = "
                                                          "1 point) counts as good enough")
    confidence: float = Field(0.95, gt=0.5, lt=1, description="of the intervals and tests")
    resamples: PositiveInt = Field(1000, description="bootstrap resamples of dev examples and seeds")
    examples: int = Field(5, ge=0, description="dev examples shown one by one (dme attention, tagged sentences)")


class DataSpec(Spec):
    """`CorpusSpec` less the task: the same subsample for every task of the study."""

    train_size: PositiveInt | None = None
    dev_size: PositiveInt | None = None
    seed: Seed = 42
    balanced: bool | None = None
    test: bool = True


class SingleEncoder(EncoderSettings):
    """A model with settings of its own (anything unset comes from the study's ``encoder`` section)."""

    model: str
    learning_rate: PositiveFloat | None = Field(None, description="this model's rate; null: training.learning_rate")


class CombinedEncoder(Spec):
    """Several of the study's single encoders, combined by a `MultiEncoder`."""

    combine: Literal["concat", "dme"]
    members: list[str] = Field(min_length=2)
    dropout: float = Field(0.0, ge=0, lt=1)
    projection_size: PositiveInt | None = None


def _encoder_kind(entry: Any) -> str:
    if isinstance(entry, str):
        return "model"
    return "combined" if isinstance(entry, Mapping) and "combine" in entry or isinstance(entry, CombinedEncoder) \
        else "single"


# A model id, a model with settings, or a combination; tagged so that an error names only the form that was meant.
EncoderEntry = Annotated[Annotated[str, Tag("model")] | Annotated[SingleEncoder, Tag("single")]
                         | Annotated[CombinedEncoder, Tag("combined")], Discriminator(_encoder_kind)]
ENCODER_TAGS = ("model", "single", "combined")


class StudySpec(Spec):
    """One study of ``params.yaml``: its grid, the shared settings of its cells, and its report."""

    report: ReportSpec
    tasks: list[str] = Field(min_length=1)
    encoders: dict[str, EncoderEntry] = Field(min_length=1)
    tunable_layers: list[TunableLayers] = Field(min_length=1)
    seeds: list[Seed] = Field(min_length=1)
    data: DataSpec = DataSpec()
    encoder: EncoderSettings = EncoderSettings()
    head: HeadSpec = HeadSpec()
    training: TrainingConfig = TrainingConfig()
    per_tunable_layers: dict[TunableLayers, dict[str, Any]] = Field(
        {}, description="training arguments for one tunable-layers value, e.g. {0: {head_learning_rate: 3.0e-3}}")

    @field_validator("tasks")
    @classmethod
    def _tasks(cls, tasks: list[str]) -> list[str]:
        from layertune.tasks import TASKS

        for task in tasks:
            if task not in TASKS:
                raise ValueError(f"unknown task {task!r}.{choices_hint(task, TASKS)}")
        return _unique(tasks, "tasks")

    @field_validator("tunable_layers")
    @classmethod
    def _layers(cls, values: list) -> list:
        for value in values:
            if value != "all" and value < 0:
                raise ValueError(f"tunable layers must be 'all' or an int >= 0; got {value}")
        return _unique(values, "tunable_layers")

    @field_validator("seeds")
    @classmethod
    def _seeds(cls, seeds: list[int]) -> list[int]:
        return _unique(seeds, "seeds")

    @field_validator("per_tunable_layers", mode="before")
    @classmethod
    def _numeric_keys(cls, overrides: Any) -> Any:
        # Mapping keys pass through JSON and some YAML writers as text: "0" is the tunable-layers value 0.
        if isinstance(overrides, Mapping):
            return {int(k) if isinstance(k, str) and k.isdigit() else k: v for k, v in overrides.items()}
        return overrides

    @model_validator(mode="after")
    def _consistent(self) -> StudySpec:
        for name, entry in self.encoders.items():
            if isinstance(entry, CombinedEncoder):
                for member in entry.members:
                    if not isinstance(self.encoders.get(member), (str, SingleEncoder)):
                        single = [n for n, e in self.encoders.items() if not isinstance(e, CombinedEncoder)]
                        raise ValueError(f"encoders.{name}.members: {member!r} is not a single encoder of this "
                                         f"study.{choices_hint(member, single)}")
        for k, overrides in self.per_tunable_layers.items():
            if k not in self.tunable_layers:
                raise ValueError(f"per_tunable_layers has {k!r}, which is not in tunable_layers {self.tunable_layers}")
            if shared := sorted(set(overrides) & STUDY_WIDE_TRAINING):
                raise ValueError(f"per_tunable_layers.{k}: {', '.join(shared)} can only be set for the whole study "
                                 "(in training): the tokenized features and cached states are shared by its cells")
        for k in self.tunable_layers:
            self.training_for(k, seed=0)  # a bad override fails here, naming its key
        return self

    # -------------------------------------------------------------------------------------------------- cells

    def members(self, encoder: str) -> list[tuple[str, SingleEncoder]]:
        """The single encoders behind ``encoder`` (itself, or a combination's members), with their settings."""
        entry = self.encoders[encoder]
        names = entry.members if isinstance(entry, CombinedEncoder) else [encoder]
        return [(name, self._single(self.encoders[name])) for name in names]

    @staticmethod
    def _single(entry: str | SingleEncoder) -> SingleEncoder:
        return SingleEncoder(model=entry) if isinstance(entry, str) else entry

    def encoder_specs(self, encoder: str, tunable_layers: TunableLayers) -> list[EncoderSpec]:
        specs = []
        for _, single in self.members(encoder):
            settings = {**self.encoder.model_dump(), **single.model_dump(include=single.model_fields_set)}
            settings.pop("learning_rate", None)
            specs.append(EncoderSpec(tunable_layers=tunable_layers, **settings))
        return specs

    def training_for(self, tunable_layers: TunableLayers, seed: int, encoder: str | None = None) -> TrainingConfig:
        """The study's training arguments, with the overrides of ``per_tunable_layers[K]``, the cell's seed and, for
        ``encoder``, each member's own learning rate."""
        values = {**self.training.model_dump(), **self.per_tunable_layers.get(tunable_layers, {}), "seed": seed}
        if encoder is not None:
            rates = [single.learning_rate or values["learning_rate"] for _, single in self.members(encoder)]
            values["learning_rate"] = rates if len(rates) > 1 else rates[0]
        try:
            return TrainingConfig.model_validate(values)
        except ValidationError as error:
            raise _nested(error, ("per_tunable_layers", tunable_layers)) from None

    def cell_spec(self, task: str, encoder: str, tunable_layers: TunableLayers, seed: int) -> CellSpec:
        entry = self.encoders[encoder]
        combine = (CombineSpec(method=entry.combine, dropout=entry.dropout, projection_size=entry.projection_size)
                   if isinstance(entry, CombinedEncoder) else None)
        return CellSpec(corpus=CorpusSpec(task=task, **self.data.model_dump()),
                        encoders=self.encoder_specs(encoder, tunable_layers), combine=combine, head=self.head,
                        training=self.training_for(tunable_layers, seed, encoder))


def _nested(error: ValidationError, prefix: tuple) -> ParamsError:
    return ParamsError("; ".join(describe_validation_error(error, prefix)))


class DownloadSection(Spec):
    mirror: str | None = Field(None, description="folder with glue/, imdb/, ner/; $LAYERTUNE_DATA_MIRROR wins; null "
                                                 "and no variable: the Hugging Face hub")


class StudyParams(Spec):
    """All of ``params.yaml``."""

    download: DownloadSection
    studies: dict[str, StudySpec] = Field(min_length=1)

    @model_validator(mode="before")
    @classmethod
    def _names(cls, params: Any) -> Any:
        """Study and encoder names, checked before anything else: an error names the key, not the whole mapping."""
        studies = params.get("studies") if isinstance(params, Mapping) else None
        if not isinstance(studies, Mapping):
            return params
        problems = [f"studies.{name}: {problem}" for name in studies if (problem := name_problem(name))]
        for name, study in studies.items():
            encoders = study.get("encoders") if isinstance(study, Mapping) else None
            problems += [f"studies.{name}.encoders.{encoder}: {problem}" for encoder in (encoders or {})
                         if isinstance(encoders, Mapping) and (problem := name_problem(encoder, ENCODER_NAME))]
        if problems:
            raise ParamsError("\n  ".join(problems))
        return params

    @model_validator(mode="after")
    def _models_fit(self) -> StudyParams:
        """Each study's tunable layers and max_length, against every model it tunes (from the models' configs)."""
        for study_name, study in self.studies.items():
            for encoder in study.encoders:
                for member, single in study.members(encoder):
                    where = f"studies.{study_name}.encoders.{member}"
                    limit = model_layers(single.model, where=where)
                    for position, k in enumerate(study.tunable_layers):
                        if k != "all" and k > limit:
                            raise ParamsError(
                                f"studies.{study_name}.tunable_layers[{position}]: {k} is out of range: encoder "
                                f"{member!r} ({single.model}) has {limit} layers, so tunable layers go from 0 to "
                                f"{limit} (or 'all').")
                    longest = model_max_length(single.model, where=where)
                    if study.training.max_length and longest and study.training.max_length > longest:
                        raise ParamsError(
                            f"studies.{study_name}.training.max_length: {study.training.max_length} is longer than "
                            f"encoder {member!r} ({single.model}) takes: at most {longest} tokens (its config's "
                            "max_position_embeddings and its tokenizer's model_max_length).")
        return self


# --------------------------------------------------------------------------------------------------- validation


def validate_params(params: Mapping[str, Any], source: str = "params.yaml") -> StudyParams:
    """The whole parameter file, checked; raises `ParamsError` naming each bad key by its dotted path."""
    for name, study in (params.get("studies") or {}).items():
        if isinstance(study, Mapping) and "seed" in (study.get("training") or {}):
            raise ParamsError(f"{source} is invalid:\n  studies.{name}.training.seed: each cell's seed comes from "
                              f"studies.{name}.seeds; remove this key")
    try:
        return StudyParams.model_validate(dict(params))
    except ValidationError as error:
        raise ParamsError(_describe(error, source)) from None
    except ParamsError as error:
        raise ParamsError(f"{source} is invalid:\n  {error}") from None


def _describe(error: ValidationError, source: str) -> str:
    lines = describe_validation_error(error, known_keys=_known_keys, union_tags=ENCODER_TAGS)
    return f"{source} is invalid:\n  " + "\n  ".join(lines)


def _known_keys(location: tuple) -> list[str]:
    """The keys valid at ``location`` (for 'did you mean'): walk the schema, stepping over mapping keys."""
    annotation: Any = StudyParams
    for part in location:
        model = _model_in(annotation)
        if model is not None and isinstance(part, str) and part in model.model_fields:
            annotation = model.model_fields[part].annotation
        elif get_origin(annotation) is dict:
            annotation = get_args(annotation)[1]  # `part` was a key of the mapping: go to its values
    model = _model_in(annotation)
    return list(model.model_fields) if model else []


def _model_in(annotation: Any) -> type[BaseModel] | None:
    """The model class of an annotation (the first one inside a union or Annotated), or None."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for argument in get_args(annotation):
        if (model := _model_in(argument)) is not None and get_origin(annotation) is not dict:
            return model
    return None


@functools.cache
def model_config(name: str, where: str = "model") -> dict | None:
    """``name``'s config as a dict: its config.json when local, packaged or mirrored (with ``model_max_length`` from
    its tokenizer_config.json), None for a known hub model (`KNOWN_MODELS`), else the hub's config. Only the small
    JSON files are read: checking a study loads no model. An unknown name raises `ParamsError` naming ``where``."""
    from layertune.model_paths import MODEL_MIRROR_ENV, PACKAGED_MODELS, resolve_model_path

    folder = Path(resolve_model_path(name))
    if (folder / "config.json").is_file():
        config = _read_json(folder / "config.json", where)
        if (folder / "tokenizer_config.json").is_file():
            config["tokenizer_model_max_length"] = _read_json(folder / "tokenizer_config.json", where).get(
                "model_max_length")
        return config
    if name in KNOWN_MODELS:
        return None
    try:
        import transformers

        return transformers.AutoConfig.from_pretrained(name).to_dict()
    except (OSError, ValueError) as error:
        known = [*PACKAGED_MODELS, *KNOWN_MODELS]
        mirror = os.environ.get(MODEL_MIRROR_ENV)
        raise ParamsError(f"{where}: unknown model {name!r}: not a local folder, not a packaged model, not in the "
                          f"model mirror (${MODEL_MIRROR_ENV}={mirror!r}), not a known hub model, and the hub did "
                          f"not provide it ({type(error).__name__}).{choices_hint(name, known)}") from None


def _read_json(path: Path, where: str) -> dict:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ParamsError(f"{where}: {path} is not valid JSON ({error})") from None


def model_layers(name: str, where: str = "model") -> int:
    """How many transformer layers ``name`` has (see `model_config`)."""
    config = model_config(name, where)
    if config is None:
        return KNOWN_MODELS[name][0]
    try:
        return next(config[a] for a in _LAYER_ATTRIBUTES if a in config)
    except StopIteration:
        raise ParamsError(f"{where}: the config of {name!r} is not a model config with a layer count "
                          f"({', '.join(_LAYER_ATTRIBUTES)})") from None


def model_max_length(name: str, where: str = "model") -> int | None:
    """The longest input ``name`` takes, in tokens, as `LanguageModel.max_length` has it: the smaller of its
    positions (``max_position_embeddings``) and its tokenizer's ``model_max_length`` (where either is stated)."""
    config = model_config(name, where)
    if config is None:
        return KNOWN_MODELS[name][1]
    # Tokenizers without a limit state a huge placeholder (transformers' VERY_LARGE_INTEGER).
    limits = [config.get(a) for a in (*_POSITION_ATTRIBUTES, "tokenizer_model_max_length")]
    limits = [limit for limit in limits if isinstance(limit, int) and 0 < limit < 10**9]
    return min(limits) if limits else None


def model_fingerprint(name: str) -> str | None:
    """A hash of the files of ``name``'s folder (local, packaged or mirrored): config, weights, tokenizer; not
    hidden files, subfolders or Markdown. It is recorded in the plan files the cells depend on, so that changing a
    model's files in place reruns the cells built on it. Names, sizes and contents only: the same files elsewhere
    (another machine's mirror) give the same hash. None for a hub model (no files here)."""
    from layertune.model_paths import resolve_model_path

    folder = Path(resolve_model_path(name))
    if not folder.is_dir():
        return None
    files = sorted(f for f in folder.iterdir() if f.is_file() and not f.name.startswith(".") and f.suffix != ".md")
    return _files_fingerprint(tuple((f, f.stat().st_size, f.stat().st_mtime_ns) for f in files))


@functools.cache
def _files_fingerprint(files: tuple[tuple[Path, int, int], ...]) -> str:
    """Keyed by each file's size and modification time, so that a plan hashes each model once (not once per cell)
    and a changed file is hashed again."""
    import xxhash

    from layertune.io import file_digest

    digest = xxhash.xxh3_128()
    for path, size, _ in files:
        digest.update(f"{path.name}\0{size}\0{file_digest(path)}\n".encode())
    return digest.hexdigest()


# --------------------------------------------------------------------------------------------------------- plan


class StudyCell(Spec):
    """One cell of a study: where it sits in the grid, and the `CellSpec` it trains."""

    study: str
    task: str
    encoder: str
    tunable_layers: TunableLayers
    seed: int
    spec: CellSpec
    model_fingerprints: list[str | None] = Field(
        [], description="per language model of spec.encoders, `model_fingerprint` of the files it starts from")

    @property
    def key(self) -> str:
        """The name DVC's matrix gives this cell (its values joined by '-', in the matrix's order)."""
        return "-".join(str(v) for v in (self.task, self.encoder, self.tunable_layers, self.seed))

    @property
    def path(self) -> str:
        """``<study>/<key>``: the cell's folder below data/04_models, and the ``--params cell=`` value."""
        return f"{self.study}/{self.key}"

    @property
    def dvc_stage(self) -> str:
        return f"train-{self.study}@{self.key}"

    @property
    def setting_key(self) -> str:
        """``<task>-<encoder>-<tunable_layers>``: the key less the seed, shared by the cells of one setting."""
        return "-".join(str(v) for v in (self.task, self.encoder, self.tunable_layers))

    @property
    def setting(self) -> tuple[str, str, TunableLayers]:
        """What the cell measures, seeds aside."""
        return self.task, self.encoder, self.tunable_layers


class StudyPlan(Spec):
    """A validated study and its cells: what the evaluate and aggregate stages read."""

    name: str
    spec: StudySpec
    cells: list[StudyCell]

    def cell(self, key: str) -> StudyCell:
        for cell in self.cells:
            if cell.key == key:
                return cell
        raise KeyError(f"{self.name} has no cell {key!r}.{choices_hint(key, [c.key for c in self.cells])}")


class PreparePlan(Spec):
    """What the prepare stage reads: the study's tasks and subsample."""

    tasks: list[str]
    data: DataSpec


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


def study_cells(name: str, study: StudySpec) -> list[StudyCell]:
    """Every task × encoder × tunable layers × seed, in the order of DVC's matrix."""
    fingerprints = {encoder: [model_fingerprint(single.model) for _, single in study.members(encoder)]
                    for encoder in study.encoders}
    return [StudyCell(study=name, task=task, encoder=encoder, tunable_layers=k, seed=seed,
                      spec=study.cell_spec(task, encoder, k, seed), model_fingerprints=fingerprints[encoder])
            for task, encoder, k, seed in itertools.product(study.tasks, study.encoders, study.tunable_layers,
                                                             study.seeds)]


def feature_plan(study: StudySpec, cells: list[StudyCell]) -> FeaturePlan:
    from layertune.training_config import cache_decision

    models: list[EncoderSpec] = []
    boundaries: list[set[int]] = []
    layout: dict[str, CellFeatures] = {}
    for cell in cells:
        indices, cell_boundaries = [], []
        for spec in cell.spec.encoders:
            # The frozen states depend on the weights and config, not on which top layers train or how they pool.
            base = spec.model_copy(update={"tunable_layers": "all", "pooling": "cls"})
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
