"""Task metrics, computed so that one code path gives both the score and its bootstrap resamples.

Every metric here is a function of per-example counts that add up: accuracy of (correct, 1) per example, binary F1
of (tp, fp, fn), Matthews correlation of the confusion matrix, Pearson of (x, y, x², y², xy, 1), entity F1 of
(tp, predicted, gold) per sentence. A score is a function of the column sums, so the score of any resample of the
examples is the same function of the resampled sums: `score` is `resampled_scores` with the identity resample, and
the bootstrap in `layertune.statistics` costs one matrix product instead of thousands of metric calls. Spearman's
rank correlation is the exception: ranks are recomputed for each resample.

The definitions are those of scikit-learn, SciPy and seqeval (conlleval mode); the tests check them against those
libraries. Not using Hugging Face ``evaluate`` is deliberate: importing it costs seconds in every process.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from layertune.errors import unknown_choice

METRICS: tuple[str, ...] = ("accuracy", "f1", "matthews_correlation", "pearsonr", "spearmanr", "seqeval")


def compute_metrics(names: Sequence[str], predictions: Sequence[Any], references: Sequence[Any]) -> dict[str, float]:
    """Scores of ``predictions`` against ``references``, one flat dict of floats.

    Keys are the metric names, except ``seqeval``, which gives ``precision``, ``recall``, ``f1`` (entity-level
    micro averages, conlleval's rules), ``accuracy`` (token level) and ``<TYPE>_f1`` for each entity type seen.
    """
    identity = np.arange(len(predictions))[None, :]
    return {key: float(values[0]) for key, values in resampled_scores(names, predictions, references,
                                                                      identity).items()}


def resampled_scores(names: Sequence[str], predictions: Sequence[Any], references: Sequence[Any],
                     indices: np.ndarray) -> dict[str, np.ndarray]:
    """The scores of every resample: ``indices`` is (resamples, n) example indices; each score is (resamples,)."""
    _check(names, predictions, references)
    scores: dict[str, np.ndarray] = {}
    for name in names:
        for key, values in _METRIC_FUNCTIONS[name](predictions, references, indices).items():
            if key in scores:
                raise ValueError(f"two metrics report {key!r}; compute {list(names)} in separate calls")
            scores[key] = values
    return scores


def _check(names: Sequence[str], predictions: Sequence[Any], references: Sequence[Any]) -> None:
    if isinstance(names, str):
        raise TypeError(f"names must be a sequence of metric names, not the string {names!r}")
    if not names:
        raise ValueError(f"no metrics requested; choose from {', '.join(METRICS)}")
    for name in names:
        if name not in METRICS:
            raise unknown_choice("metric", name, METRICS)
    if "seqeval" in names and len(names) > 1:
        raise ValueError(f"seqeval scores tag sequences, the others labels or values: compute {list(names)} separately")
    if len(predictions) != len(references):
        raise ValueError(f"{len(predictions)} predictions but {len(references)} references; they must pair up")
    if len(predictions) == 0:
        raise ValueError("no predictions to score: predictions and references are empty")


def _sums(statistics: np.ndarray, indices: np.ndarray) -> np.ndarray:
    """Column sums of ``statistics`` (n, k) over each resample's rows: (resamples, k)."""
    resamples, n = len(indices), len(statistics)
    # How often each resample drew each example, as a (resamples, n) matrix; then one matrix product.
    draws = np.bincount((np.arange(resamples)[:, None] * n + indices).ravel(), minlength=resamples * n)
    return draws.reshape(resamples, n).astype(float) @ statistics


def _ratio(numerator: np.ndarray, denominator: np.ndarray) -> np.ndarray:
    """numerator / denominator, 0 where the denominator is 0 (scikit-learn's and seqeval's zero_division=0)."""
    out = np.zeros_like(numerator, dtype=float)
    np.divide(numerator, denominator, out=out, where=denominator != 0)
    return out


def _labels(values: Sequence[Any]) -> np.ndarray:
    array = np.asarray(values)
    if array.ndim != 1:
        raise ValueError(f"labels must be one per example; got an array of shape {array.shape}")
    return array


def _accuracy(predictions, references, indices) -> dict[str, np.ndarray]:
    correct = (_labels(predictions) == _labels(references)).astype(float)
    sums = _sums(np.stack([correct, np.ones_like(correct)], axis=1), indices)
    return {"accuracy": sums[:, 0] / sums[:, 1]}


def _binary_f1(predictions, references, indices) -> dict[str, np.ndarray]:
    predicted, gold = _labels(predictions) == 1, _labels(references) == 1
    labels = set(np.unique(predictions)) | set(np.unique(references))
    if not labels <= {0, 1}:
        raise ValueError(f"f1 is the binary F1 of class 1; got labels {sorted(labels)}")
    counts = np.stack([predicted & gold, predicted & ~gold, ~predicted & gold], axis=1).astype(float)
    tp, fp, fn = _sums(counts, indices).T
    return {"f1": _ratio(2 * tp, 2 * tp + fp + fn)}


def _matthews(predictions, references, indices) -> dict[str, np.ndarray]:
    predicted, gold = _labels(predictions).astype(int), _labels(references).astype(int)
    classes = int(max(predicted.max(), gold.max())) + 1
    cells = np.zeros((len(gold), classes * classes))
    cells[np.arange(len(gold)), gold * classes + predicted] = 1.0  # this example's cell of the confusion matrix
    confusion = _sums(cells, indices).reshape(len(indices), classes, classes)
    true_counts, predicted_counts = confusion.sum(axis=2), confusion.sum(axis=1)
    correct, total = np.trace(confusion, axis1=1, axis2=2), confusion.sum(axis=(1, 2))
    covariance = correct * total - (true_counts * predicted_counts).sum(axis=1)
    spread = (total**2 - (predicted_counts**2).sum(axis=1)) * (total**2 - (true_counts**2).sum(axis=1))
    return {"matthews_correlation": _ratio(covariance, np.sqrt(spread))}


def _pearson_from_sums(sums: np.ndarray) -> np.ndarray:
    x, y, xx, yy, xy, n = sums.T
    covariance = n * xy - x * y
    spread = (n * xx - x**2) * (n * yy - y**2)
    return _ratio(covariance, np.sqrt(np.clip(spread, 0, None)))


def _values(values: Sequence[Any]) -> np.ndarray:
    return _labels(values).astype(np.float64)


def _pearson(predictions, references, indices) -> dict[str, np.ndarray]:
    x, y = _values(predictions), _values(references)
    statistics = np.stack([x, y, x * x, y * y, x * y, np.ones_like(x)], axis=1)
    return {"pearsonr": _pearson_from_sums(_sums(statistics, indices))}


def _spearman(predictions, references, indices) -> dict[str, np.ndarray]:
    from scipy.stats import rankdata

    # Ranks depend on which examples were drawn, so they are taken within each resample (ties get average ranks).
    x = rankdata(_values(predictions)[indices], axis=1)
    y = rankdata(_values(references)[indices], axis=1)
    sums = np.stack([x.sum(1), y.sum(1), (x * x).sum(1), (y * y).sum(1), (x * y).sum(1),
                     np.full(len(indices), indices.shape[1], dtype=float)], axis=1)
    return {"spearmanr": _pearson_from_sums(sums)}


def _seqeval(predictions, references, indices) -> dict[str, np.ndarray]:
    """Entity-level micro precision / recall / F1 and token accuracy, counted per sentence (conlleval's rules)."""
    from seqeval.metrics.sequence_labeling import get_entities

    types = sorted({t for tags in (*references, *predictions) for t, _, _ in get_entities(list(tags))})
    rows = []
    for number, (predicted, gold) in enumerate(zip(predictions, references)):
        if len(predicted) != len(gold):
            raise ValueError(f"sentence {number}: {len(predicted)} predicted tags but {len(gold)} reference tags")
        found, true = set(get_entities(list(predicted))), set(get_entities(list(gold)))
        hits = found & true
        row = [len(hits), len(found), len(true), sum(p == g for p, g in zip(predicted, gold)), len(gold)]
        for entity_type in types:
            row += [sum(e[0] == entity_type for e in entities) for entities in (hits, found, true)]
        rows.append(row)
    sums = _sums(np.asarray(rows, dtype=float), indices)
    scores = _precision_recall_f1(*sums[:, :3].T)
    scores["accuracy"] = _ratio(sums[:, 3], sums[:, 4])
    for position, entity_type in enumerate(types):
        hits, found, true = sums[:, 5 + 3 * position : 8 + 3 * position].T
        scores[f"{entity_type}_f1"] = _precision_recall_f1(hits, found, true)["f1"]
    return scores


def _precision_recall_f1(hits: np.ndarray, found: np.ndarray, true: np.ndarray) -> dict[str, np.ndarray]:
    precision, recall = _ratio(hits, found), _ratio(hits, true)
    return {"precision": precision, "recall": recall, "f1": _ratio(2 * precision * recall, precision + recall)}


_METRIC_FUNCTIONS = {"accuracy": _accuracy, "f1": _binary_f1, "matthews_correlation": _matthews,
                     "pearsonr": _pearson, "spearmanr": _spearman, "seqeval": _seqeval}


def metric_for(key: str, metrics: Sequence[str]) -> list[str]:
    """The one metric of a task's ``metrics`` that reports ``key`` (``f1`` comes from ``seqeval`` for tagging)."""
    if key in metrics:
        return [key]
    if "seqeval" in metrics and key in ("precision", "recall", "f1", "accuracy"):
        return ["seqeval"]
    raise ValueError(f"none of the metrics {list(metrics)} reports {key!r}")
