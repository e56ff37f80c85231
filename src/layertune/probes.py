"""References no one here trained: what a frozen language model gives without fine-tuning.

- `linear_probe`: scikit-learn's `LogisticRegression` (classification, tagging) or `Ridge` (regression) on the frozen
  model's features, the same features a head-only cell (``tunable_layers=0``) trains its head on: the pooled vector
  per text, or each word's first word-piece state. Its regularisation is chosen on the corpus's validation slice,
  never on dev. A converged head-only cell must reach it: the probe is the optimum of a linear head on these
  features, up to the regulariser; the same fit with no penalty, scored on the slice too, tells which is missing.
- `untrained_cosine`: a sentence-pair regression task scored as sentence-transformers users score it, by the cosine
  of the two sentences' pooled embeddings, with no training at all.
- `no_model_baseline`: the training data's majority class (classification; a constant has no correlation, and
  tagging's word-lookup baselines live with its report).
"""

from __future__ import annotations

import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from layertune.batching import IGNORE_INDEX, batch_to, make_loader
from layertune.corpus import Corpus
from layertune.metrics import compute_metrics
from layertune.training_config import (
    TrainingConfig,
    autocast_context,
    autocast_dtype,
    resolve_mixed_precision,
    training_device,
)

# Inverse regularisation strengths tried (C of LogisticRegression; Ridge's alpha is 1 / C), on standardised features:
# half-decade steps from 1e-3 to 1e2.
STRENGTHS = tuple(float(f"{10 ** (exponent / 2):.3g}") for exponent in range(-6, 5))


@dataclass
class ProbeResult:
    """A reference's dev scores (the task's metrics, as the trainer names them: ``eval_<metric>``), what was chosen
    on the validation slice, and its dev predictions and references (for paired comparisons)."""

    name: str
    metrics: dict[str, float]
    main_metric: str
    chosen: dict = field(default_factory=dict)
    predictions: dict[str, list] = field(default_factory=dict, repr=False)

    @property
    def score(self) -> float:
        return self.metrics[f"eval_{self.main_metric}"]

    def record(self) -> dict:
        """JSON-ready, predictions included."""
        return asdict(self)


def linear_probe(language_model, corpus: Corpus, args: TrainingConfig | None = None, *,
                 cache_dir: str | Path | None = None, strengths=STRENGTHS) -> ProbeResult:
    """A linear model fitted by scikit-learn on ``language_model``'s frozen features of ``corpus``'s training
    split, its regularisation chosen by the main metric on the validation slice, scored on dev.

    ``language_model`` is a `LanguageModel` built with ``tunable_layers=0`` and the pooling the head-only cells use;
    ``args`` their training settings (max_length, mixed_precision, cache_dtype, eval_batch_size): the features are
    computed (or read from the frozen-prefix cache in ``cache_dir``, where those cells left them) as they compute
    them."""
    from sklearn.linear_model import LinearRegression, LogisticRegression, Ridge
    from sklearn.exceptions import ConvergenceWarning
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    if corpus.validation is None:
        raise ValueError(f"linear_probe chooses its regularisation on a validation slice, and {corpus.name!r} has "
                         "none: load the corpus with validation_size=N. Dev is never used to choose.")
    if language_model.frozen_prefix_layers != language_model.num_layers:
        raise ValueError(f"linear_probe reads the frozen model's features: build the LanguageModel with "
                         f"tunable_layers=0, not {language_model.tunable_layers!r}")
    args = (args or TrainingConfig()).model_copy(update={"frozen_prefix_cache": True})
    features = _features(language_model, corpus, args, cache_dir)
    tagging = corpus.task_type == "token_classification"

    def fitted(strength: float | None):  # None: no penalty
        if corpus.task_type == "regression":
            estimator = LinearRegression() if strength is None else Ridge(alpha=1.0 / strength)
        else:
            estimator = LogisticRegression(C=np.inf if strength is None else strength, max_iter=2000)
        return make_pipeline(StandardScaler(), estimator).fit(*_flat(features["train"], tagging))

    def scored(model, split: str) -> tuple[dict[str, float], dict[str, list]]:
        inputs, references = features[split]
        predicted = _predictions(model, inputs, tagging, corpus)
        references = _references(references, tagging, corpus)
        scores = compute_metrics(corpus.metrics, predicted, references)
        return {f"eval_{k}": v for k, v in scores.items()}, {"predictions": predicted, "references": references}

    key = f"eval_{corpus.main_metric}"
    trials = [(strength, fitted(strength)) for strength in strengths]
    validation = {strength: scored(model, "validation")[0][key] for strength, model in trials}
    best = max(strengths, key=lambda strength: (validation[strength], -strength))  # ties: the stronger regulariser
    metrics, predictions = scored(dict(trials)[best], "dev")
    # The same fit with no penalty: a head trained without one (weight decay 0) that falls short of it has not
    # converged; one that reaches it and is still short of the probe lacks the probe's penalty, not training.
    with warnings.catch_warnings():  # unpenalised, a separable class split has no finite optimum: lbfgs says so
        warnings.simplefilter("ignore", ConvergenceWarning)
        unpenalised = scored(fitted(None), "validation")[0][key]
    name = "ridge" if corpus.task_type == "regression" else "logistic_regression"
    chosen = {"C" if name != "ridge" else "alpha": best if name != "ridge" else 1.0 / best,
              "validation_scores": {str(s): round(v, 6) for s, v in validation.items()},
              "unpenalised_validation_score": round(unpenalised, 6)}
    return ProbeResult(f"linear probe ({name})", metrics, corpus.main_metric, chosen, predictions)


def untrained_cosine(language_model, corpus: Corpus, args: TrainingConfig | None = None) -> ProbeResult:
    """Dev of a sentence-pair regression corpus scored by the cosine of each pair's two embeddings (each sentence
    encoded alone, pooled as ``language_model`` pools, truncated and computed as ``args`` say), untrained: how
    sentence-transformers users score STS-B."""
    args = args or TrainingConfig()
    if corpus.task_type != "regression" or len(corpus.text_columns) != 2:
        raise ValueError(f"untrained_cosine scores sentence pairs by similarity; {corpus.name!r} is "
                         f"{corpus.task_type} on {len(corpus.text_columns)} text column(s)")
    first, second = (_embed(language_model, corpus.dev[column], args) for column in corpus.text_columns)
    similarity = torch.nn.functional.cosine_similarity(first, second).tolist()
    references = [float(label) for label in corpus.dev["label"]]
    scores = compute_metrics(corpus.metrics, similarity, references)
    return ProbeResult("untrained cosine similarity", {f"eval_{k}": v for k, v in scores.items()}, corpus.main_metric,
                       {"pooling": language_model.pooling},
                       {"predictions": similarity, "references": references})


def no_model_baseline(corpus: Corpus) -> ProbeResult | None:
    """The training data's majority class on every dev example (classification); None for other tasks (a constant
    has no correlation; tagging's word-lookup baselines live with its report)."""
    if corpus.task_type != "classification":
        return None
    counts = np.bincount(np.asarray(corpus.train["label"]), minlength=corpus.num_classes)
    majority = int(counts.argmax())
    references = [int(label) for label in corpus.dev["label"]]
    predicted = [majority] * len(references)
    scores = compute_metrics(corpus.metrics, predicted, references)
    return ProbeResult("majority class", {f"eval_{k}": v for k, v in scores.items()}, corpus.main_metric,
                       {"class": corpus.label_names[majority] if corpus.label_names else majority},
                       {"predictions": predicted, "references": references})


# ------------------------------------------------------------------------------------------------------------


@torch.no_grad()
def _features(lm, corpus: Corpus, args: TrainingConfig, cache_dir) -> dict:
    """Per split (train, validation, dev): the head's inputs in corpus order, and the labels. Text tasks: one pooled
    vector per example; tagging: per sentence, the states of its labelled (first) word pieces."""
    device = training_device()
    autocast = autocast_dtype(resolve_mixed_precision(args.mixed_precision, device.type))
    lm.eval().to(device)  # before the frozen-prefix pass, which computes there
    splits, _ = lm.prepare_examples(corpus, args, cache_dir=cache_dir, device=device, autocast=autocast)
    batch_size = args.eval_batch_size or args.batch_size
    found = {}
    for split in ("train", "validation", "dev"):
        loader = make_loader(splits[split], batch_size, longest_first=True)
        order = iter(loader.sampler)
        inputs, labels = [None] * len(splits[split]), [None] * len(splits[split])
        for batch in loader:
            batch = batch_to(batch, device)  # gathered on the host where states are beyond the GPU's budget
            with autocast_context(device, autocast):
                states = lm.token_states(batch) if corpus.task_type == "token_classification" else lm(batch)
            states, batch_labels = states.float().cpu(), batch["labels"].cpu()
            for row in range(len(states)):
                index = next(order)
                if corpus.task_type == "token_classification":
                    scored = batch_labels[row] != IGNORE_INDEX
                    inputs[index], labels[index] = states[row][scored].numpy(), batch_labels[row][scored].numpy()
                else:
                    inputs[index], labels[index] = states[row].numpy(), batch_labels[row].item()
        found[split] = (inputs, labels)
    return found


def _flat(split: tuple[list, list], tagging: bool) -> tuple[np.ndarray, np.ndarray]:
    inputs, labels = split
    if tagging:
        return np.concatenate(inputs), np.concatenate(labels)
    return np.stack(inputs), np.asarray(labels)


def _predictions(model, inputs: list, tagging: bool, corpus: Corpus) -> list:
    if not tagging:
        return model.predict(np.stack(inputs)).tolist()
    predicted = model.predict(np.concatenate(inputs)).tolist()
    sentences, start = [], 0
    for rows in inputs:
        sentences.append([corpus.label_names[tag] for tag in predicted[start : start + len(rows)]])
        start += len(rows)
    return sentences


def _references(labels: list, tagging: bool, corpus: Corpus) -> list:
    if tagging:
        return [[corpus.label_names[tag] for tag in sentence.tolist()] for sentence in labels]
    return [float(label) if corpus.task_type == "regression" else int(label) for label in labels]


@torch.no_grad()
def _embed(lm, texts: list[str], args: TrainingConfig) -> torch.Tensor:
    device = training_device()
    autocast = autocast_dtype(resolve_mixed_precision(args.mixed_precision, device.type))
    batch_size = args.eval_batch_size or args.batch_size
    lm.eval().to(device)
    rows = []
    for start in range(0, len(texts), batch_size):
        batch = lm.tokenize(list(texts[start : start + batch_size]), args.max_length)
        with autocast_context(device, autocast):
            rows.append(lm({k: v.to(device) for k, v in batch.items()}).float().cpu())
    return torch.cat(rows)


def study_references(plan, corpora, cache_dir: str | Path | None = None) -> dict:
    """The references of every task of a study (`layertune.study.StudyPlan`; ``corpora``: task → its `Corpus`):
    ``{task: {"no_model": record, "encoders": {encoder: {"linear_probe": record, "untrained_cosine": record}}}}``,
    each record `ProbeResult.record` (a reference that does not apply is left out). Probes are of the single
    encoders, built as the study's head-only cells build them and computed with their settings."""
    from layertune.study import CombinedEncoder

    spec, found = plan.spec, {}
    for task in spec.tasks:
        corpus = corpora[task]
        baseline = no_model_baseline(corpus)
        entry = found[task] = {"no_model": baseline.record() if baseline else None, "encoders": {}}
        for encoder, definition in spec.encoders.items():
            if isinstance(definition, CombinedEncoder):
                continue
            args = spec.training_for(encoder, 0, seed=spec.seeds[0], task=task)
            language_model = spec.encoder_specs(encoder, 0)[0].build()
            mine = entry["encoders"][encoder] = {}
            if corpus.validation is not None:
                mine["linear_probe"] = linear_probe(language_model, corpus, args, cache_dir=cache_dir).record()
            if corpus.task_type == "regression" and len(corpus.text_columns) == 2:
                mine["untrained_cosine"] = untrained_cosine(language_model, corpus, args).record()
    return found
