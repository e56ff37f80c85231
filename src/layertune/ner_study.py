"""The NER layer study: CoNLL-2003 trained with the top K layers tunable, for each K in a list, into one report.

For every K the report shows train and dev loss per epoch, dev entity F1 (seqeval), training time and how far
selected tensors drifted from their starting values (classifier weight, top layer, embeddings), against two
baselines that need no model: the majority tag everywhere, and each word's most frequent training tag.

The parameters are the ``ner`` section of ``params.yaml`` (:class:`NerParams`). Learning rates are one value for
every cell or a list with one value per ``tunable_layers`` entry; ``head_learning_rate`` likewise (null: the cell's
``learning_rate``), so the classifier-only cell can train at a much larger rate, as in the study this reproduces.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
import warnings
from collections import Counter, defaultdict
from pathlib import Path
from typing import Literal

import pandas as pd
from pydantic import BaseModel, ConfigDict, Field, NonNegativeFloat, PositiveFloat, PositiveInt, model_validator

from layertune.corpora import CONLL_03
from layertune.corpus import Corpus
from layertune.drift import layer_drift
from layertune.metrics import compute_metrics

DEFAULT_MODEL = "sentence-transformers/all-MiniLM-L6-v2"
ENTITY_TYPES = ("PER", "ORG", "LOC", "MISC")


class NerCell(BaseModel):
    """One trained configuration: K tunable layers and the two learning rates it uses."""

    tunable_layers: int | Literal["all"]
    learning_rate: float
    head_learning_rate: float | None

    @property
    def label(self) -> str:
        return str(self.tunable_layers)


class NerParams(BaseModel):
    """The ``ner`` section of ``params.yaml``; the defaults are the CPU study (a few minutes on a laptop)."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    model: str = DEFAULT_MODEL
    tunable_layers: list[int | Literal["all"]] = Field([0, 1, 3, 6, "all"], min_length=1)
    learning_rate: PositiveFloat | list[PositiveFloat] = 1e-4
    head_learning_rate: PositiveFloat | None | list[PositiveFloat | None] = Field(
        [3e-3, 1e-3, 1e-3, 1e-3, 1e-3], description="null: the cell's learning_rate")
    train_size: PositiveInt | None = Field(1000, description="seeded subsample of the 14,041 train sentences")
    dev_size: PositiveInt | None = Field(None, description="null: all 3,250 dev sentences")
    data_seed: int = 42
    seed: int = 42
    epochs: PositiveInt = 2
    batch_size: PositiveInt = 16
    eval_batch_size: PositiveInt = 64
    warmup_ratio: float = Field(0.1, ge=0, le=1)
    weight_decay: NonNegativeFloat = 0.0
    max_length: PositiveInt | None = None
    frozen_prefix_cache: bool = True
    cache_dtype: Literal["float32", "float16", "bfloat16"] = "float32"
    mixed_precision: Literal["auto", "no", "fp16", "bf16"] = "auto"

    @model_validator(mode="after")
    def _one_rate_per_cell(self) -> NerParams:
        if any(isinstance(k, int) and k < 0 for k in self.tunable_layers):
            raise ValueError(f"ner.tunable_layers must be ints >= 0 or 'all'; got {self.tunable_layers}")
        if len(set(map(str, self.tunable_layers))) != len(self.tunable_layers):
            raise ValueError(f"ner.tunable_layers must not repeat; got {self.tunable_layers}")
        for name in ("learning_rate", "head_learning_rate"):
            value = getattr(self, name)
            if isinstance(value, list) and len(value) != len(self.tunable_layers):
                raise ValueError(f"ner.{name} lists {len(value)} rates for {len(self.tunable_layers)} tunable_layers "
                                 f"values {self.tunable_layers}: give one rate, or one per value")
        return self

    def cells(self) -> list[NerCell]:
        def rate(value, index):
            return value[index] if isinstance(value, list) else value

        return [NerCell(tunable_layers=k, learning_rate=rate(self.learning_rate, i),
                        head_learning_rate=rate(self.head_learning_rate, i))
                for i, k in enumerate(self.tunable_layers)]

    def training_arguments(self, cell: NerCell) -> dict:
        """Keyword arguments of `ModelTrainer.train` for ``cell``."""
        return dict(learning_rate=cell.learning_rate, head_learning_rate=cell.head_learning_rate,
                    batch_size=self.batch_size, eval_batch_size=self.eval_batch_size, epochs=self.epochs,
                    warmup_ratio=self.warmup_ratio, weight_decay=self.weight_decay, seed=self.seed,
                    max_length=self.max_length, group_by_length=True, cache_dtype=self.cache_dtype,
                    frozen_prefix_cache="auto" if self.frozen_prefix_cache else False,
                    mixed_precision=self.mixed_precision)


@dataclasses.dataclass
class NerStudyResult:
    """Per-epoch history, one summary row per cell, and every parameter's drift, all keyed by ``tunable_layers``."""

    history: pd.DataFrame
    summary: pd.DataFrame
    drift: pd.DataFrame


# ------------------------------------------------------------------------------------------------------ running


def load_study_corpus(params: NerParams, data_mirror: str | Path | None = None) -> Corpus:
    """CoNLL-2003 with the seeded train subsample; test left out (the study scores dev)."""
    corpus = CONLL_03(train_size=params.train_size, dev_size=params.dev_size, seed=params.data_seed,
                      data_mirror=data_mirror)
    return dataclasses.replace(corpus, test=None, notes=[*corpus.notes, "test not used."])


def feature_cache_dir(root: str | Path, model: str) -> Path:
    """``<root>/conll2003/<model>`` for a hub id; a local folder is named by its last part and a hash of its path,
    so that no path outside ``root`` is ever built."""
    path = Path(model).expanduser()
    if path.is_absolute() or ".." in path.parts:
        digest = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:8]
        model = f"local/{path.name}-{digest}"
    return Path(root) / "conll2003" / model


def run_study(params: NerParams, corpus: Corpus, cache_dir: str | Path | None = None,
              progress: bool = False) -> NerStudyResult:
    """Train every cell of ``params`` on ``corpus``; frozen-prefix states of all cells are cached in one pass."""
    from layertune.frozen_prefix import default_cache_root
    from layertune.language_model import LanguageModel

    cache_dir = Path(cache_dir) if cache_dir else default_cache_root()
    encoder = LanguageModel(params.model, tunable_layers=0)
    _check_layers(params, encoder.num_layers)
    if params.frozen_prefix_cache:
        cache_boundaries(encoder, corpus, params, cache_dir)
    del encoder
    histories, rows, drifts = [], [], []
    for cell in params.cells():
        result, wall_time, model = train_cell(corpus, params, cell, cache_dir, progress)
        histories += [{"tunable_layers": cell.label, **record} for record in result.history]
        rows.append({**_summary_row(cell, result, wall_time, model), "train_sentences": len(corpus.train),
                     "dev_sentences": len(corpus.dev)})
        drifts.append(result.drift.assign(tunable_layers=cell.label))
    return NerStudyResult(pd.DataFrame(histories), pd.DataFrame(rows), pd.concat(drifts, ignore_index=True))


def _check_layers(params: NerParams, num_layers: int) -> None:
    too_many = [k for k in params.tunable_layers if k != "all" and k > num_layers]
    if too_many:
        raise ValueError(f"ner.tunable_layers {too_many}: {params.model!r} has {num_layers} layers, so tunable "
                         f"layers go from 0 to {num_layers} (or 'all').")


def cache_boundaries(encoder, corpus: Corpus, params: NerParams, cache_dir: Path) -> None:
    """Hidden states entering every cell's first tunable layer, for train and dev, in one forward pass per split.

    The same folders and keys as `LanguageModel.prepare_examples` uses, so every cell finds its states.
    """
    import torch

    from layertune.frozen_prefix import FrozenPrefixCache
    from layertune.tokenization import tokenize_corpus

    tokenized = tokenize_corpus(corpus, encoder.tokenizer, max_length=params.max_length,
                                cache_dir=cache_dir / "tokenized")
    boundaries = sorted({encoder.num_layers - k for k in params.tunable_layers if k != "all"})
    cache = FrozenPrefixCache(cache_dir / "frozen_prefix", dtype=params.cache_dtype, progress=False)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for split in ("train", "dev"):
        cache.build(encoder, tokenized[split], boundaries, device=device)


def train_cell(corpus: Corpus, params: NerParams, cell: NerCell, cache_dir: str | Path | None = None,
               progress: bool = False):
    """One cell: its `TrainingResult`, wall time (caching and evaluation included) and the trained model."""
    import transformers

    from layertune.language_model import LanguageModel
    from layertune.token_classification import TokenClassifier
    from layertune.trainer import ModelTrainer

    transformers.set_seed(params.seed)  # before the head is built: its initial weights are part of the cell
    encoder = LanguageModel(params.model, tunable_layers=cell.tunable_layers)
    model = TokenClassifier(encoder, corpus.num_classes, label_names=corpus.label_names)
    started = time.perf_counter()
    result = ModelTrainer(model, corpus, cache_dir=cache_dir).train(progress=progress,
                                                                    **params.training_arguments(cell))
    return result, time.perf_counter() - started, model


def _summary_row(cell: NerCell, result, wall_time: float, model) -> dict:
    last = result.history[-1]
    return {
        "tunable_layers": cell.label, "learning_rate": cell.learning_rate,
        "head_learning_rate": cell.head_learning_rate or cell.learning_rate,
        "trainable_parameters": result.trainable_parameters, "total_parameters": result.total_parameters,
        "best_epoch": result.best_epoch, **result.best_metrics,
        "final_train_loss": last["train_loss"], "final_eval_loss": last["eval_loss"],
        "train_time_s": result.train_time_s, "wall_time_s": wall_time,
        "frozen_prefix_cache": bool(result.frozen_prefix_cache["used"]),
        "classifier_weight": classifier_weight_name(model), "top_layer": f"layer.{model.encoder.num_layers - 1}",
    }


def classifier_weight_name(model) -> str:
    """The weight of the head's last linear layer: the classifier proper (``head.1.weight`` for a linear head)."""
    import torch

    index = max(i for i, module in enumerate(model.head) if isinstance(module, torch.nn.Linear))
    return f"head.{index}.weight"


# ---------------------------------------------------------------------------------------------------- baselines


def majority_baselines(corpus: Corpus) -> dict[str, dict]:
    """Dev scores of the majority tag everywhere, and of each word's most frequent training tag (``O`` if unseen)."""
    names = corpus.label_names
    train_tags = [[names[t] for t in tags] for tags in corpus.train["tags"]]
    references = [[names[t] for t in tags] for tags in corpus.dev["tags"]]
    majority = Counter(tag for tags in train_tags for tag in tags).most_common(1)[0][0]
    by_word: dict[str, Counter] = defaultdict(Counter)
    for words, tags in zip(corpus.train["tokens"], train_tags):
        for word, tag in zip(words, tags):
            by_word[word][tag] += 1
    word_tag = {word: counts.most_common(1)[0][0] for word, counts in by_word.items()}
    with warnings.catch_warnings():  # the all-majority baseline predicts no entity at all: seqeval says so
        warnings.simplefilter("ignore")
        everywhere = compute_metrics(["seqeval"], [[majority] * len(r) for r in references], references)
        lexical = compute_metrics(["seqeval"], [[word_tag.get(w, "O") for w in words]
                                                for words in corpus.dev["tokens"]], references)
    return {"majority_tag": {"tag": majority, **everywhere}, "word_majority_tag": lexical}


# ------------------------------------------------------------------------------------------------------- report


def selected_drift(drift: pd.DataFrame, summary: pd.DataFrame) -> pd.DataFrame:
    """Per cell: the drift of the classifier weight, the top layer and the embeddings (the latter two pooled)."""
    rows = []
    for cell in summary.to_dict("records"):
        table = drift[drift["tunable_layers"].astype(str) == str(cell["tunable_layers"])]
        classifier = table[table["parameter"] == cell["classifier_weight"]].iloc[0]
        parts = layer_drift(table.drop(columns="tunable_layers")).set_index("part")
        for tensor, row in (("classifier weight", classifier), (f"top layer ({cell['top_layer']})",
                                                                parts.loc[cell["top_layer"]]),
                            ("embeddings", parts.loc["embeddings"])):
            rows.append({"tunable_layers": str(cell["tunable_layers"]), "tensor": tensor,
                         "mean_abs_change": row["mean_abs_change"], "relative_l2": row["relative_l2"]})
    return pd.DataFrame(rows)


def report_markdown(summary: pd.DataFrame, drift: pd.DataFrame, baselines: dict, params: NerParams,
                    figures: str = "ner") -> str:
    """``reports/ner.md``: setup, results per K against the baselines, drift, and the figures in ``figures/``."""
    summary = summary.assign(tunable_layers=summary["tunable_layers"].astype(str))
    sections = [
        "# NER on CoNLL-2003: how many layers to fine-tune\n",
        _setup_text(summary, params),
        _results_table(summary, baselines),
        _gains_text(summary),
        _drift_table(selected_drift(drift, summary)),
        "## Figures\n",
        *[f"![{title}]({figures}/{name}.png)\n" for name, title in FIGURE_TITLES.items()],
    ]
    return "\n".join(sections)


FIGURE_TITLES = {"loss_curves": "Train and dev loss per epoch", "f1": "Dev entity F1 per tunable-layers value",
                 "training_time": "Training time per tunable-layers value", "drift": "Drift of selected tensors"}


def _setup_text(summary: pd.DataFrame, params: NerParams) -> str:
    first = summary.iloc[0]
    train = f"{first['train_sentences']:,} training sentences" + (
        f" (seeded subsample, seed {params.data_seed})" if params.train_size else " (all)")
    dev = f"{first['dev_sentences']:,} dev sentences" + (" (seeded subsample)" if params.dev_size else " (all)")
    timing = ("frozen layers run once, before training, through the frozen-prefix cache" if params.frozen_prefix_cache
              else "frozen layers run in every step (frozen-prefix cache off)")
    return (
        "## Setup\n\n"
        f"- Model `{params.model}`; a linear tag classifier on every word's first word piece; the top K "
        "transformer layers and the classifier train, the rest is frozen (`all` also trains the embeddings).\n"
        f"- Data: {train}, {dev}; tags in IOB2.\n"
        f"- {params.epochs} epochs, batch {params.batch_size}, AdamW with linear decay after "
        f"{params.warmup_ratio:.0%} warm-up, seed {params.seed}; the epoch with the best dev F1 is reported.\n"
        "- F1, precision and recall are entity-level micro averages (seqeval, CoNLL convention) on dev; the dev "
        "set also picks the best epoch, so the scores are slightly optimistic.\n"
        "- Losses are cross-entropy per labelled word piece: train loss averaged over the epoch's batches, dev loss "
        "after the epoch.\n"
        f"- Training time is the training loop alone (no evaluation, no caching); {timing}.\n"
    )


def _results_table(summary: pd.DataFrame, baselines: dict) -> str:
    types = [t for t in ENTITY_TYPES if f"eval_{t}_f1" in summary.columns]
    lines = ["## Results (dev)\n",
             "| tunable layers | trainable params | lr | head lr | F1 | precision | recall | "
             + " | ".join(f"{t} F1" for t in types) + " | train loss | dev loss | training time (s) | best epoch |",
             "|---" * (11 + len(types)) + "|"]
    for row in summary.to_dict("records"):
        lines.append(
            f"| {row['tunable_layers']} | {row['trainable_parameters']:,} | {row['learning_rate']:g} | "
            f"{row['head_learning_rate']:g} | **{100 * row['eval_f1']:.1f}** | {100 * row['eval_precision']:.1f} | "
            f"{100 * row['eval_recall']:.1f} | "
            + " | ".join(f"{100 * row[f'eval_{t}_f1']:.1f}" for t in types)
            + f" | {row['final_train_loss']:.3f} | {row['final_eval_loss']:.3f} | {row['train_time_s']:.1f} | "
            f"{row['best_epoch']} |")
    majority, lexical = baselines["majority_tag"], baselines["word_majority_tag"]
    lines += [
        "",
        f"Baselines without a model: the majority tag (`{majority['tag']}`) everywhere scores F1 "
        f"**{100 * majority['f1']:.1f}** (it finds no entity; token accuracy {100 * majority['accuracy']:.1f}); "
        f"each word's most frequent training tag scores F1 **{100 * lexical['f1']:.1f}** "
        f"(precision {100 * lexical['precision']:.1f}, recall {100 * lexical['recall']:.1f}).\n",
    ]
    return "\n".join(lines)


def _gains_text(summary: pd.DataFrame) -> str:
    rows = summary.to_dict("records")
    steps = [f"{a['tunable_layers']} → {b['tunable_layers']}: {100 * (b['eval_f1'] - a['eval_f1']):+.1f} F1, "
             f"training time ×{b['train_time_s'] / max(a['train_time_s'], 1e-9):.1f}" for a, b in zip(rows, rows[1:])]
    return "Step by step (F1 points, training time ratio):\n\n" + "".join(f"- {s}\n" for s in steps)


def _drift_table(selected: pd.DataFrame) -> str:
    wide = selected.pivot(index="tunable_layers", columns="tensor", values="mean_abs_change")
    wide = wide.loc[list(dict.fromkeys(selected["tunable_layers"]))]
    tensors = list(dict.fromkeys(selected["tensor"]))
    lines = ["## Parameter drift\n", "Mean absolute change of each weight from its starting value "
             "(pretrained, or the classifier's random initialisation); frozen tensors stay at exactly 0.\n",
             "| tunable layers | " + " | ".join(tensors) + " |", "|---" * (1 + len(tensors)) + "|"]
    for k, row in wide.iterrows():
        lines.append(f"| {k} | " + " | ".join(f"{row[t]:.2e}" for t in tensors) + " |")
    return "\n".join(lines) + "\n"


def report_figures(summary: pd.DataFrame, history: pd.DataFrame, drift: pd.DataFrame,
                   baselines: dict) -> dict[str, object]:
    """Seaborn figures keyed by name (see `FIGURE_TITLES`)."""
    import matplotlib

    matplotlib.use("Agg")
    summary = summary.assign(tunable_layers=summary["tunable_layers"].astype(str))
    history = history.assign(tunable_layers=history["tunable_layers"].astype(str))
    order = list(summary["tunable_layers"])
    return {"loss_curves": _loss_figure(history, order), "f1": _f1_figure(summary, baselines, order),
            "training_time": _time_figure(summary, order),
            "drift": _drift_figure(selected_drift(drift, summary), order)}


def _loss_figure(history: pd.DataFrame, order: list[str]):
    import matplotlib.pyplot as plt
    import seaborn as sns

    long = history.melt(id_vars=["tunable_layers", "epoch"], value_vars=["train_loss", "eval_loss"],
                        var_name="split", value_name="loss").replace({"train_loss": "train", "eval_loss": "dev"})
    figure, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for axis, split in zip(axes, ("train", "dev")):
        sns.lineplot(long[long["split"] == split], x="epoch", y="loss", hue="tunable_layers", hue_order=order,
                     marker="o", ax=axis)
        axis.set_title(f"{split} loss")
        axis.xaxis.get_major_locator().set_params(integer=True)
    return figure


def _f1_figure(summary: pd.DataFrame, baselines: dict, order: list[str]):
    import matplotlib.pyplot as plt
    import seaborn as sns

    figure, axis = plt.subplots(figsize=(6, 4))
    sns.barplot(summary, x="tunable_layers", y="eval_f1", order=order, color="tab:blue", ax=axis)
    for name, style, label in (("word_majority_tag", "--", "baseline: each word's most frequent tag"),
                               ("majority_tag", ":", "baseline: majority tag everywhere")):
        axis.axhline(baselines[name]["f1"], linestyle=style, color="gray", label=label)
    axis.set(ylim=(0, 1), ylabel="dev entity F1", xlabel="tunable layers")
    axis.legend(loc="lower right")
    return figure


def _time_figure(summary: pd.DataFrame, order: list[str]):
    import matplotlib.pyplot as plt
    import seaborn as sns

    figure, axis = plt.subplots(figsize=(6, 4))
    sns.barplot(summary, x="tunable_layers", y="train_time_s", order=order, color="tab:orange", ax=axis)
    axis.set(ylabel="training time (s)", xlabel="tunable layers")
    return figure


def _drift_figure(selected: pd.DataFrame, order: list[str]):
    import matplotlib.pyplot as plt
    import seaborn as sns

    # Frozen tensors have drift 0, which a log axis cannot show: they are left out of the plot (see the table).
    figure, axis = plt.subplots(figsize=(7, 4))
    sns.barplot(selected[selected["mean_abs_change"] > 0], x="tunable_layers", y="mean_abs_change", hue="tensor",
                order=order, ax=axis)
    axis.set(yscale="log", ylabel="mean |change|", xlabel="tunable layers")
    sns.move_legend(axis, "upper left", bbox_to_anchor=(1, 1))
    return figure
