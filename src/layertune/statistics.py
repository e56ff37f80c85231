"""Uncertainty of study results: intervals over dev examples and seeds, and paired comparisons.

A setting (say SST-2, MiniLM, 2 tunable layers) is trained once per seed and scored on the same dev examples; its
score is the mean over seeds. Two things make it uncertain, and an interval covers both:

- which examples happen to be in dev: a bootstrap over dev examples (the same draws for every setting of a task,
  so the difference of two settings is *paired*: same examples, same seeds);
- which seeds were run: a Student t interval over the seeds' scores. A setting's own interval pools the
  seed-to-seed spread over the settings compared together (their variances averaged, degrees of freedom summed, as
  in an analysis of variance). A comparison of two settings (`difference_spread`) takes the spread of its own
  paired differences, seed by seed, shrunk toward that pooled spread by one degree of freedom: settings differ in
  seed spread (tenfold in the default studies), and a comparison of an unstable setting measured by the stable
  ones' spread is too narrow (docs/pipeline.md, "Deciding in rounds"). A bootstrap over two or three seeds would be
  far too narrow; with one seed the seed part cannot be measured at all (the report says so).

The two parts are independent (each seed's score is measured on the same, whole dev set), so their half-widths
add in quadrature. A comparison against a tolerance is one-sided: "A is not worse than B by more than
``tolerance``" holds when the upper ``confidence`` bound of (B − A) is below it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache, lru_cache
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
        return Estimate(np.asarray(scores, dtype=float), samples, self.examples.shape[1])


@dataclass(frozen=True)
class Estimate:
    """A score averaged over seeds: ``scores`` (seeds,) on the whole dev set, ``samples`` (seeds, resamples) on
    each bootstrap resample of it; ``examples``: how many dev examples were resampled (None: not known)."""

    scores: np.ndarray
    samples: np.ndarray
    examples: int | None = None

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
        return Estimate(self.scores - other.scores, self.samples - other.samples, self.examples)

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
        return student_t(quantile, self.df) * self.sd / float(np.sqrt(seeds))


@lru_cache(maxsize=4096)
def student_t(quantile: float, df: int) -> float:
    """Student t's ``quantile`` with ``df`` degrees of freedom (cached: a sequential study asks the same few often)."""
    from scipy.stats import t

    return float(t.ppf(quantile, df))


@lru_cache(maxsize=4096)
def normal(quantile: float) -> float:
    """The standard normal distribution's ``quantile`` (cached, as `student_t`)."""
    from scipy.stats import norm

    return float(norm.ppf(quantile))


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


def paired_difference(candidate: Estimate, reference: Estimate) -> Estimate:
    """candidate − reference on the seeds both have: the first ones (a decided study's later rounds give seeds to
    the settings still in question only, after the grid's; every setting has the grid's)."""
    seeds = min(candidate.seeds, reference.seeds)
    return first_seeds(candidate, seeds).minus(first_seeds(reference, seeds))


# How much the settings' pooled spread counts in a comparison's own: as this many degrees of freedom (one seed's
# worth) beside its n − 1. With two, a setting ten times less stable than seven others was wrongly called within the
# tolerance in 5.1% of 1,000 studies simulated as tests/test_sequential.py does (with one: 4.5%); with none, two
# seeds (t on one degree of freedom) decide next to nothing.
PRIOR_DF = 1


def difference_spread(candidate: Estimate, reference: Estimate, pooled: SeedSpread | None) -> SeedSpread | None:
    """The seed spread of the paired difference candidate − reference, on the seeds both have (the first n): the
    variance of its own n differences (n − 1 degrees of freedom), shrunk toward twice the variance of ``pooled``
    (the settings' own spread pooled over those compared together: a difference of two has twice a setting's
    variance, where cells of one seed are not negatively correlated), which counts as `PRIOR_DF` degrees of freedom
    more: a moderated t, as limma's (Smyth 2004), with a stated prior. Valid for each pair's own spread, whatever
    the others'; None when neither part is measured (one seed each, and no pooled spread)."""
    return shrunk_spread(paired_difference(candidate, reference), pooled)


def shrunk_spread(difference: Estimate, pooled: SeedSpread | None, sides: int = 2) -> SeedSpread | None:
    """`difference_spread` of a paired ``difference``. ``sides``: how many of its two sides vary from seed to seed,
    each by ``pooled`` (1 where the reference is one fixed fit, such as a linear probe: the difference then varies
    as the setting alone)."""
    own_df = difference.seeds - 1
    prior_df = PRIOR_DF if pooled is not None else 0
    if own_df + prior_df == 0:
        return None
    own = float(difference.scores.var(ddof=1)) if own_df else 0.0
    prior = sides * pooled.sd ** 2 if pooled is not None else 0.0
    return SeedSpread(float(np.sqrt((prior_df * prior + own_df * own) / (prior_df + own_df))), prior_df + own_df)


def pooled_spread(difference: Estimate, pooled: SeedSpread | None) -> SeedSpread | None:
    """The rule the reports used before `difference_spread`, kept to measure it against: every paired difference
    √2 times the settings' ``pooled`` spread, on its degrees of freedom, whatever its own. Too narrow for a pair
    less stable than the settings on average: tests/test_sequential.py measures by how much."""
    return SeedSpread(pooled.sd * float(np.sqrt(2)), pooled.df) if pooled is not None else None


def first_good_enough(verdicts: Sequence[tuple[Any, Verdict]]) -> tuple[Any | None, list]:
    """The first of ``verdicts`` (ordered cheapest first: fewest layers, fewest parameters, ...) whose verdict is
    yes, unless one before it is undecided: then None and the undecided ones with it, the candidates the data cannot
    separate. The best setting's verdict is yes under the fixed test; where none is (the sequential rule claims yes
    only once shown), None and every undecided one."""
    position = next((i for i, (_, verdict) in enumerate(verdicts) if verdict == "yes"), None)
    if position is None:
        return None, [key for key, verdict in verdicts if verdict == "undecided"]
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
    difference = paired_difference(candidate, reference)
    low, high = difference.bounds(1 - confidence, confidence, spread)  # of candidate − reference
    verdict: Verdict = "yes" if -low < tolerance else "no" if -high > tolerance else "undecided"
    return Comparison(difference.mean, low, high, verdict)


def better_or_worse(candidate: Estimate, reference: Estimate, confidence: float = 0.95,
                    spread: SeedSpread | None = None) -> Comparison:
    """Two-sided, paired: ``yes`` when the interval of candidate − reference is above 0 (better), ``no`` when it is
    below 0 (worse), ``undecided`` when it contains 0."""
    difference = paired_difference(candidate, reference)
    low, high = interval(difference, confidence, spread)
    verdict: Verdict = "yes" if low > 0 else "no" if high < 0 else "undecided"
    return Comparison(difference.mean, low, high, verdict)


# ---------------------------------------------------------------------------------- what would settle a comparison
#
# An undecided comparison's one-sided half-width is hypot(dev, seed) (`Estimate.bounds`), and it is wider than the
# gap between the observed difference and the tolerance. The two parts shrink differently:
# - seed = t(confidence, df) · sd / √seeds: more seeds shrink it (and add their degrees of freedom to the pair's own
#   spread, `difference_spread`); a bigger dev set would shrink sd a little too, which the projection ignores (it
#   errs on the side of more).
# - dev: the bootstrap spread of the mean over seeds of the per-example differences. Its variance is
#   shared + own / seeds, where *shared* is what the seeds' resampled differences have in common (the same examples
#   are easy or hard for every seed: more seeds cannot remove it) and *own* what differs from seed to seed; both
#   scale as 1 / dev examples. With one seed the two cannot be told apart and all of it counts as shared.


@dataclass(frozen=True)
class Settlement:
    """What would decide an undecided `within_tolerance` comparison, if the observed difference holds.

    ``decides``: the verdict it would reach (``yes`` if the observed shortfall is below the tolerance, else ``no``);
    ``gap``: how far the observed difference lies from the tolerance: the one-sided half-width must fall below it;
    ``dev`` and ``seed``: the half-width's two parts now (``seed`` is 0 with one seed: not measured);
    ``dev_floor``: the dev part with unlimited seeds; ``seeds``: seeds per setting that would decide on the same dev
    examples (None: no number up to ``max_seeds`` would); ``examples``: paired dev examples that would decide with
    the same seeds (None: the seed part alone is wider than the gap, more than ``SETTLE_MAX_EXAMPLES`` times
    today's would be needed, or the dev set's size is not known); a gap of 0 (on the tolerance) names no number;
    ``together``: (seeds, examples) when neither alone would: enough seeds for half the gap's square, then the
    examples for the rest."""

    difference: float
    decides: Verdict
    gap: float
    dev: float
    seed: float
    dev_floor: float
    seeds_now: int
    examples_now: int | None
    seed_spread_measured: bool
    seeds: int | None
    examples: int | None
    together: tuple[int, int] | None

    @property
    def seeds_cannot_decide(self) -> bool:
        """The dev examples alone leave the comparison undecided, however many seeds run (with one seed, the part
        of the dev noise that seeds share cannot be measured: not claimed)."""
        return self.seed_spread_measured and self.dev_floor >= self.gap

    @property
    def dev_share(self) -> float:
        """The dev examples' share of the half-width's square (the rest is the seeds')."""
        total = self.dev ** 2 + self.seed ** 2
        return self.dev ** 2 / total if total > 0 else 0.0


def shared_dev_fraction(samples: np.ndarray) -> float:
    """Of the bootstrap variance of the mean over seeds (``samples``: seeds × resamples), the fraction the seeds
    share (their resamples' mean covariance), which more seeds cannot remove; 1 with one seed (not measurable)."""
    seeds = samples.shape[0]
    total = float(samples.mean(axis=0).var())
    if seeds < 2 or total <= 0:
        return 1.0
    within = float(samples.var(axis=1).mean())
    # seeds² · total = seeds · within + seeds · (seeds − 1) · shared
    shared = (seeds * total - within) / (seeds - 1)
    return float(np.clip(shared / total, 0.0, 1.0))


@dataclass(frozen=True)
class _Projection:
    """The one-sided half-width of a paired difference with other numbers of seeds and dev examples."""

    dev: float
    shared: float
    seeds: int
    examples: int | None
    spread: SeedSpread | None
    rows: int
    confidence: float

    def dev_part(self, seeds: int, examples: int | None = None) -> float:
        per_seed = self.shared + (1 - self.shared) * self.seeds / seeds
        scale = 1.0 if examples is None or self.examples is None else self.examples / examples
        return self.dev * float(np.sqrt(per_seed * scale))

    def seed_part(self, seeds: int) -> float:
        if self.spread is None:
            return 0.0
        grown = SeedSpread(self.spread.sd, self.spread.df + self.rows * (seeds - self.seeds))
        return grown.half_width(seeds, self.confidence)

    def examples_for(self, seeds: int, gap: float) -> int | None:
        """The fewest dev examples (up to ``SETTLE_MAX_EXAMPLES`` times today's) that bring the half-width with
        ``seeds`` below ``gap``."""
        room = gap ** 2 - self.seed_part(seeds) ** 2
        if self.examples is None or room <= 0:
            return None
        needed = self.examples * self.dev_part(seeds) ** 2 / room
        return int(np.floor(needed)) + 1 if needed < SETTLE_MAX_EXAMPLES * self.examples else None

    def seeds_for(self, gap: float, max_seeds: int, share: float = 1.0) -> int | None:
        """The fewest seeds (up to ``max_seeds``) that bring the half-width below ``gap`` on the same dev examples;
        with ``share`` < 1, that bring the seed part alone below that share of the gap's square."""
        if self.spread is None:
            return None
        return next((n for n in range(self.seeds + 1, max_seeds + 1)
                     if (self.seed_part(n) ** 2 < share * gap ** 2 if share < 1
                         else np.hypot(self.dev_part(n), self.seed_part(n)) < gap)), None)


SETTLE_MAX_SEEDS = 50  # seeds per setting, and times today's dev examples, beyond which a projection says "more than"
SETTLE_MAX_EXAMPLES = 100


def what_would_settle(candidate: Estimate, reference: Estimate, tolerance: float, confidence: float = 0.95,
                      spread: SeedSpread | None = None, rows: int = 1,
                      max_seeds: int = SETTLE_MAX_SEEDS) -> Settlement:
    """For `within_tolerance` (same arguments): what would decide it, if the observed difference holds. ``rows``:
    the degrees of freedom each new seed adds to ``spread`` (1 for a pair's own, `difference_spread`; a spread
    pooled over several differences that would all get the new seeds, one each); seeds are searched up to
    ``max_seeds`` per setting."""
    difference = paired_difference(candidate, reference)
    spread = spread if spread is not None else SeedSpread.pooled([difference])
    mean, means = difference.mean, difference.samples.mean(axis=0)
    decides: Verdict = "yes" if mean > -tolerance else "no"
    if decides == "yes":  # the lower bound must rise above −tolerance
        gap, dev = mean + tolerance, max(mean - float(np.quantile(means, 1 - confidence)), 0.0)
    else:  # the upper bound must fall below it
        gap, dev = -tolerance - mean, max(float(np.quantile(means, confidence)) - mean, 0.0)
    gap = gap if gap > 1e-9 else 0.0  # on the tolerance (up to float noise): no sample decides
    projection = _Projection(dev, shared_dev_fraction(difference.samples), difference.seeds, difference.examples,
                             spread, rows, confidence)
    seeds = projection.seeds_for(gap, max_seeds) if gap > 0 else None
    examples = projection.examples_for(difference.seeds, gap) if gap > 0 else None
    together = None
    if seeds is None and examples is None and gap > 0:
        enough = projection.seeds_for(gap, max_seeds, share=0.5)
        together = (enough, projection.examples_for(enough, gap)) if enough is not None else None
    return Settlement(mean, decides, gap, dev, projection.seed_part(difference.seeds),
                      dev * float(np.sqrt(projection.shared)), difference.seeds, difference.examples,
                      spread is not None, seeds, examples, together)


# ------------------------------------------------------------------------------------- valid under repeated looks
#
# A sequential study looks at its settings after every round of seeds and stops the ones shown worse. Looking again
# and again at a 95% test would claim wrongly more often than 5% (each look is another chance); the rule below spends
# a one-sided error budget ``alpha`` over a fixed maximum number of looks, ``level(look)`` at each, summing to
# ``alpha``: by the union bound, the chance that a claim about a setting is ever wrong is at most ``alpha``, however
# the looks depend on each other and whenever the study stops.

SPENDING = ("obrien-fleming", "pocock", "bonferroni")


@dataclass(frozen=True)
class Looks:
    """At most ``maximum`` looks, and ``alpha`` (one-sided) spent over them by ``spending``: ``bonferroni`` equally,
    ``pocock`` and ``obrien-fleming`` by Lan and DeMets' functions of the fraction of looks done (O'Brien-Fleming
    spends almost nothing early, keeping most of ``alpha`` for the last looks)."""

    maximum: int
    alpha: float = 0.05
    spending: str = "obrien-fleming"

    def __post_init__(self):
        if not isinstance(self.maximum, int) or self.maximum < 1:
            raise ValueError(f"looks: maximum must be a whole number of at least 1; got {self.maximum!r}")
        if not 0 < self.alpha < 1:
            raise ValueError(f"looks: alpha must be between 0 and 1; got {self.alpha!r}")
        if self.spending not in SPENDING:
            raise ValueError(f"looks: unknown spending {self.spending!r}; choose one of {', '.join(SPENDING)}")

    def spent(self, fraction: float) -> float:
        """The error spent once ``fraction`` of the looks are done (0 at 0, ``alpha`` at 1)."""
        return _spent(self.spending, self.alpha, fraction)

    def level(self, look: int) -> float:
        """The one-sided error of look ``look`` (1, 2, … ``maximum``)."""
        if not 1 <= look <= self.maximum:
            raise ValueError(f"look {look} is out of range: looks are 1 to {self.maximum}")
        return self.spent(look / self.maximum) - self.spent((look - 1) / self.maximum)


@lru_cache(maxsize=4096)
def _spent(spending: str, alpha: float, fraction: float) -> float:
    """`Looks.spent` (cached: a sequential study asks the same few often)."""
    from scipy.stats import norm

    if fraction <= 0:
        return 0.0
    if spending == "obrien-fleming":
        return float(2 * norm.sf(norm.isf(alpha / 2) / np.sqrt(fraction)))
    if spending == "pocock":
        return float(alpha * np.log1p((np.e - 1) * fraction))
    return alpha * fraction


def first_seeds(estimate: Estimate, seeds: int) -> Estimate:
    return Estimate(estimate.scores[:seeds], estimate.samples[:seeds], estimate.examples)


# How a paired difference's seed spread follows from it and from the settings' pooled spread.
SpreadRule = Callable[[Estimate, "SeedSpread | None"], "SeedSpread | None"]


@dataclass(frozen=True)
class PairedBounds:
    """candidate − rival, paired on the seeds both have (the first ones), whose one-sided bounds a look asks for at
    one or two levels: its mean, the bootstrap standard deviation of that mean over dev examples, and its seed
    spread (None: not measured)."""

    difference: float
    dev_sd: float
    spread: SeedSpread | None
    seeds: int

    @classmethod
    def of(cls, candidate: Estimate, rival: Estimate, pooled: SeedSpread | None,
           spread_of: SpreadRule = shrunk_spread) -> PairedBounds:
        difference = paired_difference(candidate, rival)
        return cls(difference.mean, float(difference.samples.mean(axis=0).std()), spread_of(difference, pooled),
                   difference.seeds)

    def at(self, level: float) -> tuple[float, float]:
        """The one-sided ``level`` bounds: the dev part a normal quantile times the bootstrap standard deviation (a
        thousand resamples cannot place a 1e-4 quantile), the seed part Student t; ±inf where the seed spread is not
        measured."""
        if self.spread is None:
            return -np.inf, np.inf
        half = float(np.hypot(normal(1 - level) * self.dev_sd, self.spread.half_width(self.seeds, 1 - level)))
        return self.difference - half, self.difference + half


def settle_chance(candidate: Estimate, rival: Estimate, pooled: SeedSpread | None, tolerance: float, level: float,
                  rivals: int, seeds: int) -> tuple[float, float]:
    """The chances that `sequential_look`'s bounds of candidate − rival, with ``seeds`` seeds per setting, settle
    the comparison (a stochastic-curtailment projection): (within ``tolerance``: the lower bound at ``level`` above
    −tolerance; worse: the upper bound at ``level / rivals`` below it), taking the difference that more seeds would
    measure as normal around today's, with the variance those seeds would remove from today's estimate (the part of
    the dev noise the seeds do not share, and the seed noise). Both 0 while the seed spread is not measured."""
    import math

    difference = paired_difference(candidate, rival)
    spread = shrunk_spread(difference, pooled)
    if spread is None:
        return 0.0, 0.0
    now, dev_sd, shared = difference.seeds, float(difference.samples.mean(axis=0).std()), \
        shared_dev_fraction(difference.samples)

    def variance(n: int) -> float:  # of the mean difference over n seeds: dev noise and seed noise
        return dev_sd ** 2 * (shared + (1 - shared) * now / n) + spread.sd ** 2 / n

    def half(n: int, at: float) -> float:  # the bound's half-width at one-sided level ``at``
        dev = normal(1 - at) * dev_sd * float(np.sqrt(shared + (1 - shared) * now / n))
        return float(np.hypot(dev, SeedSpread(spread.sd, spread.df + n - now).half_width(n, 1 - at)))

    moves = math.sqrt(max(variance(now) - variance(seeds), 1e-24))
    above = (-tolerance + half(seeds, level) - difference.mean) / moves  # how far today's must move, in sd
    below = (-tolerance - half(seeds, level / rivals) - difference.mean) / moves
    return 0.5 * math.erfc(above / math.sqrt(2)), 0.5 * math.erfc(-below / math.sqrt(2))  # normal tails


def sequential_bound(candidate: Estimate, rival: Estimate, level: float, pooled: SeedSpread | None,
                     spread_of: SpreadRule = shrunk_spread) -> tuple[float, float]:
    """The one-sided ``level`` bounds of candidate − rival (`PairedBounds`), the seed part by ``spread_of`` from the
    settings' ``pooled`` spread (`difference_spread`: the pair's own, shrunk toward the pooled one)."""
    return PairedBounds.of(candidate, rival, pooled, spread_of).at(level)


def sequential_look(estimates: dict[Any, Estimate], tolerance: float, looks: Looks, look: int,
                    claims: dict[Any, Verdict] | None = None,
                    spread_of: SpreadRule = shrunk_spread) -> dict[Any, Verdict]:
    """The claims after look ``look`` (see docs/pipeline.md, "Deciding in rounds"): earlier ``yes`` and ``no`` stand;
    a setting still open is ``yes`` (not worse than the best by more than ``tolerance``) when its lower bound against
    *every* other setting is above −tolerance, at ``looks.level(look)``, and ``no`` (worse by more: stop it) when its
    upper bound against *some* other setting is below −tolerance, at that level divided by the number of other
    settings. Each bound's seed part is the pair's own spread shrunk toward the settings' pooled one
    (`difference_spread`; ``spread_of``: another rule, to measure it against). Before two seeds measure a seed
    spread, nothing is claimed."""
    claims = dict(claims or {})
    level = looks.level(look)
    spread = SeedSpread.pooled(list(estimates.values()))
    rivals = len(estimates) - 1
    for key, estimate in estimates.items():
        if claims.get(key, "undecided") != "undecided" or spread is None or rivals == 0:
            claims.setdefault(key, "undecided")
            continue
        others = [name for name in estimates if name != key]
        # each pair once, and only as far as the tests need
        against = cache(lambda name, estimate=estimate: PairedBounds.of(estimate, estimates[name], spread, spread_of))
        if all(against(name).at(level)[0] > -tolerance for name in others):
            claims[key] = "yes"
        elif any(against(name).at(level / rivals)[1] < -tolerance for name in others):
            claims[key] = "no"
        else:
            claims[key] = "undecided"
    return claims

