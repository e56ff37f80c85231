"""Uncertainty of study results: bootstrap intervals over dev examples and seeds, and paired comparisons.

A setting (say SST-2, MiniLM, 2 tunable layers) is trained once per seed and scored on the same dev examples. Its
score varies with the seed and with which examples happen to be in dev, so one resample redraws both: the seeds with
replacement, and the dev examples with replacement; the resample's score is the mean over the drawn seeds of each
seed's score on the drawn examples. All settings of one task share the same draws (`Resamples`), so the difference
of two settings' resampled scores is a *paired* comparison: same examples, same seeds.

Intervals are percentile intervals of the resampled scores. A comparison against a tolerance is one-sided: "A is not
worse than B by more than ``tolerance``" holds when the upper ``confidence`` quantile of (B − A) is below it.
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
    """Bootstrap draws shared by every setting of one task: ``examples`` (resamples, n) and ``seeds`` (resamples,
    number of seeds), both indices drawn with replacement from a fixed random seed (reports are reproducible)."""

    examples: np.ndarray
    seeds: np.ndarray

    @classmethod
    def draw(cls, num_examples: int, num_seeds: int, resamples: int = 1000, random_seed: int = 0) -> Resamples:
        if num_examples < 1 or num_seeds < 1 or resamples < 1:
            raise ValueError(f"need at least one example, seed and resample; got {num_examples}, {num_seeds}, "
                             f"{resamples}")
        generator = np.random.default_rng(random_seed)
        return cls(generator.integers(0, num_examples, (resamples, num_examples)),
                   generator.integers(0, num_seeds, (resamples, num_seeds)))

    def scores(self, metrics: Sequence[str], key: str, predictions_by_seed: Sequence[Sequence[Any]],
               references: Sequence[Any]) -> np.ndarray:
        """The resampled score ``key`` of one setting: (resamples,), the mean over drawn seeds."""
        if len(predictions_by_seed) != self.seeds.shape[1]:
            raise ValueError(f"{len(predictions_by_seed)} seeds of predictions for draws over {self.seeds.shape[1]}")
        per_seed = np.stack([resampled_scores(metrics, predictions, references, self.examples)[key]
                             for predictions in predictions_by_seed], axis=1)  # (resamples, seeds)
        return np.take_along_axis(per_seed, self.seeds, axis=1).mean(axis=1)


def interval(samples: np.ndarray, confidence: float = 0.95) -> tuple[float, float]:
    """Two-sided percentile interval of resampled scores."""
    tail = (1 - confidence) / 2
    low, high = np.quantile(samples, [tail, 1 - tail])
    return float(low), float(high)


@dataclass(frozen=True)
class Comparison:
    """A − B over paired resamples: the observed difference, its interval, and what the data shows."""

    difference: float
    low: float
    high: float
    verdict: Verdict


def within_tolerance(candidate: np.ndarray, reference: np.ndarray, observed: float, tolerance: float,
                     confidence: float = 0.95) -> Comparison:
    """Is ``candidate`` not worse than ``reference`` by more than ``tolerance``? (one-sided, paired)

    ``yes``: the upper ``confidence`` bound of the shortfall (reference − candidate) is below ``tolerance``;
    ``no``: its lower bound is above it (worse by more than the tolerance); ``undecided`` otherwise.
    ``observed`` is candidate − reference on the full data.
    """
    shortfall = reference - candidate
    low, high = np.quantile(shortfall, [1 - confidence, confidence])
    verdict: Verdict = "yes" if high < tolerance else "no" if low > tolerance else "undecided"
    return Comparison(observed, float(-high), float(-low), verdict)


def better_or_worse(candidate: np.ndarray, reference: np.ndarray, observed: float,
                    confidence: float = 0.95) -> Comparison:
    """Two-sided, paired: ``yes`` when the interval of candidate − reference is above 0 (better), ``no`` when it is
    below 0 (worse), ``undecided`` when it contains 0."""
    low, high = interval(candidate - reference, confidence)
    verdict: Verdict = "yes" if low > 0 else "no" if high < 0 else "undecided"
    return Comparison(observed, low, high, verdict)
