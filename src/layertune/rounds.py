"""A study decided in rounds: which settings get the next seeds, and the claims after each round, replayed from the
record of the rounds.

Round 1 trains every setting on the study's first seeds; after each round the sequential rule
(`layertune.statistics.sequential_look`, one look per round) claims settings within the tolerance of the best (yes)
or worse by more (no). The next round gives the next seeds only where they can settle something (`allocate`): to
each setting still in question whose comparison with its closest rival could be settled within the looks left, if
the observed difference holds, and to that rival; a comparison that no number of seeds the looks leave could settle
gets none (the report says what would). The answer is then decided, the looks spent, or nothing is left that seeds
could settle. Where the study has labelled examples to spare (``decide.evaluation_size``) and the dev sample is
most of an open comparison's uncertainty, more seeds would hardly help: the next round adds those examples to the
dev examples instead (once; the saved cells are scored on them, nothing trains). A driver records each `Round` it
starts, and `RULE` with the record; a rebuild replays the record with `replay` and reaches the same claims, look by
look, from the same cells, and checks that each recorded round is the one this rule chooses (`chosen_rounds`).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass

from layertune.statistics import Estimate, Looks, SeedSpread, Verdict, sequential_look, settle_chance

# The rule that chooses a decided study's rounds and makes its claims, as its record names it
# (``decide.decided_with.rule``): a new name whenever the claims or the choice of seeds could change, so that a
# record made under another rule is refused at plan time instead of being replayed as if this rule had made it.
# 1: every setting not shown worse got the next seeds, each pair's own seed spread (unnamed in records).
# 2: seeds only where they can settle something within the looks left (`allocate`).
RULE = "seeds-where-they-settle/2"


@dataclass(frozen=True)
class Round:
    """One round: the seeds it trained, and the settings that got them; or (``examples`` > 0) no seeds, and that
    many evaluation examples added to the dev examples of every look from this one on."""

    seeds: tuple[int, ...]
    settings: tuple[str, ...]
    examples: int = 0


def seeds_by_setting(rounds: Sequence[Round]) -> dict[str, list[int]]:
    """Each setting's seeds after ``rounds``, in the order they were trained (pairing takes the first ones)."""
    found: dict[str, list[int]] = {}
    for done in rounds:
        for setting in done.settings:
            found.setdefault(setting, []).extend(done.seeds)
    return found


def replay(rounds: Sequence[Round], estimate: Callable[[str, Sequence[int], bool], Estimate], tolerance: float,
           looks: Looks) -> list[dict[str, Verdict]]:
    """The claims after each of ``rounds``: look r sees each setting's cells of rounds 1 to r (``estimate``: a
    setting's estimate from the cells of these seeds, on the dev examples and, once a round has added them, the
    evaluation examples)."""
    if len(rounds) > looks.maximum:
        raise ValueError(f"{len(rounds)} rounds recorded, more than the {looks.maximum} looks the rule allows")
    claims: dict[str, Verdict] = {}
    history = []
    for look in range(1, len(rounds) + 1):
        seeds = seeds_by_setting(rounds[:look])
        extended = any(done.examples for done in rounds[:look])
        claims = sequential_look({setting: estimate(setting, used, extended) for setting, used in seeds.items()},
                                 tolerance, looks, look, claims)
        history.append(claims)
    return history


def answer(claims: dict[str, Verdict], order: Sequence[str]) -> str | None:
    """The cheapest setting in ``order`` shown within the tolerance, once every cheaper one is shown worse; None
    while a cheaper one is open."""
    first = next((setting for setting in order if claims.get(setting, "undecided") != "no"), None)
    return first if first is not None and claims.get(first) == "yes" else None


@dataclass(frozen=True)
class Allocation:
    """What the next round's seeds can settle: the settings they go to (in the given order), and per setting still
    in question that the seeds the looks leave could hardly settle, its chance of a claim with them."""

    settings: tuple[str, ...]
    stalled: dict[str, float]


# A comparison whose chance of being settled by the seeds the looks leave is below this gets no more seeds: the
# futility bound of stochastic curtailment (Lan, Simon and Halperin 1982), at the low end of the 10-20% trials use.
FUTILE = 0.1


def allocate(estimates: Mapping[str, Estimate], claims: Mapping[str, Verdict], order: Sequence[str], tolerance: float,
             looks: Looks, look: int, seeds_per_round: int, eligible: Collection[str]) -> Allocation:
    """After look ``look``, the settings the next seeds go to: for each setting still in question, the comparisons
    its claim turns on (`sequential_look`): "worse" needs its bound against some other setting, "within tolerance"
    against every other. Its chance of a claim with the seeds the looks left give (``seeds_per_round`` a round), at
    the last look's level (`settle_chance`: for "worse", against the other that makes it likeliest; for "within",
    against the one that makes it least likely), must reach `FUTILE`: then the setting and the others of those
    comparisons get the next seeds; else it is stalled, with its chance. Only the ``eligible`` settings (those of
    the last round) take part: a setting left out of a round stays out, so that every setting's seeds are the first
    of every longer list and pair by their order (`layertune.statistics.paired_difference`). A function of the
    recorded cells alone: a rebuild chooses the same."""
    if look >= looks.maximum:  # no round left to give seeds to
        return Allocation((), {})
    pooled = SeedSpread.pooled(list(estimates.values()))
    alive = [name for name in order if claims.get(name, "undecided") != "no"]
    level, rivals = looks.level(looks.maximum), max(len(estimates) - 1, 1)
    chosen: set[str] = set()
    stalled: dict[str, float] = {}
    for name in alive:
        others = [other for other in alive if other != name]
        if claims.get(name, "undecided") != "undecided" or not others or name not in eligible:
            continue
        if pooled is None or min(estimates[other].seeds for other in [name, *others]) < 2:  # nothing to project
            chosen |= {name, *(other for other in others if other in eligible)}
            continue
        final = estimates[name].seeds + seeds_per_round * (looks.maximum - look)
        chances = {other: settle_chance(estimates[name], estimates[other], pooled, tolerance, level, rivals, final)
                   for other in others if other in eligible}
        worse = max(chances, key=lambda other: chances[other][1], default=None)
        within = min((chances[other][0] for other in others if other in eligible), default=0.0) \
            if set(others) <= set(eligible) else 0.0
        if worse is not None and chances[worse][1] >= max(FUTILE, within):
            chosen |= {name, worse}
        elif within >= FUTILE:
            chosen |= {name, *others}
        else:
            stalled[name] = round(max(within, chances[worse][1] if worse is not None else 0.0), 3)
    return Allocation(tuple(name for name in order if name in chosen), stalled)


def next_round(rounds: Sequence[Round], claims: dict[str, Verdict], order: Sequence[str], looks: Looks,
               seeds_per_round: int, allocation: Allocation, evaluation_size: int | None = None,
               dev_dominates: bool = False) -> Round | None:
    """The round after ``rounds``: the ``evaluation_size`` evaluation examples when the dev sample dominates an
    open comparison (``dev_dominates``) and no round has added them yet, else the next ``seeds_per_round`` seeds
    (after the largest used) for the settings of ``allocation`` (`allocate`); None when the answer is decided,
    every look is spent, or no seeds could settle anything."""
    if seeds_per_round < 1:
        raise ValueError(f"seeds per round must be at least 1; got {seeds_per_round}")
    if not rounds:
        raise ValueError("no round recorded: the first round, every setting on the study's seeds, comes first")
    if len(rounds) >= looks.maximum or answer(claims, order) is not None:
        return None
    if evaluation_size and dev_dominates and not any(done.examples for done in rounds):
        return Round((), tuple(name for name in rounds[-1].settings if claims.get(name, "undecided") != "no"),
                     evaluation_size)
    if not allocation.settings:
        return None
    start = max(seed for done in rounds for seed in done.seeds) + 1
    return Round(tuple(range(start, start + seeds_per_round)), allocation.settings)


def recorded_rounds(study) -> dict[tuple[str, str], list[Round]]:
    """Per question (task, encoder) of a decided study (a `layertune.study.StudySpec`, which imports this module for
    `RULE`), its rounds: round 1 the grid (every setting, the study's
    seeds), then those of ``decide.rounds`` and ``decide.evaluation_rounds`` in their order. A setting is named as on
    the grid's third axis (tunable layers or method)."""
    settings = tuple(study.setting_name(k, method) for method, k in study.grid_settings)
    questions = {(task, encoder): [Round(tuple(study.seeds), settings)] for task in study.tasks
                 for encoder in study.encoders}
    later: dict[tuple[str, str], dict[int, tuple[dict, dict]]] = {}
    for cell in (study.decide.rounds.values() if study.decide else ()):
        seeds, chosen = later.setdefault((cell.task, cell.encoder), {}).setdefault(cell.round, ({}, {}))
        seeds[cell.seed] = None
        chosen[study.setting_name(cell.tunable_layers, cell.method)] = None
    decide = study.decide
    for task, encoders in (decide.evaluation_rounds.items() if decide else ()):
        for encoder, number in encoders.items():
            later.setdefault((task, encoder), {})[number] = ({}, {})
    for question, numbered in later.items():
        for number in sorted(numbered):
            seeds, chosen = numbered[number]
            if not seeds:  # the evaluation examples' round: the settings still in question then
                contenders = questions[question][-1].settings
                questions[question].append(Round((), contenders, decide.evaluation_size))
                continue
            # In the grid's order, whatever the record's: a round's settings and seeds are sets.
            questions[question].append(Round(tuple(sorted(seeds)), tuple(s for s in settings if s in chosen)))
    return questions
