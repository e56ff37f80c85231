"""Uncertainty of study results: intervals over dev examples and seeds, and paired comparisons.

A setting (say SST-2, MiniLM, 2 tunable layers) is trained once per seed and scored on the same dev examples; its
score is the mean over seeds. Two things make it uncertain, and an interval covers both:

- which examples happen to be in dev: a bootstrap over dev examples (the same draws for every setting of a task,
  so the difference of two settings is *paired*: same examples, same seeds);
- which seeds were run: a Student t interval over the seeds' scores (degrees of freedom: seeds − 1). A bootstrap
  over two or three seeds would make this part far too narrow; t stays honest with few seeds, and with one seed
  the seed part cannot be measured at all (the report says so).

The two half-widths are added, which is conservative (their variances would add to less). A comparison against a
tolerance is one-sided: "A is not worse than B by more than ``tolerance``" holds when the upper ``confidence``
bound of (B − A) is below it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from layertune.metrics import resampled_scores

Verdict = Literal["yes", "no", "undecided"]


@dataclass(frozen=True)
class Resamples:
    """Bootstrap draws of one task's dev examples, (resamples, n) indices with replacement, from a fixed random
    seed (reports are reproducible). Every setting of the task is scored on the same draws."""

    examples: np.ndarray

    @classmethod
    def draw(cls, num_examples: int, resamples: int = 1000, random_seed: int = 0) -> Resamples:
        if num_examples < 1 or resamples < 1:
            raise ValueError(f"need at least one example and one resample; got {num_examples}, {resamples}")
        return cls(np.random.default_rng(random_seed).integers(0, num_examples, (resamples, num_examples)))

    def estimate(self, metrics: Sequence[str], key: str, predictions_by_seed: Sequence[Sequence[Any]],
                 references: Sequence[Any], scores: Sequence[float]) -> Estimate:
        """A setting's estimate: its seeds' ``scores`` on the whole dev set, and each seed's score on every
        resample."""
        samples = np.stack([resampled_scores(metrics, predictions, references, self.examples)[key]
                            for predictions in predictions_by_seed])
        return Estimate(np.asarray(scores, dtype=float), samples)


@dataclass(frozen=True)
class Estimate:
    """A score averaged over seeds: ``scores`` (seeds,) on the whole dev set, ``samples`` (seeds, resamples) on
    each bootstrap resample of it."""

    scores: np.ndarray
    samples: np.ndarray

    @property
    def mean(self) -> float:
        return float(self.scores.mean())

    @property
    def seeds(self) -> int:
        return len(self.scores)

    def minus(self, other: Estimate) -> Estimate:
        """The paired difference: seed by seed (same position in the seed list), resample by resample."""
        if self.scores.shape != other.scores.shape:
            raise ValueError(f"paired settings need the same seeds: {self.seeds} against {other.seeds}")
        return Estimate(self.scores - other.scores, self.samples - other.samples)

    def bounds(self, low: float, high: float) -> tuple[float, float]:
        """The ``low`` and ``high`` quantile bounds of the mean: dev part from the bootstrap, seed part from t."""
        dev_low, dev_high = np.quantile(self.samples.mean(axis=0), [low, high])
        seed_low, seed_high = _seed_half_widths(self.scores, low, high)
        return float(dev_low - seed_low), float(dev_high + seed_high)


def _seed_half_widths(scores: np.ndarray, low: float, high: float) -> tuple[float, float]:
    if len(scores) < 2:
        return 0.0, 0.0  # one seed: its variation is not measured (reports say so)
    from scipy.stats import t

    spread = scores.std(ddof=1) / np.sqrt(len(scores))
    return float(-t.ppf(low, len(scores) - 1) * spread), float(t.ppf(high, len(scores) - 1) * spread)


def interval(estimate: Estimate, confidence: float = 0.95) -> tuple[float, float]:
    """Two-sided interval of the mean over seeds."""
    tail = (1 - confidence) / 2
    return estimate.bounds(tail, 1 - tail)


@dataclass(frozen=True)
class Comparison:
    """A − B, paired: the observed difference, its interval, and what the data shows."""

    difference: float
    low: float
    high: float
    verdict: Verdict


def within_tolerance(candidate: Estimate, reference: Estimate, tolerance: float,
                     confidence: float = 0.95) -> Comparison:
    """Is ``candidate`` not worse than ``reference`` by more than ``tolerance``? (one-sided, paired)

    ``yes``: the upper ``confidence`` bound of the shortfall (reference − candidate) is below ``tolerance``;
    ``no``: its lower bound is above it (worse by more than the tolerance); ``undecided`` otherwise.
    """
    difference = candidate.minus(reference)
    low, high = difference.bounds(1 - confidence, confidence)  # of candidate − reference
    verdict: Verdict = "yes" if -low < tolerance else "no" if -high > tolerance else "undecided"
    return Comparison(difference.mean, low, high, verdict)


def better_or_worse(candidate: Estimate, reference: Estimate, confidence: float = 0.95) -> Comparison:
    """Two-sided, paired: ``yes`` when the interval of candidate − reference is above 0 (better), ``no`` when it is
    below 0 (worse), ``undecided`` when it contains 0."""
    difference = candidate.minus(reference)
    low, high = interval(difference, confidence)
    verdict: Verdict = "yes" if low > 0 else "no" if high < 0 else "undecided"
    return Comparison(difference.mean, low, high, verdict)
