"""Bootstrap intervals over examples and seeds, and paired comparisons."""

import numpy as np
import pytest

from layertune.statistics import Resamples, better_or_worse, interval, within_tolerance


def correct_by_chance(rng, n: int, accuracy: float) -> list[int]:
    """Predictions for references all 1: each right with probability ``accuracy``."""
    return (rng.random(n) < accuracy).astype(int).tolist()


def test_draws_are_reproducible_and_shaped():
    a, b = Resamples.draw(50, 3, resamples=20), Resamples.draw(50, 3, resamples=20)
    assert np.array_equal(a.examples, b.examples) and np.array_equal(a.seeds, b.seeds)
    assert a.examples.shape == (20, 50) and a.seeds.shape == (20, 3) and a.seeds.max() < 3


def test_interval_covers_the_true_accuracy_about_95_percent_of_the_time():
    rng = np.random.default_rng(0)
    draws = Resamples.draw(200, 1, resamples=400)
    covered = 0
    for _ in range(120):
        predictions = correct_by_chance(rng, 200, 0.7)
        low, high = interval(draws.scores(["accuracy"], "accuracy", [predictions], [1] * 200))
        covered += low <= 0.7 <= high
    assert 0.88 <= covered / 120 <= 0.99


def test_seeds_widen_the_interval():
    """Two seeds that disagree a lot give a wider interval than one seed: the seed is a source of variance."""
    rng = np.random.default_rng(1)
    good, bad = correct_by_chance(rng, 300, 0.85), correct_by_chance(rng, 300, 0.65)
    one = interval(Resamples.draw(300, 1).scores(["accuracy"], "accuracy", [good], [1] * 300))
    two = interval(Resamples.draw(300, 2).scores(["accuracy"], "accuracy", [good, bad], [1] * 300))
    assert two[1] - two[0] > 1.5 * (one[1] - one[0])


def test_pairing_separates_what_separate_intervals_cannot():
    """B fixes 12 of A's errors on the same 300 examples: the intervals of A and B overlap, the paired
    difference does not contain 0."""
    rng = np.random.default_rng(2)
    a = correct_by_chance(rng, 300, 0.75)
    b = list(a)
    for index in [i for i, p in enumerate(a) if p == 0][:12]:
        b[index] = 1
    draws = Resamples.draw(300, 1)
    sa, sb = (draws.scores(["accuracy"], "accuracy", [p], [1] * 300) for p in (a, b))
    assert interval(sa)[1] > interval(sb)[0]  # overlapping
    comparison = better_or_worse(sb, sa, observed=0.04)
    assert comparison.verdict == "yes" and comparison.low > 0
    assert better_or_worse(sa, sb, observed=-0.04).verdict == "no"
    assert better_or_worse(sa, sa, observed=0.0).verdict == "undecided"


@pytest.mark.parametrize(("accuracy", "n", "verdict"),
                         [(0.90, 2000, "yes"), (0.60, 2000, "no"), (0.88, 100, "undecided")])
def test_within_tolerance_says_what_the_data_shows(accuracy, n, verdict):
    rng = np.random.default_rng(3)
    best = correct_by_chance(rng, n, 0.90)
    candidate = [p if rng.random() > abs(0.90 - accuracy) * 1.2 else 0 for p in best]
    if accuracy == 0.90:
        candidate = best
    draws = Resamples.draw(n, 1)
    scores = [draws.scores(["accuracy"], "accuracy", [p], [1] * n) for p in (candidate, best)]
    observed = np.mean(candidate) - np.mean(best)
    result = within_tolerance(*scores, observed=observed, tolerance=0.02)
    assert result.verdict == verdict
    assert result.low <= observed <= result.high


def test_settings_must_bring_one_prediction_list_per_seed():
    with pytest.raises(ValueError, match="1 seeds of predictions for draws over 2"):
        Resamples.draw(3, 2).scores(["accuracy"], "accuracy", [[1, 0, 1]], [1, 1, 1])
