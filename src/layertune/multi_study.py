"""The "single vs multi" study: each encoder alone and their combinations, same task and seeds, one report.

A study names its encoders once (``encoders``) and lists its ``systems``: one encoder alone, or several combined by a
`MultiEncoder` (``concat`` or ``dme``). `run_system` trains one (system, seed) cell and returns one row; `run_study`
collects every row into a table; `report_markdown` turns that table into ``reports/multi_encoder.md``.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import pandas as pd
import torch
import transformers
from pydantic import BaseModel, ConfigDict, Field, PositiveInt, field_validator, model_validator

from layertune.batching import make_loader
from layertune.cell import CorpusSpec, EncoderSpec, build_model
from layertune.corpus import Corpus
from layertune.errors import choices_hint
from layertune.heads import TaskModel
from layertune.language_model import LanguageModel, resolve_model_path
from layertune.multi_encoder import CombineMethod, MultiEncoder
from layertune.trainer import ModelTrainer, TrainingArguments

SHARED_MODELS_ENV = "LAYERTUNE_SHARED_MODELS"
DEFAULT_SHARED_MODELS = Path("../shared/models")
ATTENTION = "attention/"  # results column prefix: mean dme weight of encoder <name> on dev (a valid MLflow name)


class StudyEncoder(EncoderSpec):
    """One encoder of the study, with its own learning rate (default: the study's ``training.learning_rate``)."""

    learning_rate: float | None = Field(None, gt=0)


class SystemSpec(BaseModel):
    """One system of the study: a single encoder (no ``combine_method``) or several combined."""

    model_config = ConfigDict(extra="forbid")

    name: str
    encoders: list[str] = Field(min_length=1)
    combine_method: CombineMethod | None = None
    dropout: float = Field(0.0, ge=0, lt=1)
    projection_size: PositiveInt | None = None

    @model_validator(mode="after")
    def _method_fits_the_count(self) -> SystemSpec:
        if len(set(self.encoders)) != len(self.encoders):
            raise ValueError(f"system {self.name!r} lists an encoder twice: {self.encoders}")
        if len(self.encoders) == 1 and self.combine_method is not None:
            raise ValueError(f"system {self.name!r} has one encoder: leave out combine_method (nothing to combine)")
        if len(self.encoders) > 1 and self.combine_method is None:
            raise ValueError(f"system {self.name!r} combines {len(self.encoders)} encoders: set combine_method "
                             "to 'concat' or 'dme'")
        return self


class StudySpec(BaseModel):
    """A whole study; validated up front, so a typo fails before any training."""

    model_config = ConfigDict(extra="forbid")

    corpus: CorpusSpec
    encoders: dict[str, StudyEncoder]
    systems: list[SystemSpec] = Field(min_length=1)
    training: TrainingArguments = Field(default_factory=TrainingArguments)
    seeds: list[int] = Field(min_length=1)
    head: str = "linear"
    models_dir: str | None = Field(None, description=f"folder of local models; default ${SHARED_MODELS_ENV}, "
                                                     f"else {DEFAULT_SHARED_MODELS}")
    mlflow_experiment: str | None = Field("layertune-multi-encoder", description="one run per (system, seed); "
                                                                                 "null: no tracking")

    @field_validator("training")
    @classmethod
    def _one_shared_rate(cls, training: TrainingArguments) -> TrainingArguments:
        if isinstance(training.learning_rate, list):
            raise ValueError("training.learning_rate is the default for every encoder: give one float, and "
                             "per-encoder rates as encoders.<name>.learning_rate")
        return training

    @model_validator(mode="after")
    def _systems_name_known_encoders(self) -> StudySpec:
        for system in self.systems:
            for name in system.encoders:
                if name not in self.encoders:
                    raise ValueError(f"system {system.name!r} uses unknown encoder {name!r}."
                                     f"{choices_hint(name, self.encoders)}")
        names = [system.name for system in self.systems]
        if len(set(names)) != len(names):
            raise ValueError(f"system names must be unique; got {names}")
        return self


def locate_model(model: str, models_dir: str | Path | None = None) -> str:
    """A model name found in the local models folder becomes that folder's path; anything else is kept as is."""
    root = Path(models_dir or os.environ.get(SHARED_MODELS_ENV) or DEFAULT_SHARED_MODELS)
    return str(root / model) if (root / model).is_dir() else model


def check_models_exist(study: StudySpec) -> None:
    """Fail before any training when an encoder's model is neither local, nor packaged, nor on the hub."""
    for name, encoder in study.encoders.items():
        location = locate_model(encoder.model, study.models_dir)
        try:
            transformers.AutoConfig.from_pretrained(resolve_model_path(location),
                                                    trust_remote_code=encoder.trust_remote_code)
        except OSError as error:
            root = study.models_dir or os.environ.get(SHARED_MODELS_ENV) or DEFAULT_SHARED_MODELS
            raise ValueError(f"encoder {name!r}: model {encoder.model!r} is not in the models folder {root} (set "
                             f"models_dir or ${SHARED_MODELS_ENV}), not packaged, and the hub did not provide it "
                             f"({error}).") from None


def build_encoder(study: StudySpec, system: SystemSpec) -> LanguageModel | MultiEncoder:
    language_models = [
        study.encoders[name].model_copy(update={"model": locate_model(study.encoders[name].model,
                                                                      study.models_dir)}).build()
        for name in system.encoders
    ]
    if system.combine_method is None:
        return language_models[0]
    return MultiEncoder(language_models, system.combine_method, system.dropout, system.projection_size)


def system_learning_rate(study: StudySpec, system: SystemSpec) -> float | list[float]:
    """Each encoder's own rate (or the study's); a list, one per encoder, for a combination."""
    rates = [study.encoders[name].learning_rate or study.training.learning_rate for name in system.encoders]
    return rates if system.combine_method else rates[0]


def run_system(corpus: Corpus, study: StudySpec, system: SystemSpec, seed: int, *,
               cache_dir: str | Path | None = None, progress: bool = False) -> dict:
    """Train one (system, seed) cell; its dev score and, for dme, each encoder's mean attention on dev."""
    transformers.set_seed(seed)  # before the head and combination layer are initialised
    model = build_model(build_encoder(study, system), corpus, study.head)
    arguments = {**study.training.model_dump(), "seed": seed, "learning_rate": system_learning_rate(study, system)}
    result = ModelTrainer(model, corpus, cache_dir=cache_dir).train(progress=progress, **arguments)
    row = {
        "task": corpus.name, "system": system.name, "encoders": " + ".join(system.encoders),
        "combine_method": system.combine_method or "single", "seed": seed, "metric": corpus.main_metric,
        "score": result.best_score, "best_epoch": result.best_epoch, "train_time_s": result.train_time_s,
        "trainable_parameters": result.trainable_parameters,
    }
    if system.combine_method == "dme":
        weights = mean_dev_attention(model, corpus, study.training, cache_dir)
        row.update({f"{ATTENTION}{name}": weight for name, weight in zip(system.encoders, weights)})
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
    for system in study.systems:
        for seed in study.seeds:
            with _tracked(study, system, seed) as run:
                rows.append(run_system(corpus, study, system, seed, cache_dir=cache_dir, progress=progress))
                if run is not None:
                    run.log_metrics({k: v for k, v in rows[-1].items() if k != "seed"})
    return pd.DataFrame(rows)


def _tracked(study: StudySpec, system: SystemSpec, seed: int) -> contextlib.AbstractContextManager:
    """An MLflow run for one cell (FINISHED, or FAILED / KILLED if it does not complete), unless tracking is off."""
    if study.mlflow_experiment is None:
        return contextlib.nullcontext()
    from layertune import tracking

    params = {
        "task": study.corpus.task, "system": system.name, "encoders": " + ".join(system.encoders),
        "combine_method": system.combine_method or "single", "seed": seed, "dropout": system.dropout,
        "projection_size": system.projection_size, "learning_rate": system_learning_rate(study, system),
        "models": [study.encoders[name].model for name in system.encoders],
        "tunable_layers": [study.encoders[name].tunable_layers for name in system.encoders],
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
    lines = [f"## {task}: {metric}\n", "| system | encoders | combination | seeds | "
             f"{metric} | train time (s) | mean attention (dme) |", "|---|---|---|---|---|---|---|"]
    for row in table.to_dict("records"):  # records, not tuples: "attention/<name>" is no attribute name
        score = f"{100 * row['mean']:.1f}" + ("" if pd.isna(row["std"]) else f" ± {100 * row['std']:.1f}")
        score = f"**{score}**" if row["mean"] == best else score
        lines.append(f"| {row['system']} | {row['encoders']} | {row['combine_method']} | {row['seeds']} | {score} | "
                     f"{row['train_time_s']:.0f} | {_attention_text(row)} |")
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
