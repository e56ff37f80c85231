"""One cell: which data, which encoder(s), which head, how it trains → a folder of results.

A `CellSpec` is the whole recipe, typed and checked: a `CorpusSpec`, one `EncoderSpec` per language model (several
are combined by a `CombineSpec`), a `HeadSpec` and the `TrainingConfig` (seed included). Each spec has exactly
the arguments of the library object it builds (`LanguageModel`, `MultiEncoder`, the heads, `ModelTrainer.train`),
so anything the library can do, a cell can do. `train_cell` is the one way to train a cell: the command line, the
study pipeline and your own code all go through it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, NonNegativeFloat, PositiveFloat, PositiveInt, model_validator

from layertune.training_config import TrainingConfig

if TYPE_CHECKING:
    from torch import nn

    from layertune.corpus import Corpus
    from layertune.heads import TaskModel
    from layertune.trainer import TrainingResult

TunableLayers = int | Literal["all"]


class Spec(BaseModel):
    """Strict like `TrainingConfig`: no unknown keys, no strings for numbers, no NaN."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, allow_inf_nan=False)


# What numpy and torch take as a seed.
MAX_SEED = 2**32 - 1
Seed = Annotated[int, Field(ge=0, le=MAX_SEED)]


class SampleSpec(Spec):
    """Which examples of a corpus a cell sees: a seeded subsample (a study's ``data`` section: the same for each of
    its tasks)."""

    train_size: PositiveInt | None = Field(None, description="at most this many training examples; null: all")
    dev_size: PositiveInt | None = Field(None, description="at most this many dev examples; null: all")
    seed: Seed = Field(42, description="seed of the subsample (and of a dev split carved from train)")
    balanced: bool | None = Field(None, description="equal classes; null: the task's default (IMDb: balanced)")
    test: bool = Field(True, description="keep a labelled test split (its predictions are scored with the best "
                                         "weights); false leaves it out")


class CorpusSpec(SampleSpec):
    """Arguments of `load_corpus`: a registry task, hub id or local path, and a seeded subsample of it."""

    task: str
    config: str | None = None

    def load(self, data_mirror: str | os.PathLike | None = None) -> Corpus:
        import dataclasses

        from layertune.corpora import load_corpus

        corpus = load_corpus(self.task, self.config, data_mirror=data_mirror, train_size=self.train_size,
                             dev_size=self.dev_size, seed=self.seed, balanced=self.balanced)
        return corpus if self.test else dataclasses.replace(corpus, test=None)


class EncoderSettings(Spec):
    """Every argument of `LanguageModel` besides the model and its tunable layers."""

    pooling: Literal["cls", "mean", "pooler"] = "cls"
    hidden_dropout_prob: float | None = Field(None, ge=0, lt=1, description="null: the checkpoint's")
    freeze_embeddings: bool = False
    frozen_dropout: bool = False
    trust_remote_code: bool = False
    revision: str | None = None
    layers: str | None = Field(None, description="dotted path of the transformer layer stack (an nn.ModuleList, e.g. "
                                                 "'encoder.layer'), for models whose stack the generic search misses")


class EncoderSpec(EncoderSettings):
    """One `LanguageModel`, and optionally its own learning rate (a `MultiEncoder` tunes each of its language
    models at its own rate)."""

    model: str
    tunable_layers: TunableLayers = "all"
    learning_rate: PositiveFloat | None = Field(None, description="this language model's own rate; null: "
                                                                  "training.learning_rate")

    def build(self) -> nn.Module:
        from layertune.language_model import LanguageModel

        return LanguageModel(self.model, self.tunable_layers,
                             **self.model_dump(exclude={"model", "tunable_layers", "learning_rate"}))


class CombineSpec(Spec):
    """How a `MultiEncoder` combines its language models."""

    method: Literal["concat", "dme"]
    dropout: float = Field(0.0, ge=0, lt=1, description="on the combined vector")
    projection_size: PositiveInt | None = Field(None, description="dme's common size; null: the largest hidden size")


class HeadSpec(Spec):
    """The task head's arguments (`TextClassifier`, `TextRegressor`, `TokenClassifier`)."""

    head: Literal["linear", "mlp"] = "linear"
    head_hidden_size: PositiveInt | None = None
    head_dropout: NonNegativeFloat = Field(0.1, lt=1)


class CellSpec(Spec):
    """Everything one cell trains with. Two or more encoders need ``combine``; one must not have it."""

    corpus: CorpusSpec
    encoders: list[EncoderSpec] = Field(min_length=1)
    combine: CombineSpec | None = None
    head: HeadSpec = HeadSpec()
    training: TrainingConfig = TrainingConfig()

    @model_validator(mode="after")
    def _consistent(self) -> CellSpec:
        if (len(self.encoders) > 1) != (self.combine is not None):
            raise ValueError(f"{len(self.encoders)} encoder(s) with combine={self.combine}: several language "
                             "models need a combine method (concat or dme), a single one has none")
        rates = self.training.learning_rate
        if isinstance(rates, list) and len(rates) != len(self.encoders):
            raise ValueError(f"training.learning_rate lists {len(rates)} rates for {len(self.encoders)} encoders: "
                             "give one rate, or one per encoder in the same order")
        if isinstance(rates, list) and any(spec.learning_rate is not None for spec in self.encoders):
            raise ValueError("learning rates are given twice: as a list in training.learning_rate and as an "
                             "encoder's own learning_rate; give one or the other")
        return self

    def training_config(self) -> TrainingConfig:
        """``training``, with each encoder's own ``learning_rate`` in place of the shared one (one per encoder)."""
        own = [spec.learning_rate for spec in self.encoders]
        if all(rate is None for rate in own):
            return self.training
        rates = [rate or self.training.learning_rate for rate in own]
        return self.training.model_copy(update={"learning_rate": rates if len(rates) > 1 else rates[0]})

    def build_model(self, corpus: Corpus) -> TaskModel:
        """The encoder(s) and the head that fits ``corpus``, initialised from ``training.seed``."""
        import transformers

        from layertune.heads import build_model
        from layertune.multi_encoder import MultiEncoder

        transformers.set_seed(self.training.seed)  # before the head is built: its initial weights are part of the cell
        language_models = [spec.build() for spec in self.encoders]
        encoder = language_models[0] if self.combine is None else MultiEncoder(
            language_models, self.combine.method, self.combine.dropout, self.combine.projection_size)
        return build_model(encoder, corpus, **self.head.model_dump())


@dataclass
class TrainedCell:
    """A trained cell: its spec, what training measured, and the model at its best epoch."""

    spec: CellSpec
    result: TrainingResult
    model: TaskModel

    def save(self, directory: str | Path, *, overwrite: bool = False) -> Path:
        """The cell's folder, written all at once (an interrupted save leaves the old folder, or nothing):
        ``cell.json`` (the spec) and the files of `TrainingResult.save`, model included. An existing folder is
        replaced only if empty, a previous output, or with ``overwrite`` (`layertune.io.check_output_directory`)."""
        from layertune.io import output_directory

        with output_directory(directory, overwrite=overwrite, written_by="train_cell") as staging:
            (staging / "cell.json").write_text(self.spec.model_dump_json(indent=2) + "\n")
            self.result.save(staging, self.model)
        return Path(directory)


def train_cell(spec: CellSpec, output_dir: str | Path | None = None, *, corpus: Corpus | None = None,
               cache_dir: str | Path | None = None, data_mirror: str | os.PathLike | None = None,
               progress: bool = True, overwrite: bool = False) -> TrainedCell:
    """Train one cell, and write its folder to ``output_dir`` if given (checked before training: a folder holding
    files layertune did not write is replaced only with ``overwrite``, see `layertune.io.check_output_directory`).

    ``corpus`` is the cell's data when already loaded (the pipeline's prepared splits); otherwise it is loaded from
    ``spec.corpus``. ``cache_dir`` holds the tokenized splits and frozen-prefix states (see `layertune.frozen_prefix`).
    """
    from layertune.distributed import is_main_process
    from layertune.io import check_output_directory
    from layertune.trainer import ModelTrainer

    if output_dir is not None:
        check_output_directory(output_dir, overwrite=overwrite)
    corpus = corpus if corpus is not None else spec.corpus.load(data_mirror)
    model = spec.build_model(corpus)
    trainer = ModelTrainer(model, corpus, cache_dir=cache_dir)
    trained = TrainedCell(spec, trainer.train(args=spec.training_config(), progress=progress), trainer.model)
    if output_dir is not None and is_main_process():  # one folder, whatever the number of processes
        trained.save(output_dir, overwrite=overwrite)
    return trained


@dataclass(frozen=True)
class CellFolder:
    """Read access to a saved cell folder: each file is read when asked for."""

    path: Path

    def spec(self) -> CellSpec:
        return CellSpec.model_validate_json((self.path / "cell.json").read_text())

    def metrics(self) -> dict:
        return json.loads((self.path / "metrics.json").read_text())

    def history(self) -> list[dict]:
        return json.loads((self.path / "history.json").read_text())

    def predictions(self) -> dict[str, dict[str, list]]:
        return json.loads((self.path / "predictions.json").read_text())

    def drift(self):
        import pandas as pd

        return pd.read_csv(self.path / "drift.csv")

    def model(self, *, trust_remote_code: bool = False) -> TaskModel:
        from layertune.heads import TaskModel

        return TaskModel.from_pretrained(self.path / "model", trust_remote_code=trust_remote_code)
