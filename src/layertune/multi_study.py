"""The "single vs multi" study: each encoder alone and their combinations, same task and seeds, one report.

A study lists its ``models``; its systems are each model alone, then each of ``combinations`` (default: all models
together) combined by each of ``combine_methods`` (``concat``, ``dme``). `run_system` trains one (system, seed) cell
and returns one row; `run_study` collects the rows (and tracks each cell in MLflow); `report_markdown` turns the
table into ``reports/multi_encoder.md``.

Every key is flat or a list of scalars, so ``dvc exp run -S multi_encoder.<key>=...`` and profiles can change any one.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import pandas as pd
import torch
import transformers
from pydantic import BaseModel, ConfigDict, Field, PositiveFloat, PositiveInt, field_validator, model_validator

from layertune.batching import make_loader
from layertune.cell import CorpusSpec, EncoderSpec, build_model
from layertune.corpus import Corpus
from layertune.heads import TaskModel
from layertune.language_model import LanguageModel, Pooling, resolve_model_path
from layertune.multi_encoder import CombineMethod, MultiEncoder
from layertune.trainer import ModelTrainer, TrainingArguments

SHARED_MODELS_ENV = "LAYERTUNE_SHARED_MODELS"
DEFAULT_SHARED_MODELS = Path("../shared/models")
ATTENTION = "attention/"  # results column prefix: mean dme weight of encoder <name> on dev (a valid MLflow name)

TunableLayers = int | Literal["all"]


@dataclass(frozen=True)
class System:
    """One row of the report: a model alone (``combine_method`` None) or several combined."""

    name: str
    members: tuple[int, ...]  # indices into StudySpec.models
    combine_method: CombineMethod | None = None


class StudySpec(BaseModel):
    """A whole study, validated up front so that a typo fails before any training.

    Per-model keys (``tunable_layers``, ``learning_rates``, ``hidden_dropout_prob``) take one value for every model,
    or a list with one value per model. A learning rate of null means ``training.learning_rate``.
    """

    model_config = ConfigDict(extra="forbid")

    corpus: CorpusSpec
    models: list[str] = Field(min_length=2, description="hub ids, packaged models, paths or names in models_dir")
    tunable_layers: TunableLayers | list[TunableLayers] = "all"
    learning_rates: PositiveFloat | None | list[PositiveFloat | None] = None
    hidden_dropout_prob: float | None | list[float | None] = None
    pooling: Pooling = "cls"
    combinations: list[list[int]] | None = Field(None, description="sets of model indices; null: all models")
    combine_methods: list[CombineMethod] = Field(["concat", "dme"], min_length=1)
    dropout: float = Field(0.0, ge=0, lt=1, description="on the combined vector")
    projection_size: PositiveInt | None = Field(None, description="dme's common size; null: largest hidden size")
    training: TrainingArguments = Field(default_factory=TrainingArguments)
    seeds: list[int] = Field(min_length=1)
    head: Literal["linear", "mlp"] = "linear"
    models_dir: str | None = Field(None, description=f"folder of local models; null: ${SHARED_MODELS_ENV}, "
                                                     f"else {DEFAULT_SHARED_MODELS}")
    mlflow_experiment: str | None = Field("layertune-multi-encoder", description="one run per (system, seed); "
                                                                                 "null: no tracking")

    @field_validator("training")
    @classmethod
    def _one_shared_rate(cls, training: TrainingArguments) -> TrainingArguments:
        if isinstance(training.learning_rate, list):
            raise ValueError("training.learning_rate is one rate, the default of every model; give per-model rates "
                             "as learning_rates")
        return training

    @model_validator(mode="after")
    def _consistent(self) -> StudySpec:
        if len(set(self.labels)) != len(self.labels):
            raise ValueError(f"models must have distinct names (they label the report): {self.labels}")
        for key in ("tunable_layers", "learning_rates", "hidden_dropout_prob"):
            value = getattr(self, key)
            if isinstance(value, list) and len(value) != len(self.models):
                raise ValueError(f"{key} lists {len(value)} values for {len(self.models)} models: give one per "
                                 "model, in the order of models, or a single value for all")
        for members in self.combinations or []:
            if len(set(members)) < 2 or not all(0 <= i < len(self.models) for i in members):
                raise ValueError(f"combinations: {members} must name at least two different models by their index, "
                                 f"0 to {len(self.models) - 1}")
        for index in range(len(self.models)):
            self.encoder_spec(index)  # per-model values out of range fail here, before any training
        return self

    @property
    def labels(self) -> list[str]:
        """Short model names: the last part of each hub id or path."""
        return [model.rstrip("/").split("/")[-1] for model in self.models]

    def per_model(self, key: str, index: int):
        value = getattr(self, key)
        return value[index] if isinstance(value, list) else value

    def learning_rate(self, index: int) -> float:
        return self.per_model("learning_rates", index) or self.training.learning_rate

    def encoder_spec(self, index: int) -> EncoderSpec:
        return EncoderSpec(model=locate_model(self.models[index], self.models_dir), pooling=self.pooling,
                           tunable_layers=self.per_model("tunable_layers", index),
                           hidden_dropout_prob=self.per_model("hidden_dropout_prob", index))

    def systems(self) -> list[System]:
        """Each model alone, then every combination by every method."""
        singles = [System(label, (index,)) for index, label in enumerate(self.labels)]
        combinations = self.combinations or [list(range(len(self.models)))]
        combined = [System(f"{method}: " + " + ".join(self.labels[i] for i in members), tuple(members), method)
                    for members in combinations for method in self.combine_methods]
        return singles + combined


def locate_model(model: str, models_dir: str | Path | None = None) -> str:
    """A model name found in the local models folder becomes that folder's path; anything else is kept as is."""
    root = Path(models_dir or os.environ.get(SHARED_MODELS_ENV) or DEFAULT_SHARED_MODELS)
    return str(root / model) if (root / model).is_dir() else model


def check_models_exist(study: StudySpec) -> None:
    """Fail before any training when a model is neither local, nor packaged, nor on the hub."""
    for index, model in enumerate(study.models):
        try:
            transformers.AutoConfig.from_pretrained(resolve_model_path(study.encoder_spec(index).model))
        except OSError as error:
            root = study.models_dir or os.environ.get(SHARED_MODELS_ENV) or DEFAULT_SHARED_MODELS
            raise ValueError(f"models[{index}]: {model!r} is not in the models folder {root} (set models_dir or "
                             f"${SHARED_MODELS_ENV}), not packaged, and the hub did not provide it "
                             f"({error}).") from None


def build_encoder(study: StudySpec, system: System) -> LanguageModel | MultiEncoder:
    language_models = [study.encoder_spec(index).build() for index in system.members]
    if system.combine_method is None:
        return language_models[0]
    return MultiEncoder(language_models, system.combine_method, study.dropout, study.projection_size)


def system_learning_rate(study: StudySpec, system: System) -> float | list[float]:
    """Each member's own rate; a list, one per encoder, for a combination."""
    rates = [study.learning_rate(index) for index in system.members]
    return rates if system.combine_method else rates[0]


def run_system(corpus: Corpus, study: StudySpec, system: System, seed: int, *,
               cache_dir: str | Path | None = None, progress: bool = False) -> dict:
    """Train one (system, seed) cell; its dev score and, for dme, each encoder's mean attention on dev."""
    transformers.set_seed(seed)  # before the head and combination layer are initialised
    model = build_model(build_encoder(study, system), corpus, study.head)
    arguments = {**study.training.model_dump(), "seed": seed, "learning_rate": system_learning_rate(study, system)}
    result = ModelTrainer(model, corpus, cache_dir=cache_dir).train(progress=progress, **arguments)
    labels = [study.labels[index] for index in system.members]
    row = {
        "task": corpus.name, "system": system.name, "encoders": " + ".join(labels),
        "combine_method": system.combine_method or "single", "seed": seed, "metric": corpus.main_metric,
        "score": result.best_score, "best_epoch": result.best_epoch, "train_time_s": result.train_time_s,
        "trainable_parameters": result.trainable_parameters,
    }
    if system.combine_method == "dme":
        weights = mean_dev_attention(model, corpus, study.training, cache_dir)
        row.update({f"{ATTENTION}{label}": weight for label, weight in zip(labels, weights)})
    return row


@torch.no_grad()
def mean_dev_attention(model: TaskModel, corpus: Corpus, training: TrainingArguments,
                       cache_dir: str | Path | None = None) -> list[float]:
    """Mean dme weight of each encoder over the dev split, on the same tokenization (and caches) as training."""
    device = next(model.parameters()).device
    _, dev, _ = model.encoder.prepare_examples(
        corpus, max_length=training.max_length, cache_dir=cache_dir, frozen_prefix_cache=training.frozen_prefix_cache,
        cache_dtype=training.cache_dtype, device=device)
    model.eval()
    weights = []
    for batch in make_loader(dev, training.eval_batch_size or training.batch_size):
        model({key: value.to(device) for key, value in batch.items()})
        weights.append(model.encoder.last_attention.float().cpu())
    return torch.cat(weights).mean(0).tolist()


def run_study(study: StudySpec, *, data_mirror: str | Path | None = None, cache_dir: str | Path | None = None,
              progress: bool = False) -> pd.DataFrame:
    """Every system × seed of ``study``, one row each (see `run_system`)."""
    check_models_exist(study)
    corpus = study.corpus.load(data_mirror)
    rows = []
    for system in study.systems():
        for seed in study.seeds:
            with _tracked(study, system, seed) as run:
                rows.append(run_system(corpus, study, system, seed, cache_dir=cache_dir, progress=progress))
                if run is not None:
                    run.log_metrics({k: v for k, v in rows[-1].items() if k != "seed"})
    return pd.DataFrame(rows)


def _tracked(study: StudySpec, system: System, seed: int) -> contextlib.AbstractContextManager:
    """An MLflow run for one cell (FINISHED, or FAILED / KILLED if it does not complete), unless tracking is off."""
    if study.mlflow_experiment is None:
        return contextlib.nullcontext()
    from layertune import tracking

    params = {
        "task": study.corpus.task, "system": system.name, "combine_method": system.combine_method or "single",
        "seed": seed, "models": [study.models[i] for i in system.members],
        "tunable_layers": [study.per_model("tunable_layers", i) for i in system.members],
        "hidden_dropout_prob": [study.per_model("hidden_dropout_prob", i) for i in system.members],
        "learning_rate": system_learning_rate(study, system), "pooling": study.pooling, "head": study.head,
        "dropout": study.dropout, "projection_size": study.projection_size,
        "train_size": study.corpus.train_size, "dev_size": study.corpus.dev_size,
        **{k: v for k, v in study.training.model_dump().items() if k not in ("learning_rate", "seed")},
    }
    return tracking.track_run(study.mlflow_experiment, f"{system.name}-seed{seed}", params,
                              tracking.cell_tags(stage="multi_encoder", study="multi_encoder"))


# --------------------------------------------------------------------------------------------------------------
# Report


def summarize(results: pd.DataFrame) -> pd.DataFrame:
    """Per task and system: mean and std of the score over seeds, mean train time, mean attention columns."""
    attention = [c for c in results.columns if c.startswith(ATTENTION)]
    grouped = results.groupby(["task", "metric", "system", "encoders", "combine_method"], sort=False)
    summary = grouped.agg(mean=("score", "mean"), std=("score", "std"), seeds=("seed", "nunique"),
                          train_time_s=("train_time_s", "mean"))
    if attention:
        summary = summary.join(grouped[attention].mean())
    return summary.reset_index()


def report_markdown(results: pd.DataFrame) -> str:
    """``reports/multi_encoder.md``: per task, mean ± std per system over seeds, best in bold, dme attention."""
    summary = summarize(results)
    sections = ["# Single vs multi encoder\n",
                "Dev score ×100, mean ± std over seeds (best in bold). For dme, the mean attention weight each "
                "encoder received on the dev set (weights sum to 1 per example).\n"]
    for (task, metric), table in summary.groupby(["task", "metric"], sort=False):
        sections.append(_task_section(task, metric, table))
    return "\n".join(sections)


def _task_section(task: str, metric: str, table: pd.DataFrame) -> str:
    best = table["mean"].max()
    lines = [f"## {task}: {metric}\n", f"| system | seeds | {metric} | train time (s) | mean attention (dme) |",
             "|---|---|---|---|---|"]
    for row in table.to_dict("records"):  # records, not tuples: "attention/<name>" is no attribute name
        score = f"{100 * row['mean']:.1f}" + ("" if pd.isna(row["std"]) else f" ± {100 * row['std']:.1f}")
        score = f"**{score}**" if row["mean"] == best else score
        lines.append(f"| {row['system']} | {row['seeds']} | {score} | {row['train_time_s']:.0f} | "
                     f"{_attention_text(row)} |")
    return "\n".join(lines) + "\n"


def _attention_text(row: dict) -> str:
    weights = {key.removeprefix(ATTENTION): value for key, value in row.items()
               if key.startswith(ATTENTION) and not pd.isna(value)}
    return ", ".join(f"{name} {weight:.2f}" for name, weight in weights.items())


def summary_metrics(results: pd.DataFrame) -> dict:
    """``{task: {system: {mean, std, seeds}}}`` for ``dvc metrics show`` (std is 0.0 with one seed)."""
    metrics = {}
    for row in summarize(results).to_dict("records"):
        std = 0.0 if pd.isna(row["std"]) else float(row["std"])
        metrics.setdefault(row["task"], {})[row["system"]] = {
            "metric": row["metric"], "mean": float(row["mean"]), "std": std, "seeds": int(row["seeds"])}
    return metrics


def write_report(results: pd.DataFrame, path: str | Path = "reports/multi_encoder.md") -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(report_markdown(results))
    return path
