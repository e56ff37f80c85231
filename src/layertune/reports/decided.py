"""A study decided in rounds (``decide`` in params.yaml; `layertune.rounds`), in its report: the claims of the
sequential rule after each recorded round, the answer they give, the compute each round spent, and what the rule
would run next.

The layers and methods reports call `decide_question` per task and encoder and show its claims in their *within
tolerance?* column (in place of the fixed 95% test, which does not stay valid when one looks after every round);
their intervals stay the fixed ones, on the seeds both settings have.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from layertune.reports.common import StudyResults, markdown_table
from layertune.rounds import Round, answer, next_round, recorded_rounds, replay
from layertune.statistics import (
    Estimate,
    Looks,
    Verdict,
    differences_spread,
    first_good_enough,
    first_seeds,
    within_tolerance,
)

CLAIMS = {"yes": "within tolerance", "no": "worse", "undecided": "in question"}


@dataclass
class Decision:
    """One question (task and encoder) of a decided study: its rounds, the claims after each (settings named as
    text), the order in which the answer is read (cheapest first), the answer (None: not yet), and the round the
    rule would run next (None: answered, or every look spent)."""

    task: str
    encoder: str
    rounds: list[Round]
    claims: list[dict[str, Verdict]]
    order: list[str]
    answer: str | None
    looks: Looks
    next: Round | None
    grid_answer: str  # what the fixed test says of the grid alone (round 1), as the report would without rounds

    @property
    def last(self) -> dict[str, Verdict]:
        return self.claims[-1]


def decide_question(results: StudyResults, task: str, encoder: str, estimates: Mapping[str, Estimate],
                    order: Sequence[str]) -> Decision:
    """The sequential rule replayed over the recorded rounds of ``task`` and ``encoder`` (``estimates``: each
    setting's estimate over all its seeds, in round order; ``order``: cheapest first)."""
    spec, options = results.plan.spec, results.options
    looks = Looks(spec.decide.looks, alpha=1 - options.confidence, spending=spec.decide.spending)
    rounds = [Round(done.seeds, tuple(map(str, done.settings))) for done in recorded_rounds(spec)[(task, encoder)]]
    claims = replay(rounds, lambda setting, seeds: first_seeds(estimates[setting], len(seeds)), options.tolerance,
                    looks)
    order = list(order)
    return Decision(task, encoder, rounds, claims, order, answer(claims[-1], order), looks,
                    next_round(rounds, claims[-1], order, looks, spec.decide.seeds_per_round),
                    _fixed_answer({name: first_seeds(estimate, len(spec.seeds)) for name, estimate in estimates.items()},
                                  order, options.tolerance, options.confidence))


def _fixed_answer(estimates: Mapping[str, Estimate], order: list[str], tolerance: float, confidence: float) -> str:
    """The answer of the fixed test (`layertune.statistics.within_tolerance` against the best, one look)."""
    best = max(order, key=lambda name: estimates[name].mean)
    spread = differences_spread([estimates[name] for name in order if name != best], estimates[best])
    verdicts = [(name, "yes" if name == best else within_tolerance(estimates[name], estimates[best], tolerance,
                                                                   confidence, spread).verdict) for name in order]
    chosen, candidates = first_good_enough(verdicts)
    return f"**{chosen}**" if chosen is not None else f"cannot decide: {', '.join(candidates)}"


def rule_text(results: StudyResults) -> str:
    decide = results.plan.spec.decide
    return (f"Decided in rounds (at most {decide.looks}, the grid's seeds the first): after each round the settings "
            "shown worse than the best by more than the tolerance stop, and the others get the next "
            f"{decide.seeds_per_round} seed(s). *Within tolerance?* shows the claims of the sequential rule after "
            f"the last round: {1 - results.options.confidence:.0%} one-sided error spent over the {decide.looks} "
            f"looks ({decide.spending} spending), so that the claims hold however often one looks (docs/pipeline.md, "
            "\"Deciding in rounds\"). The intervals shown are the fixed ones, on the seeds both settings have.\n")


def rounds_section(results: StudyResults, decision: Decision, setting_header: str, study: str) -> str:
    """A table of the rounds (seeds, settings, cells, training time, claims after the round) and what comes next."""
    seconds = results.scores.set_index("key")["train_time_s"]
    cells = {(c.task, c.encoder, str(c.setting[2]), c.seed): c.key for c in results.plan.cells}
    rows, total = [], 0.0
    for number, (done, claims) in enumerate(zip(decision.rounds, decision.claims), start=1):
        keys = [cells[(decision.task, decision.encoder, setting, seed)] for setting in done.settings
                for seed in done.seeds]
        spent = float(seconds.loc[keys].sum())
        total += spent
        by_claim = {claim: ", ".join(name for name in decision.order if claims[name] == claim) or "–"
                    for claim in CLAIMS}
        rows.append([number, ", ".join(map(str, done.seeds)), ", ".join(done.settings), len(keys), f"{spent:.1f}",
                     by_claim["yes"], by_claim["no"], by_claim["undecided"]])
    header = ["round", "seeds", f"{setting_header} trained", "cells", "training time (s)",
              *[f"then {text}" for text in CLAIMS.values()]]
    if decision.answer is not None:
        outcome = f"Decided after round {len(decision.rounds)}: **{decision.answer}**."
    elif decision.next is not None:
        outcome = (f"Not decided after round {len(decision.rounds)} of at most {decision.looks.maximum}: the next "
                   f"round would train seed(s) {', '.join(map(str, decision.next.seeds))} of "
                   f"{', '.join(decision.next.settings)} (`layertune repro --decide {study}`).")
    else:
        outcome = (f"Not decided, and all {decision.looks.maximum} rounds are spent: what would settle each "
                   "comparison in question is below.")
    return (f"### Rounds\n\n{markdown_table(header, rows, 'rllrrlll')}\n"
            f"Training time over all rounds: {total:.1f} s. {outcome} The grid alone (round 1), by the fixed test at "
            f"{results.options.confidence:.0%}: {decision.grid_answer}.\n")


def rounds_details(decision: Decision) -> dict:
    """What a rebuild reproduces byte for byte (no times): each round's seeds, settings and claims, the answer and
    the round that would come next."""
    return {"order": decision.order, "answer": decision.answer, "looks": decision.looks.maximum,
            "rounds": [{"seeds": list(done.seeds), "settings": list(done.settings), "claims": claims}
                       for done, claims in zip(decision.rounds, decision.claims)],
            "next_round": None if decision.next is None else {"seeds": list(decision.next.seeds),
                                                              "settings": list(decision.next.settings)},
            "grid_answer": decision.grid_answer}
