"""A study decided in rounds: which settings get the next seeds, and the claims after each round, replayed from the
record of the rounds.

Round 1 trains every setting on the study's first seeds; after each round the sequential rule
(`layertune.statistics.sequential_look`, one look per round) claims settings within the tolerance of the best (yes)
or worse by more (no); the next round gives the next seeds to every setting not shown worse, until the answer is
decided or the looks are spent. Where the study has labelled examples to spare (``decide.evaluation_size``) and the
dev sample is most of an open comparison's uncertainty, more seeds would hardly help: the next round adds those
examples to the dev examples instead (once; the saved cells are scored on them, nothing trains). A driver records
each `Round` it starts; a rebuild replays the record with `replay` and reaches the same claims, look by look, from
the same cells.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from typing import TYPE_CHECKING

from layertune.statistics import Estimate, Looks, Verdict, sequential_look

if TYPE_CHECKING:
    from layertune.study import StudySpec


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


def next_round(rounds: Sequence[Round], claims: dict[str, Verdict], order: Sequence[str], looks: Looks,
               seeds_per_round: int, evaluation_size: int | None = None, dev_dominates: bool = False) -> Round | None:
    """The round after ``rounds``: the ``evaluation_size`` evaluation examples when the dev sample dominates an
    open comparison (``dev_dominates``) and no round has added them yet, else the next ``seeds_per_round`` seeds
    (after the largest used) for every setting not shown worse; None when the answer is decided or every look is
    spent."""
    if seeds_per_round < 1:
        raise ValueError(f"seeds per round must be at least 1; got {seeds_per_round}")
    if not rounds:
        raise ValueError("no round recorded: the first round, every setting on the study's seeds, comes first")
    if len(rounds) >= looks.maximum or answer(claims, order) is not None:
        return None
    contenders = tuple(setting for setting in order if claims.get(setting, "undecided") != "no")
    if evaluation_size and dev_dominates and not any(done.examples for done in rounds):
        return Round((), contenders, evaluation_size)
    start = max(seed for done in rounds for seed in done.seeds) + 1
    return Round(tuple(range(start, start + seeds_per_round)), contenders)


def recorded_rounds(study: StudySpec) -> dict[tuple[str, str], list[Round]]:
    """Per question (task, encoder) of a decided study, its rounds: round 1 the grid (every setting, the study's
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
