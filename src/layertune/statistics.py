"""Uncertainty of study results: intervals over dev examples and seeds, and paired comparisons.

A setting (say SST-2, MiniLM, 2 tunable layers) is trained once per seed and scored on the same dev examples; its
score is the mean over seeds. Two things make it uncertain, and an interval covers both:

- which examples happen to be in dev: a bootstrap over dev examples (the same draws for every setting of a task,
  so the difference of two settings is *paired*: same examples, same seeds);
- which seeds were run: a Student t interval over the seeds' scores. The seed-to-seed spread is pooled over the
  settings compared together (their variances averaged, degrees of freedom summed, as in an analysis of
  variance): one setting's two seeds give one degree of freedom, for which t is 6.3 (one-sided 95%), while the
  seven settings of a layer ablation give seven (t = 1.9). A bootstrap over two or three seeds would be far too
  narrow; with one seed the seed part cannot be measured at all (the report says so).

The two parts are independent (each seed's score is measured on the same, whole dev set), so their half-widths
add in quadrature. A comparison against a tolerance is one-sided: "A is not worse than B by more than
``tolerance``" holds when the upper ``confidence`` bound of (B − A) is below it.
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

    def bounds(self, low: float, high: float, spread: SeedSpread | None = None) -> tuple[float, float]:
        """The ``low`` and ``high`` quantile bounds of the mean: the dev part from the bootstrap, the seed part from
        t over ``spread`` (default: this estimate's own seeds), added in quadrature."""
        dev_low, dev_high = np.quantile(self.samples.mean(axis=0), [low, high])
        spread = spread if spread is not None else SeedSpread.pooled([self])
        seed_low = spread.half_width(self.seeds, 1 - low) if spread else 0.0
        seed_high = spread.half_width(self.seeds, high) if spread else 0.0
        return (float(self.mean - np.hypot(max(self.mean - dev_low, 0.0), seed_low)),
                float(self.mean + np.hypot(max(dev_high - self.mean, 0.0), seed_high)))


@dataclass(frozen=True)
class SeedSpread:
    """How far a score moves from seed to seed: a standard deviation and its degrees of freedom."""

    sd: float
    df: int

    @classmethod
    def pooled(cls, estimates: Sequence[Estimate]) -> SeedSpread | None:
        """The spread of ``estimates``' seeds pooled (variances weighted by degrees of freedom); None when no
        estimate has two seeds (one seed measures no spread)."""
        measured = [e for e in estimates if e.seeds > 1]
        if not measured:
            return None
        df = sum(e.seeds - 1 for e in measured)
        variance = sum((e.seeds - 1) * e.scores.var(ddof=1) for e in measured) / df
        return cls(float(np.sqrt(variance)), df)

    def half_width(self, seeds: int, quantile: float) -> float:
        """How far the mean of ``seeds`` scores may lie from the truth, at this one-sided ``quantile``."""
        from scipy.stats import t

        return float(t.ppf(quantile, self.df) * self.sd / np.sqrt(seeds))


def interval(estimate: Estimate, confidence: float = 0.95, spread: SeedSpread | None = None) -> tuple[float, float]:
    """Two-sided interval of the mean over seeds (seed spread: ``spread``, else the estimate's own)."""
    tail = (1 - confidence) / 2
    return estimate.bounds(tail, 1 - tail, spread)


@dataclass(frozen=True)
class Comparison:
    """A − B, paired: the observed difference, its interval, and what the data shows."""

    difference: float
    low: float
    high: float
    verdict: Verdict


def differences_spread(candidates: Sequence[Estimate], reference: Estimate) -> SeedSpread | None:
    """The seed spread of every candidate's paired difference from ``reference``, pooled: what the comparisons of
    one table share."""
    return SeedSpread.pooled([candidate.minus(reference) for candidate in candidates])


def first_good_enough(verdicts: Sequence[tuple[Any, Verdict]]) -> tuple[Any | None, list]:
    """The first of ``verdicts`` (ordered cheapest first: fewest layers, fewest parameters, ...) whose verdict is
    yes, unless one before it is undecided: then None and the undecided ones with it, the candidates the data cannot
    separate. The best setting's verdict is yes, so there always is one."""
    position = next(i for i, (_, verdict) in enumerate(verdicts) if verdict == "yes")
    chosen = verdicts[position][0]
    undecided = [key for key, verdict in verdicts[:position] if verdict == "undecided"]
    return (None, [*undecided, chosen]) if undecided else (chosen, [])


def within_tolerance(candidate: Estimate, reference: Estimate, tolerance: float, confidence: float = 0.95,
                     spread: SeedSpread | None = None) -> Comparison:
    """Is ``candidate`` not worse than ``reference`` by more than ``tolerance``? (one-sided, paired; the seed spread
    of the difference is ``spread``, else its own)

    ``yes``: the upper ``confidence`` bound of the shortfall (reference − candidate) is below ``tolerance``;
    ``no``: its lower bound is above it (worse by more than the tolerance); ``undecided`` otherwise.
    """
    difference = candidate.minus(reference)
    low, high = difference.bounds(1 - confidence, confidence, spread)  # of candidate − reference
    verdict: Verdict = "yes" if -low < tolerance else "no" if -high > tolerance else "undecided"
    return Comparison(difference.mean, low, high, verdict)


def better_or_worse(candidate: Estimate, reference: Estimate, confidence: float = 0.95,
                    spread: SeedSpread | None = None) -> Comparison:
    """Two-sided, paired: ``yes`` when the interval of candidate − reference is above 0 (better), ``no`` when it is
    below 0 (worse), ``undecided`` when it contains 0."""
    difference = candidate.minus(reference)
    low, high = interval(difference, confidence, spread)
    verdict: Verdict = "yes" if low > 0 else "no" if high < 0 else "undecided"
    return Comparison(difference.mean, low, high, verdict)
