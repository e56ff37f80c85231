"""Intervals over dev examples and seeds, and paired comparisons."""

import numpy as np
import pytest

from layertune.statistics import (
    Estimate,
    Resamples,
    SeedSpread,
    better_or_worse,
    difference_spread,
    interval,
    shared_dev_fraction,
    what_would_settle,
    within_tolerance,
)


def correct_by_chance(rng, n: int, accuracy: float) -> list[int]:
    """Predictions for references all 1: each right with probability ``accuracy``."""
    return (rng.random(n) < accuracy).astype(int).tolist()


def estimate(draws: Resamples, predictions_by_seed: list[list[int]]) -> Estimate:
    scores = [float(np.mean(p)) for p in predictions_by_seed]
    return draws.estimate(["accuracy"], "accuracy", predictions_by_seed, [1] * draws.examples.shape[1], scores)


def test_draws_are_reproducible():
    assert np.array_equal(Resamples.draw(50, 20).examples, Resamples.draw(50, 20).examples)
    assert Resamples.draw(50, 20).examples.shape == (20, 50)


def test_interval_covers_the_true_accuracy_about_95_percent_of_the_time():
    """One seed: the interval is the bootstrap over dev examples."""
    rng = np.random.default_rng(0)
    draws = Resamples.draw(200, 400)
    hits = 0
    for _ in range(120):
        low, high = interval(estimate(draws, [correct_by_chance(rng, 200, 0.7)]))
        hits += low <= 0.7 <= high
    assert 0.88 <= hits / 120 <= 0.99


def test_the_seed_part_follows_student_t_and_adds_in_quadrature():
    """Two seeds that disagree widen the interval by t(0.975, 1) times their standard error, added in quadrature to
    the dev part (the two are independent): with few seeds the seed-to-seed variation is not underestimated."""
    from scipy.stats import t

    rng = np.random.default_rng(1)
    draws = Resamples.draw(300)
    good, bad = correct_by_chance(rng, 300, 0.85), correct_by_chance(rng, 300, 0.65)
    both = estimate(draws, [good, bad])
    same = Estimate(both.scores * 0 + both.scores.mean(), both.samples)  # no seed spread, same dev part
    seed_part = t.ppf(0.975, 1) * np.std(both.scores, ddof=1) / np.sqrt(2)
    (low, high), (dev_low, dev_high) = interval(both), interval(same)
    assert high - both.mean == pytest.approx(np.hypot(dev_high - both.mean, seed_part))
    assert both.mean - low == pytest.approx(np.hypot(both.mean - dev_low, seed_part))


def test_seed_spread_pools_variances_and_degrees_of_freedom():
    samples = np.zeros((1, 5))
    a = Estimate(np.array([0.70, 0.72]), np.repeat(samples, 2, axis=0))
    b = Estimate(np.array([0.80, 0.86, 0.83]), np.repeat(samples, 3, axis=0))
    spread = SeedSpread.pooled([a, b])
    assert spread.df == 1 + 2
    assert spread.sd ** 2 == pytest.approx((np.var(a.scores, ddof=1) + 2 * np.var(b.scores, ddof=1)) / 3)
    assert SeedSpread.pooled([Estimate(np.array([0.7]), samples)]) is None  # one seed measures no spread


def seeds_of(scores, samples: int = 5) -> Estimate:
    """An estimate with these seed scores and no dev part (every resample scores as the whole dev set)."""
    scores = np.asarray(scores, dtype=float)
    return Estimate(scores, np.repeat(scores[:, None], samples, axis=1))


def test_a_comparison_takes_its_own_seed_spread_shrunk_toward_the_pooled_one_by_one_degree_of_freedom():
    """The variance of the pair's own seed-by-seed differences (n − 1 degrees of freedom) and twice the settings'
    pooled variance (one degree of freedom), weighted so; with no pooled spread, the pair's own alone."""
    candidate, reference = seeds_of([0.70, 0.74, 0.71]), seeds_of([0.80, 0.81, 0.83])
    pooled = SeedSpread(0.02, 12)
    own = np.var([-0.10, -0.07, -0.12], ddof=1)
    spread = difference_spread(candidate, reference, pooled)
    assert spread.df == 1 + 2
    assert spread.sd ** 2 == pytest.approx((2 * 0.02 ** 2 + 2 * own) / 3)
    assert difference_spread(candidate, reference, None) == SeedSpread(pytest.approx(np.sqrt(own)), 2)
    # one seed each: the pooled spread alone, on its one degree of freedom; nothing where none is measured
    alone = SeedSpread(pytest.approx(0.02 * np.sqrt(2)), 1)
    assert difference_spread(seeds_of([0.7]), seeds_of([0.8]), pooled) == alone
    assert difference_spread(seeds_of([0.7]), seeds_of([0.8]), None) is None


def test_an_unstable_setting_is_compared_by_its_own_spread_not_the_stable_ones():
    """Five stable settings (seeds ± 0.1 point) and one ten times less stable: pooled over the table, its
    comparison with the best would read as tight as theirs and call it within 2 points of the best; by its own
    seed-by-seed differences it stays undecided, while a stable setting as far from the best is still decided."""
    best = seeds_of([0.801, 0.800, 0.799, 0.800])
    stable = [seeds_of(np.array([0.791, 0.790, 0.789, 0.790]) - 0.001 * k) for k in range(4)]
    unstable = seeds_of([0.80, 0.78, 0.81, 0.77])  # 1 point below the best on average, ± 2 points
    settings = [best, *stable, unstable]
    pooled = SeedSpread.pooled(settings)
    table = SeedSpread.pooled([candidate.minus(best) for candidate in settings[1:]])  # the rows, pooled
    assert within_tolerance(unstable, best, 0.02, 0.95, table).verdict == "yes"
    assert within_tolerance(unstable, best, 0.02, 0.95, difference_spread(unstable, best, pooled)).verdict \
        == "undecided"
    assert within_tolerance(stable[0], best, 0.02, 0.95, difference_spread(stable[0], best, pooled)).verdict == "yes"


def test_pairing_separates_what_separate_intervals_cannot():
    """B fixes 12 of A's errors on the same 300 examples: the intervals of A and B overlap, the paired
    difference does not contain 0."""
    rng = np.random.default_rng(2)
    a = correct_by_chance(rng, 300, 0.75)
    b = list(a)
    for index in [i for i, p in enumerate(a) if p == 0][:12]:
        b[index] = 1
    draws = Resamples.draw(300)
    ea, eb = estimate(draws, [a]), estimate(draws, [b])
    assert interval(ea)[1] > interval(eb)[0]  # overlapping
    comparison = better_or_worse(eb, ea)
    assert comparison.verdict == "yes" and comparison.low > 0 and comparison.difference == pytest.approx(0.04)
    assert better_or_worse(ea, eb).verdict == "no"
    assert better_or_worse(ea, ea).verdict == "undecided"


@pytest.mark.parametrize(("accuracy", "n", "verdict"),
                         [(0.90, 2000, "yes"), (0.60, 2000, "no"), (0.88, 100, "undecided")])
def test_within_tolerance_says_what_the_data_shows(accuracy, n, verdict):
    rng = np.random.default_rng(3)
    best = correct_by_chance(rng, n, 0.90)
    candidate = best if accuracy == 0.90 else [p if rng.random() > abs(0.90 - accuracy) * 1.2 else 0 for p in best]
    draws = Resamples.draw(n)
    result = within_tolerance(estimate(draws, [candidate]), estimate(draws, [best]), tolerance=0.02)
    assert result.verdict == verdict
    assert result.low <= result.difference <= result.high


def test_seeds_that_disagree_leave_the_data_undecided():
    """On each seed alone the candidate is clearly worse or clearly fine; over two seeds that disagree this much,
    nothing can be claimed."""
    rng = np.random.default_rng(4)
    draws = Resamples.draw(2000)
    best = [correct_by_chance(rng, 2000, 0.9), correct_by_chance(rng, 2000, 0.9)]
    candidate = [best[0], [p if rng.random() > 0.12 else 0 for p in best[1]]]
    assert within_tolerance(estimate(draws, candidate), estimate(draws, best), 0.02).verdict == "undecided"


def test_paired_settings_need_the_same_seeds():
    draws = Resamples.draw(3)
    with pytest.raises(ValueError, match="same seeds"):
        estimate(draws, [[1, 0, 1]]).minus(estimate(draws, [[1, 0, 1], [1, 1, 1]]))


# ----------------------------------------------------------------------------------------- what would settle it


def differences_estimate(draws: Resamples, differences: np.ndarray) -> Estimate:
    """Two seeds whose per-example paired differences from the reference are both ``differences`` (the reference
    scores 0 everywhere: its estimate is all zeros)."""
    resampled = differences[draws.examples].mean(axis=1)
    return Estimate(np.full(2, differences.mean()), np.stack([resampled, resampled]), len(differences))


def test_the_dev_examples_that_would_settle_it_do():
    """Two seeds that agree on every example, so all of the width is the dev sample's and seeds will not help: the
    number of paired examples it names, with the same mix of per-example differences, decides; 85% of it does
    not."""
    def mix(n):  # the candidate is 4 points worse: it loses 11% of the examples the reference gets right, wins 7%
        worse, better = round(0.11 * n), round(0.07 * n)
        return np.random.default_rng(6).permutation(np.repeat([-1.0, 0.0, 1.0], [worse, n - worse - better, better]))

    def reference(draws):
        return Estimate(np.zeros(2), np.zeros((2, draws.examples.shape[0])), draws.examples.shape[1])

    draws = Resamples.draw(400, 2000)
    candidate = differences_estimate(draws, mix(400))
    assert within_tolerance(candidate, reference(draws), 0.02).verdict == "undecided"
    settle = what_would_settle(candidate, reference(draws), 0.02)
    assert settle.decides == "no" and settle.seed == 0 and settle.seeds is None and settle.seeds_cannot_decide
    assert settle.dev_share == 1.0 and settle.examples > 400
    for factor, verdict in ((1.15, "no"), (0.85, "undecided")):
        bigger = mix(int(factor * settle.examples))
        bigger_draws = Resamples.draw(len(bigger), 2000)
        found = within_tolerance(differences_estimate(bigger_draws, bigger), reference(bigger_draws), 0.02)
        assert found.verdict == verdict, (factor, found)


def test_the_seeds_that_would_settle_it_follow_student_t_and_examples_cannot():
    """No dev noise, two seeds 1 point apart around −1 (tolerance 2): t(0.95, 1) leaves it open; the seed part
    t(0.95, n − 1) · 0.71 / √n first drops below the 1-point gap at n = 4 (2.35 · 0.71 / 2 = 0.83; at n = 3,
    2.92 · 0.71 / 1.73 = 1.19). A bigger dev set cannot narrow a seed part of 3.2 points."""
    scores = np.array([-0.005, -0.015])
    candidate = Estimate(scores, np.repeat(scores[:, None], 100, axis=1), 872)
    reference = Estimate(np.zeros(2), np.zeros((2, 100)), 872)
    assert within_tolerance(candidate, reference, 0.02).verdict == "undecided"
    settle = what_would_settle(candidate, reference, 0.02)
    assert settle.decides == "yes" and settle.gap == pytest.approx(0.01)
    assert settle.dev == 0 and settle.seed == pytest.approx(6.314 * 0.00707 / np.sqrt(2), rel=1e-3)
    assert settle.seeds == 4 and settle.examples is None and settle.together is None
    assert not settle.seeds_cannot_decide and settle.dev_share == 0.0


def test_when_neither_alone_would_both_together_do():
    """A dev part that seeds cannot remove and a seed part a bigger dev set cannot: the seeds for half the gap's
    square, then the examples for the rest."""
    rng = np.random.default_rng(7)
    common = rng.normal(0, 0.004, 300)
    candidate = Estimate(np.array([-0.005, -0.015]), np.stack([-0.005 + common, -0.015 + common]), 500)
    reference = Estimate(np.zeros(2), np.zeros((2, 300)), 500)
    settle = what_would_settle(candidate, reference, 0.015)
    assert settle.seeds_cannot_decide and settle.seeds is None and settle.examples is None
    seeds, examples = settle.together
    assert seeds > 2 and examples > 500
    assert settle.dev_floor == pytest.approx(settle.dev, rel=1e-6)  # the seeds share all of the dev noise


def test_the_seeds_share_of_the_dev_variance_is_measured_from_their_resamples():
    """Resampled differences = shared part (variance 1) + each seed's own (variance 3): of the variance of the mean
    over 4 seeds, 1 / (1 + 3/4) is shared."""
    rng = np.random.default_rng(8)
    shared = rng.normal(0, 1, 20000)
    samples = shared + rng.normal(0, np.sqrt(3), (4, 20000))
    assert shared_dev_fraction(samples) == pytest.approx(1 / 1.75, abs=0.03)
    assert shared_dev_fraction(samples[:1]) == 1.0  # one seed: cannot be told apart


def test_a_difference_on_the_tolerance_names_no_number_and_a_far_one_no_absurd_one():
    rng = np.random.default_rng(9)
    noise = rng.normal(0, 0.01, (2, 500))
    reference = Estimate(np.array([0.80, 0.81]), np.array([[0.80], [0.81]]) + noise, 872)
    on_it = Estimate(reference.scores - 0.01, reference.samples - 0.01 + rng.normal(0, 0.01, (2, 500)), 872)
    settle = what_would_settle(on_it, reference, 0.01)
    assert settle.gap == 0 and settle.seeds is None and settle.examples is None and settle.together is None
    just_off = Estimate(reference.scores - 0.0101, on_it.samples - 0.0001, 872)
    assert what_would_settle(just_off, reference, 0.01).examples is None  # over 100 times today's dev set
