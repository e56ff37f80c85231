"""A study decided in rounds (layertune.rounds): the next round's seeds and settings, when it stops, and a rebuild
that replays the recorded rounds reaching the same claims as the study that ran them."""

import numpy as np
import pytest

from layertune.rounds import Round, answer, next_round, replay, seeds_by_setting
from layertune.statistics import Estimate, Looks, Resamples

ORDER = ("0", "1", "2", "all")  # cheapest first
ACCURACY = {"0": 0.70, "1": 0.795, "2": 0.80, "all": 0.80}
EXAMPLES = 2000
WEIGHTS = np.stack([np.bincount(row, minlength=EXAMPLES) for row in Resamples.draw(EXAMPLES, 200).examples])
DIFFICULTY = np.random.default_rng(0).random(EXAMPLES)


def cell(setting: str, seed: int) -> np.ndarray:
    """A trained cell's per-example correctness: the same cell every time it is asked for (a saved cell folder)."""
    rng = np.random.default_rng([ORDER.index(setting), seed])
    p = ACCURACY[setting] + rng.normal(0, 0.003)
    return np.where(rng.random(EXAMPLES) < 0.95, DIFFICULTY < p, rng.random(EXAMPLES) < p).astype(float)


def estimate(setting: str, seeds) -> Estimate:
    cells = [cell(setting, seed) for seed in seeds]
    return Estimate(np.array([c.mean() for c in cells]), np.stack([WEIGHTS @ c / EXAMPLES for c in cells]), EXAMPLES)


def test_a_rebuild_replaying_the_recorded_rounds_reaches_the_claims_the_study_made():
    looks = Looks(4)
    rounds, live = [Round((1, 2), ORDER)], []
    while True:
        live = replay(rounds, estimate, 0.01, looks)  # what the study sees after its latest round
        following = next_round(rounds, live[-1], ORDER, looks, 2)
        if following is None:
            break
        rounds.append(following)
    assert live[0]["0"] == "no" and rounds[1] == Round((3, 4), ("1", "2", "all"))  # K = 0 stopped after round 1
    assert seeds_by_setting(rounds)["0"] == [1, 2] and seeds_by_setting(rounds)["all"][-2:] == [2 * len(rounds) - 1,
                                                                                                2 * len(rounds)]
    assert replay(rounds, estimate, 0.01, looks) == live  # the same cells, the same rounds: the same claims
    assert "yes" in live[-1].values() and answer(live[-1], ORDER) in ("1", "2", None) and len(rounds) <= 4


def test_the_next_round_gives_new_seeds_to_every_setting_not_shown_worse():
    rounds = [Round((1, 2), ORDER), Round((3, 4), ("1", "2", "all"))]
    claims = {"0": "no", "1": "undecided", "2": "yes", "all": "no"}
    assert next_round(rounds, claims, ORDER, Looks(4), 3) == Round((5, 6, 7), ("1", "2"))


def test_it_stops_when_the_answer_is_decided_or_the_looks_are_spent():
    rounds = [Round((1, 2), ORDER)]
    assert answer({"0": "no", "1": "yes", "2": "undecided", "all": "yes"}, ORDER) == "1"
    assert next_round(rounds, {"0": "no", "1": "yes"}, ORDER, Looks(4), 2) is None
    assert answer({"0": "undecided", "1": "yes"}, ORDER) is None  # a cheaper one is still open
    assert next_round(rounds * 4, {}, ORDER, Looks(4), 2) is None
    with pytest.raises(ValueError, match="5 rounds recorded, more than the 4 looks the rule allows"):
        replay(rounds * 5, estimate, 0.01, Looks(4))
    with pytest.raises(ValueError, match="seeds per round must be at least 1; got 0"):
        next_round(rounds, {}, ORDER, Looks(4), 0)
