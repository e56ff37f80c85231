"""One cell of a layer-ablation study: (task, model, tunable_layers, seed) → a folder of results."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import transformers
from pydantic import BaseModel, ConfigDict, Field, PositiveInt

from layertune.corpora import load_corpus
from layertune.corpus import Corpus
from layertune.heads import TaskModel, TextClassifier, TextRegressor
from layertune.language_model import LanguageModel, Pooling
from layertune.trainer import ModelTrainer, TrainingArguments, TrainingResult


class CorpusSpec(BaseModel):
    """Which data a cell trains on: a task name (or HF dataset + config) and optional seeded subsampling."""

    model_config = ConfigDict(extra="forbid")

    task: str
    config: str | None = None
    train_size: PositiveInt | None = None
    dev_size: PositiveInt | None = None
    data_seed: int = 42

    def load(self, data_mirror: str | Path | None = None) -> Corpus:
        return load_corpus(self.task, self.config, data_mirror=data_mirror, train_size=self.train_size,
                           dev_size=self.dev_size, seed=self.data_seed)


class EncoderSpec(BaseModel):
    """The `LanguageModel` of a cell."""

    model_config = ConfigDict(extra="forbid")

    model: str
    tunable_layers: int | Literal["all"] = "all"
    pooling: Pooling = "cls"
    hidden_dropout_prob: float | None = Field(None, ge=0, lt=1)
    freeze_embeddings: bool = False
    frozen_dropout: bool = False
    trust_remote_code: bool = False

    def build(self) -> LanguageModel:
        return LanguageModel(self.model, tunable_layers=self.tunable_layers, pooling=self.pooling,
                             hidden_dropout_prob=self.hidden_dropout_prob, freeze_embeddings=self.freeze_embeddings,
                             frozen_dropout=self.frozen_dropout, trust_remote_code=self.trust_remote_code)


def build_model(encoder: LanguageModel, corpus: Corpus, head: str = "linear") -> TaskModel:
    """The head that fits the corpus's task type."""
    if corpus.task_type == "regression":
        return TextRegressor(encoder, head=head)
    if corpus.task_type == "token_classification":
        from layertune.token_classification import TokenClassifier

        return TokenClassifier(encoder, len(corpus.label_names), label_names=list(corpus.label_names))
    return TextClassifier(encoder, corpus.num_classes, label_names=list(corpus.label_names), head=head)


def run_cell(corpus_spec: CorpusSpec, encoder_spec: EncoderSpec, training: TrainingArguments,
             output_dir: str | Path, *, head: str = "linear", data_mirror: str | Path | None = None,
             cache_dir: str | Path | None = None, progress: bool = True) -> TrainingResult:
    """Train one cell and write ``metrics.json``, ``history.json``, ``drift.csv``, ``best-model/`` to ``output_dir``.

    The seed in ``training`` is set before the head is built, so the whole cell is reproducible.
    """
    corpus = corpus_spec.load(data_mirror)
    transformers.set_seed(training.seed)
    model = build_model(encoder_spec.build(), corpus, head)
    trainer = ModelTrainer(model, corpus, cache_dir=cache_dir)
    return trainer.train(output_dir, progress=progress, **training.model_dump())
