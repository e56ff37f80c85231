"""A layer-ablation study: the schema of ``params.yaml``, its grid of cells, profiles, and dev-set evaluation.

``params.yaml`` is the one parameter file: DVC reads it for each stage's ``params`` and the train ``matrix``, Kedro
reads it as its parameters. :func:`validate_params` checks all of it before any work starts and names the offending
key (``train.learning_rate``, ``study.tunable_layers[2]``) in the error. A profile (``profiles/<name>.yaml``) is a
set of overrides of existing keys, applied as ``dvc exp run -S key=value`` arguments (:func:`profile_overrides`).
"""

from __future__ import annotations

import itertools
import json
import os
import re
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeFloat,
    PlainValidator,
    PositiveFloat,
    PositiveInt,
    ValidationError,
    field_validator,
    model_validator,
)

from layertune.errors import choices_hint

if TYPE_CHECKING:
    import pandas as pd

    from layertune.corpus import Corpus



def _tunable_layers(value: Any) -> int | str:
    if value == "all" or (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
        return value
    raise ValueError("must be 'all' or an int >= 0 (the number of top layers that train)")


def _sentence_task(task: str) -> str:
    from layertune.corpora import TASKS

    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}.{choices_hint(task, sentence_tasks())}")
    if TASKS[task].task_type not in ("classification", "regression"):
        raise ValueError(f"{task!r} is a {TASKS[task].task_type} task; a study trains sentence (pair) "
                         f"classification or regression: {', '.join(sentence_tasks())}")
    return task


def sentence_tasks() -> list[str]:
    from layertune.corpora import TASKS

    return [name for name, spec in TASKS.items() if spec.task_type in ("classification", "regression")]


TunableLayers = Annotated[int | str, PlainValidator(_tunable_layers)]
Task = Annotated[str, AfterValidator(_sentence_task)]
ModelName = Annotated[str, AfterValidator(lambda name: check_model_name(name))]

# Layer counts of common hub models, so a study can be validated offline (the hub is asked only for others).
KNOWN_MODEL_LAYERS = {
    "bert-base-cased": 12, "bert-base-uncased": 12, "bert-large-cased": 24, "bert-large-uncased": 24,
    "google-bert/bert-base-cased": 12, "google-bert/bert-base-uncased": 12,
    "roberta-base": 12, "roberta-large": 24, "FacebookAI/roberta-base": 12, "FacebookAI/roberta-large": 24,
    "distilbert-base-uncased": 6, "distilbert-base-cased": 6, "distilbert/distilbert-base-uncased": 6,
}
_LAYER_ATTRIBUTES = ("num_hidden_layers", "n_layers", "num_layers")
_SLUG = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
_MODEL_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_./-]*$")


class ParamsError(ValueError):
    """``params.yaml`` is invalid; the message names every bad key by its dotted path."""


class _Section(BaseModel):
    # strict: "3" is not an int and 1e-3 written as a string is not a float (YAML 1.1 reads `1e-3` as a string).
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


def _unique(values: list, what: str) -> list:
    repeated = sorted({str(v) for v in values if values.count(v) > 1})
    if repeated:
        raise ValueError(f"{what} must not repeat; {', '.join(repeated)} appear more than once")
    return values


class StudySection(_Section):
    """The grid: every task × model × tunable_layers × seed is one cell (one DVC ``train@...`` stage)."""

    name: str = Field(description="names the MLflow experiment ('layertune-<name>') and the reports")
    tasks: list[Task] = Field(min_length=1)
    models: list[ModelName] = Field(min_length=1)
    tunable_layers: list[TunableLayers] = Field(min_length=1)
    seeds: list[int] = Field(min_length=1)

    @field_validator("name")
    @classmethod
    def _slug(cls, value: str) -> str:
        if not _SLUG.match(value):
            raise ValueError(f"must be letters, digits, '_', '.' or '-' (it names folders); got {value!r}")
        return value

    @field_validator("tasks", "models", "seeds")
    @classmethod
    def _no_repeats(cls, values: list, info) -> list:
        return _unique(values, info.field_name)

    @field_validator("tunable_layers")
    @classmethod
    def _sorted_layers(cls, values: list) -> list:
        return _unique(values, "tunable_layers")

    def cells(self) -> list[Cell]:
        return [Cell(t, m, k, s) for t, m, k, s in itertools.product(self.tasks, self.models, self.tunable_layers,
                                                                      self.seeds)]


class CellSection(_Section):
    """The one cell that ``kedro run --pipeline train|evaluate`` acts on; DVC passes each with ``--params``."""

    task: str
    model: ModelName
    tunable_layers: TunableLayers
    seed: int


class DownloadSection(_Section):
    mirror: str | None = Field(None, description="folder with glue/ and imdb/; $LAYERTUNE_DATA_MIRROR wins; "
                                                 "null and no variable: the Hugging Face hub")


class PrepareSection(_Section):
    train_size: PositiveInt | None = Field(None, description="at most this many training examples (seeded)")
    dev_size: PositiveInt | None = Field(None, description="at most this many dev examples (seeded)")
    balanced: bool | None = Field(None, description="equal classes; null: the task's default (IMDb balanced)")
    seed: int = 42


class TokenizeSection(_Section):
    max_length: PositiveInt | None = Field(None, description="truncation length; null: the task's default")
    frozen_prefix: bool = Field(True, description="cache the frozen layers' output for every boundary")
    cache_dtype: Literal["float32", "float16", "bfloat16"] = "float32"


class TrainSection(_Section):
    learning_rate: PositiveFloat = 5e-5
    head_learning_rate: PositiveFloat | None = None
    batch_size: PositiveInt = 16
    epochs: PositiveInt = 3
    weight_decay: NonNegativeFloat = 0.0
    warmup_ratio: float = Field(0.0, ge=0, le=1)
    max_grad_norm: PositiveFloat | None = 1.0
    pooling: Literal["cls", "mean", "pooler"] = "cls"
    head: Literal["linear", "mlp"] = "linear"
    group_by_length: bool = False
    mixed_precision: Literal["auto", "no", "fp16", "bf16"] = "auto"


class EvaluateSection(_Section):
    batch_size: PositiveInt = 64


class AggregateSection(_Section):
    tolerance: NonNegativeFloat = Field(0.01, description="recommend the smallest K within this of the best mean "
                                                         "score (absolute, in metric units: 0.01 = 1 point)")


class StudyParams(_Section):
    """All of ``params.yaml``. Every section is required, so a missing or misspelt section is an error."""

    study: StudySection
    cell: CellSection
    download: DownloadSection
    prepare: PrepareSection
    tokenize: TokenizeSection
    train: TrainSection
    evaluate: EvaluateSection
    aggregate: AggregateSection
    # Studies of their own, each a single stage: their keys are checked by layertune.ner_study.NerParams and
    # layertune.multi_study.StudySpec when that stage starts, before any training (keeps this module torch-free).
    ner: dict[str, Any] | None = None
    multi_encoder: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _layers_in_range(self) -> StudyParams:
        for index, model in enumerate(self.study.models):
            limit = model_layers(model, where=f"study.models[{index}]")
            for position, k in enumerate(self.study.tunable_layers):
                if k != "all" and k > limit:
                    raise ParamsError(f"study.tunable_layers[{position}]: {k} is out of range: {model!r} has "
                                      f"{limit} layers, so tunable layers go from 0 to {limit} (or 'all').")
        return self


SECTIONS: dict[str, type[_Section]] = {name: f.annotation for name, f in StudyParams.model_fields.items()}


# ------------------------------------------------------------------------------------------------- validation


def validate_params(params: Mapping[str, Any], source: str = "params.yaml") -> StudyParams:
    """The whole parameter file, checked; raises `ParamsError` naming each bad key by its dotted path."""
    try:
        return StudyParams.model_validate(dict(params))
    except ValidationError as error:
        raise ParamsError(_describe(error, StudyParams, source)) from None


def section(name: str, values: Mapping[str, Any], source: str = "params.yaml") -> Any:
    """One section (``"train"``, ``"study"`` …) checked on its own, keys named ``<name>.<key>`` in errors."""
    if name not in SECTIONS:
        raise ParamsError(f"{source}: unknown section {name!r}.{choices_hint(name, SECTIONS)}")
    model = SECTIONS[name]
    try:
        return model.model_validate(dict(values))
    except ValidationError as error:
        raise ParamsError(_describe(error, model, source, prefix=(name,))) from None


def _describe(error: ValidationError, model: type[BaseModel], source: str, prefix: tuple = ()) -> str:
    lines = []
    for item in error.errors():
        location = (*prefix, *item["loc"])
        key = _dotted(location)
        if not key:  # a check across keys, which names its keys itself
            lines.append(item["msg"].removeprefix("Value error, "))
        elif item["type"] == "extra_forbidden":
            parent = _model_at(model, location[len(prefix):-1])
            known = list(parent.model_fields) if parent else []
            lines.append(f"{key}: unknown key.{choices_hint(location[-1], known)}")
        elif item["type"] == "missing":
            lines.append(f"{key}: required key is missing")
        else:
            message = item["msg"].removeprefix("Value error, ")
            lines.append(f"{key}: {message} (got {item['input']!r})")
    return f"{source} is invalid:\n  " + "\n  ".join(dict.fromkeys(lines))


def _dotted(location: Iterable) -> str:
    text = ""
    for part in location:
        if isinstance(part, int):
            text += f"[{part}]"
        else:
            text += f".{part}" if text else str(part)
    return text


def _model_at(model: type[BaseModel], path: tuple) -> type[BaseModel] | None:
    for part in path:
        field = model.model_fields.get(part) if isinstance(part, str) else None
        if field is None or not isinstance(field.annotation, type) or not issubclass(field.annotation, BaseModel):
            return None
        model = field.annotation
    return model


def check_model_name(name: str) -> str:
    """A model name becomes folder names (``data/04_models/<task>/<model>/…``) in the catalog and in dvc.yaml, so it
    must be a relative path inside them: a hub id (``org/name``), a packaged name, or a folder below the project."""
    parts = Path(name).parts
    if not name or Path(name).is_absolute() or name.startswith("~") or ".." in parts or not _MODEL_NAME.match(name):
        raise ValueError(f"{name!r} cannot name a folder of the study: use a hub id ('org/name'), a packaged model, "
                         f"or a relative path without '..' (link a local model into the project)")
    return name


def model_layers(name: str, where: str = "model") -> int:
    """How many transformer layers ``name`` has: from its config when local or packaged, else a table of known
    hub models, else the hub's config. Unknown names raise `ParamsError` naming ``where``."""
    from layertune.language_model import PACKAGED_MODELS, resolve_model_path

    folder = Path(resolve_model_path(name))
    if (folder / "config.json").is_file():
        config = json.loads((folder / "config.json").read_text())
        return next(config[a] for a in _LAYER_ATTRIBUTES if a in config)
    if name in KNOWN_MODEL_LAYERS:
        return KNOWN_MODEL_LAYERS[name]
    try:
        import transformers

        config = transformers.AutoConfig.from_pretrained(name)
    except (OSError, ValueError) as error:
        known = [*PACKAGED_MODELS, *KNOWN_MODEL_LAYERS]
        raise ParamsError(f"{where}: unknown model {name!r}: not a local folder, not a packaged model, not a known "
                          f"hub model, and the hub did not provide it ({type(error).__name__})."
                          f"{choices_hint(name, known)}") from None
    return next(getattr(config, a) for a in _LAYER_ATTRIBUTES if hasattr(config, a))


# ----------------------------------------------------------------------------------------------------- cells


@dataclass(frozen=True)
class Cell:
    """One (task, model, tunable_layers, seed) point of the grid."""

    task: str
    model: str
    tunable_layers: int | str
    seed: int

    @classmethod
    def from_params(cls, values: Mapping[str, Any]) -> Cell:
        checked = section("cell", values)
        return cls(checked.task, checked.model, checked.tunable_layers, checked.seed)

    @property
    def dvc_stage(self) -> str:
        """The name DVC's matrix gives this cell's train stage (values joined by '-', in matrix order)."""
        return f"train@{self.task}-{self.model}-{self.tunable_layers}-{self.seed}"

    def as_dict(self) -> dict:
        return {"task": self.task, "model": self.model, "tunable_layers": self.tunable_layers, "seed": self.seed}


def layers_order(values: Iterable[int | str]) -> list[int | str]:
    """0, 1, 2, … then 'all': the row order of an ablation table."""
    return sorted(set(values), key=lambda k: (k == "all", k if k != "all" else 0))


# ------------------------------------------------------------------------------------------- stage building blocks


def data_mirror(download: DownloadSection) -> str | None:
    """Where download reads from: ``$LAYERTUNE_DATA_MIRROR`` when set (CI points it anywhere), else
    ``download.mirror``; None lets `load_corpus` fall back to the Hugging Face hub."""
    from layertune.corpora import MIRROR_ENV

    return None if os.environ.get(MIRROR_ENV) else download.mirror


def prepare_corpus(load: Callable[..., Corpus], prepare: PrepareSection) -> Corpus:
    """The seeded subsample a study trains on: at most ``train_size`` / ``dev_size`` examples (stratified, or
    balanced), dev carved from train when the task has none. ``load(**options)`` is `load_corpus` on raw files."""
    full = load()
    sizes = {"train_size": prepare.train_size, "dev_size": prepare.dev_size}
    for split, size in (("train", prepare.train_size), ("dev", prepare.dev_size)):
        if size is not None and size >= len(getattr(full, split)):
            sizes[f"{split}_size"] = None  # "at most": a smaller split is kept whole
    if sizes == {"train_size": None, "dev_size": None} and prepare.balanced is None:
        return full
    return load(**sizes, seed=prepare.seed, balanced=prepare.balanced)


def feature_cache_dir(root: str | Path, task: str, model: str) -> Path:
    """The cache of one (task, model): ``tokenized/`` and ``frozen_prefix/`` below ``<root>/<task>/<model>``."""
    return Path(root) / task / check_model_name(model)


def build_features(corpus: Corpus, model: str, tunable_layers: Iterable[int | str], tokenize: TokenizeSection,
                   cache_dir: str | Path, encoder: Any = None) -> dict:
    """Tokenize ``corpus`` for ``model`` and, in one forward pass per split, cache the hidden states entering every
    frozen/tunable boundary the study needs; every train cell then finds them in ``cache_dir``.

    Returns a manifest of what the cache holds (tokenized folders and frozen-prefix entries)."""
    import torch

    from layertune.frozen_prefix import FrozenPrefixCache
    from layertune.language_model import LanguageModel
    from layertune.tokenization import tokenize_corpus

    cache_dir = Path(cache_dir)
    encoder = encoder or LanguageModel(model, tunable_layers=0)
    tokenized = tokenize_corpus(corpus, encoder.tokenizer, max_length=tokenize.max_length,
                                cache_dir=cache_dir / "tokenized")
    manifest = {"examples": {split: len(data) for split, data in tokenized.items()},
                "tokens": {split: int(sum(data["length"])) for split, data in tokenized.items()}}
    if not tokenize.frozen_prefix:
        return manifest
    boundaries = sorted({encoder.num_layers - k for k in tunable_layers if k != "all"})
    cache = FrozenPrefixCache(cache_dir / "frozen_prefix", dtype=tokenize.cache_dtype, progress=False)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for split in ("train", "dev"):
        cache.build(encoder, tokenized[split], boundaries, device=device)
    manifest["frozen_prefix_boundaries"] = boundaries
    return manifest


def train_cell(corpus: Corpus, cell: Cell, train: TrainSection, tokenize: TokenizeSection,
               cache_dir: str | Path | None = None) -> tuple[Any, Any]:
    """Train one cell; returns the `TrainingResult` and the model with its best epoch's weights."""
    import transformers

    from layertune.cell import EncoderSpec, build_model
    from layertune.trainer import ModelTrainer, TrainingArguments

    arguments = TrainingArguments(
        learning_rate=train.learning_rate, head_learning_rate=train.head_learning_rate,
        batch_size=train.batch_size, epochs=train.epochs, weight_decay=train.weight_decay,
        warmup_ratio=train.warmup_ratio, max_grad_norm=train.max_grad_norm, seed=cell.seed,
        group_by_length=train.group_by_length, mixed_precision=train.mixed_precision,
        max_length=tokenize.max_length, cache_dtype=tokenize.cache_dtype,
        frozen_prefix_cache="auto" if tokenize.frozen_prefix else False,
    )
    transformers.set_seed(cell.seed)  # before the head is built: its initial weights are part of the cell
    encoder = EncoderSpec(model=cell.model, tunable_layers=cell.tunable_layers, pooling=train.pooling).build()
    trainer = ModelTrainer(build_model(encoder, corpus, train.head), corpus, cache_dir=cache_dir)
    result = trainer.train(None, progress=False, **arguments.model_dump())
    return result, trainer.model


def evaluate_model(model: Any, corpus: Corpus, tokenize: TokenizeSection, batch_size: int) -> tuple[pd.DataFrame,
                                                                                             dict[str, float]]:
    """Dev-set predictions of a saved model (``index``, ``label``, ``prediction``, plus label names when the task
    has them) and the task's metrics. The whole model runs, as at inference, on the same tokenization as training
    (tokenized into a temporary folder: the study's cache belongs to the tokenize stage)."""
    import tempfile

    import pandas as pd
    import torch
    from torch.utils.data import DataLoader

    from layertune.batching import Examples
    from layertune.metrics import compute_metrics
    from layertune.tokenization import tokenize_corpus

    tokenizer = model.encoder.tokenizer
    with tempfile.TemporaryDirectory(prefix="layertune-evaluate-") as scratch:
        dev = tokenize_corpus(corpus, tokenizer, max_length=tokenize.max_length, cache_dir=scratch)["dev"]
        examples = Examples(dev, tokenizer.pad_token_id or 0)
    # Batches of similar lengths waste little on padding; the rows are put back in dev order afterwards.
    order = sorted(range(len(examples)), key=lambda i: examples.lengths[i])
    loader = DataLoader(examples, batch_size=batch_size, sampler=order, collate_fn=examples.collate)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model.to(device).eval()
    predictions, references = [None] * len(order), [None] * len(order)
    with torch.no_grad():
        for start, batch in zip(range(0, len(order), batch_size), loader):
            batch = {k: v.to(device) for k, v in batch.items()}
            batch_predictions, batch_references = model.metric_inputs(model(batch).float(), batch["labels"])
            for index, prediction, reference in zip(order[start:], batch_predictions, batch_references):
                predictions[index], references[index] = prediction, reference
    table = pd.DataFrame({"index": range(len(references)), "label": references, "prediction": predictions})
    if corpus.label_names:
        names = list(corpus.label_names)
        table["label_name"] = [names[i] for i in references]
        table["prediction_name"] = [names[i] for i in predictions]
    return table, compute_metrics(corpus.metrics, predictions, references)


# -------------------------------------------------------------------------------------------------- profiles


def profile_names(root: str | Path = ".") -> list[str]:
    """The profiles shipped in ``<root>/profiles``."""
    return sorted(p.stem for p in (Path(root) / "profiles").glob("*.yaml"))


def load_profile(name_or_path: str | Path, root: str | Path = ".") -> dict[str, Any]:
    """A profile's overrides ``{dotted.key: value}`` from ``profiles/<name>.yaml`` (or a path)."""
    import yaml

    path = Path(name_or_path)
    if not path.suffix:
        path = Path(root) / "profiles" / f"{name_or_path}.yaml"
    if not path.is_file():
        raise FileNotFoundError(f"No profile {str(name_or_path)!r} ({path} is missing)."
                                f"{choices_hint(name_or_path, profile_names(root))}")
    overrides = yaml.safe_load(path.read_text()) or {}
    if not isinstance(overrides, dict) or not all(isinstance(k, str) for k in overrides):
        raise ParamsError(f"{path}: a profile is a mapping of dotted keys to values, e.g. 'train.epochs: 1'.")
    return overrides


def apply_overrides(params: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """``params`` with each ``dotted.key`` replaced; a key that is not already there is an error (as for -S)."""
    merged = json.loads(json.dumps(dict(params)))
    for key, value in overrides.items():
        node, parts = merged, key.split(".")
        for part in parts[:-1]:
            if not isinstance(node, dict) or part not in node:
                raise ParamsError(f"profile key {key!r}: {part!r} is not a section of params.yaml")
            node = node[part]
        if parts[-1] not in node:
            raise ParamsError(f"profile key {key!r}: no such key in params.yaml.{choices_hint(parts[-1], node)}")
        node[parts[-1]] = value
    return merged


def profile_overrides(overrides: Mapping[str, Any]) -> list[str]:
    """``dvc exp run`` arguments for a profile: ``-S key=value`` with values in Hydra's override syntax."""
    arguments = []
    for key, value in overrides.items():
        arguments += ["-S", f"{key}={_hydra_value(value)}"]
    return arguments


def _hydra_value(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return "[" + ",".join(_hydra_value(v) for v in value) + "]"
    if isinstance(value, float):
        return repr(value)
    return str(value)


def main(argv: list[str] | None = None) -> int:
    """``python -m layertune.study <profile>`` prints the ``dvc exp run`` arguments that select it;
    ``--check`` validates params.yaml with the profile applied instead."""
    import argparse

    import yaml

    parser = argparse.ArgumentParser(prog="python -m layertune.study", description=main.__doc__)
    parser.add_argument("profile", help=f"a name in profiles/ ({', '.join(profile_names())}) or a path")
    parser.add_argument("--check", action="store_true", help="validate params.yaml with the profile applied")
    parser.add_argument("--params", default="params.yaml")
    args = parser.parse_args(argv)
    try:
        overrides = load_profile(args.profile)
        if args.check:
            validate_params(apply_overrides(yaml.safe_load(Path(args.params).read_text()), overrides))
            print(f"{args.profile}: valid")
        else:
            print(" ".join(profile_overrides(overrides)))
    except (ParamsError, FileNotFoundError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
