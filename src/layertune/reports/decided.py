"""A study decided in rounds (``decide`` in params.yaml; `layertune.rounds`), in its report: the claims of the
sequential rule after each recorded round, the answer they give, the compute each round spent, and what the rule
would run next.

The layers and methods reports call `decide_question` per task and encoder and show its claims in their *within
tolerance?* column (in place of the fixed 95% test, which does not stay valid when one looks after every round);
their intervals stay the fixed ones, on the seeds both settings have, and on the data the claims are made on: once a
round added evaluation examples, the dev and evaluation examples together (`Decision.on_claims_data`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from layertune import rounds as rule  # its FUTILE, read when a report is written
from layertune.reports.common import Setting, StudyResults, markdown_table
from layertune.rounds import RULE, Round, allocate, answer, next_round, recorded_rounds, replay, seeds_by_setting
from layertune.statistics import (
    Estimate,
    Looks,
    Resamples,
    SeedSpread,
    Verdict,
    difference_spread,
    first_good_enough,
    first_seeds,
    what_would_settle,
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
    estimates: dict[str, Estimate]  # each setting's, at the last look, on the data its claims are made on
    chosen: list[Round | None]  # after each look, the round the rule chooses: a recorded round must be it
    stalled: dict[str, float]  # settings in question the seeds the looks leave could hardly settle, and their chance

    @property
    def follows_rule(self) -> list[bool]:
        """Per round after the first, whether it is the round the rule chose from the looks before it (the number
        of evaluation examples aside: as many as there were to carve)."""
        return [_same(done, chosen) for done, chosen in zip(self.rounds[1:], self.chosen)]

    @property
    def last(self) -> dict[str, Verdict]:
        return self.claims[-1]

    @property
    def next_levels(self) -> tuple[float, float] | None:
        """The one-sided errors at which the rule's next look would claim a setting within tolerance, and worse (its
        level, and that level over the number of other settings: `layertune.statistics.sequential_look`); None once
        every look is spent."""
        look = len(self.rounds) + 1
        if look > self.looks.maximum:
            return None
        level = self.looks.level(look)
        return level, level / max(len(self.estimates) - 1, 1)

    @property
    def evaluation_examples(self) -> int:
        """How many evaluation examples a round added to the dev examples (0: none)."""
        return max((done.examples for done in self.rounds), default=0)

    def on_claims_data(self, settings: Sequence[Setting]) -> list[Setting]:
        """``settings`` as the claims see them: once a round added evaluation examples, each one's estimate on its
        dev and evaluation examples together, with the seed spread pooled over the question's settings; otherwise
        as they are. A table's intervals and what would settle it are then of the claims' data."""
        if not self.evaluation_examples:
            return list(settings)
        # a setting is named by its third grid axis: tunable layers, or a methods study's method
        moved = [replace(setting, estimate=self.estimates[str(setting.tunable_layers)]) for setting in settings]
        spread = SeedSpread.pooled([setting.estimate for setting in moved])
        return [replace(setting, spread=spread) for setting in moved]


def decide_question(results: StudyResults, task: str, encoder: str, estimates: Mapping[str, Estimate],
                    order: Sequence[str]) -> Decision:
    """The sequential rule replayed over the recorded rounds of ``task`` and ``encoder`` (``estimates``: each
    setting's estimate over all its seeds, in round order; ``order``: cheapest first)."""
    spec, options = results.plan.spec, results.options
    looks = Looks(spec.decide.looks, alpha=1 - options.confidence, spending=spec.decide.spending)
    rounds = [Round(done.seeds, tuple(map(str, done.settings)), done.examples)
              for done in recorded_rounds(spec)[(task, encoder)]]
    extended = evaluation_estimates(results, task, encoder) if any(done.examples for done in rounds) else {}
    if extended:  # as many as there were to carve (at most evaluation_size)
        carved = len(results.evaluation[task]["references"])
        rounds = [Round(done.seeds, done.settings, carved) if done.examples else done for done in rounds]

    def estimate_of(setting: str, seeds, on_evaluation_examples: bool) -> Estimate:
        return first_seeds((extended if on_evaluation_examples else estimates)[setting], len(seeds))

    claims = replay(rounds, estimate_of, options.tolerance, looks)
    order = list(order)
    # Scored from the saved cells' sentence-level predictions: not for token classification.
    evaluation_size = spec.decide.evaluation_size if results.corpora[task]().task_type != "token_classification" \
        else None

    def at_look(look: int) -> dict[str, Estimate]:  # what the rule saw at a look: the cells of its rounds
        seen = any(done.examples for done in rounds[:look])
        return {setting: estimate_of(setting, seeds, seen) for setting, seeds in seeds_by_setting(rounds[:look]).items()}

    def chosen_after(look: int) -> tuple[Round | None, dict[str, int | None]]:
        seen = at_look(look)
        allocation = allocate(seen, claims[look - 1], order, options.tolerance, looks, look,
                              spec.decide.seeds_per_round, rounds[look - 1].settings)
        return next_round(rounds[:look], claims[look - 1], order, looks, spec.decide.seeds_per_round, allocation,
                          evaluation_size, _dev_dominates(seen, claims[look - 1], options)), allocation.stalled

    chosen = [chosen_after(look) for look in range(1, len(rounds) + 1)]
    grid = {name: first_seeds(estimate, len(spec.seeds)) for name, estimate in estimates.items()}
    return Decision(task, encoder, rounds, claims, order, answer(claims[-1], order), looks, chosen[-1][0],
                    _fixed_answer(grid, order, options.tolerance, options.confidence), at_look(len(rounds)),
                    [found for found, _ in chosen], chosen[-1][1])


def _same(recorded: Round, chosen: Round | None) -> bool:
    """A recorded round is the one chosen: the same seeds for the same settings (in whatever order: the record keeps
    the grid's, the rule reads them cheapest first), or both the evaluation examples."""
    if chosen is None or bool(recorded.examples) != bool(chosen.examples):
        return False
    return bool(recorded.examples) or (recorded.seeds, set(recorded.settings)) == (chosen.seeds, set(chosen.settings))


def evaluation_estimates(results: StudyResults, task: str, encoder: str) -> dict[str, Estimate]:
    """Each setting of a question (by name, its seeds in plan order) on its dev examples and the evaluation
    examples together: the saved cells' predictions on both (evaluate scored the latter), resampled alike for
    every setting (paired)."""
    from layertune.metrics import compute_metrics, metric_for

    extra, corpus = results.evaluation[task], results.corpora[task]()
    metrics = metric_for(corpus.main_metric, corpus.metrics)
    cells = [cell for cell in results.plan.cells if cell.task == task and cell.encoder == encoder]
    references = results.cells[cells[0].key].predictions()["dev"]["references"] + extra["references"]
    draws = Resamples.draw(len(references), results.options.resamples)
    found = {}
    for setting in dict.fromkeys(str(cell.setting[2]) for cell in cells):
        group = [cell for cell in cells if str(cell.setting[2]) == setting]
        predictions = [results.cells[cell.key].predictions()["dev"]["predictions"] + extra["predictions"][cell.key]
                       for cell in group]
        scores = [compute_metrics(metrics, each, references)[corpus.main_metric] for each in predictions]
        found[setting] = draws.estimate(metrics, corpus.main_metric, predictions, references, scores)
    return found


# The dev examples' share of an open comparison's uncertainty from which the rule adds evaluation examples rather
# than seeds: more seeds cannot shrink the part of the dev noise they share, nor quickly the rest.
DEV_DOMINATES = 0.5


def _dev_dominates(estimates: Mapping[str, Estimate], claims: Mapping[str, Verdict], options) -> bool:
    """Whether, for some open comparison (a setting in question against the best), the dev examples are most of the
    uncertainty, or more seeds cannot decide it at all, as `what_would_settle` says."""
    best = max(estimates, key=lambda name: estimates[name].mean)
    pooled = SeedSpread.pooled(list(estimates.values()))
    settlements = [what_would_settle(estimates[name], estimates[best], options.tolerance, options.confidence,
                                     difference_spread(estimates[name], estimates[best], pooled))
                   for name, claim in claims.items() if claim == "undecided" and name != best]
    return any(settle.dev_share >= DEV_DOMINATES or settle.seeds_cannot_decide for settle in settlements)


def _fixed_answer(estimates: Mapping[str, Estimate], order: list[str], tolerance: float, confidence: float) -> str:
    """The answer of the fixed test (`layertune.statistics.within_tolerance` against the best, one look)."""
    best = max(order, key=lambda name: estimates[name].mean)
    pooled = SeedSpread.pooled([estimates[name] for name in order])
    verdicts = [(name, "yes" if name == best else within_tolerance(
        estimates[name], estimates[best], tolerance, confidence,
        difference_spread(estimates[name], estimates[best], pooled)).verdict) for name in order]
    chosen, candidates = first_good_enough(verdicts)
    return f"**{chosen}**" if chosen is not None else f"cannot decide: {', '.join(candidates)}"


def versus_header(decision: Decision | None, reference: str) -> str:
    """A question's *vs best* column: of the dev examples, or of the claims' data once a round added examples,
    naming the setting compared with (the best there, which need not be the best on dev)."""
    if decision is None or not decision.evaluation_examples:
        return "vs best (points)"
    return f"vs {reference}, the best on dev and {decision.evaluation_examples:,} evaluation examples (points)"


def rule_text(results: StudyResults) -> str:
    decide = results.plan.spec.decide
    return (f"Decided in rounds (at most {decide.looks}, the grid's seeds the first): after each round the settings "
            "shown worse than the best by more than the tolerance stop, and the next "
            f"{decide.seeds_per_round} seed(s) go where they can settle something: to each setting in question whose "
            f"chance of a claim with the seeds of the rounds left is {rule.FUTILE:.0%} or more, and to the settings it "
            "is compared with"
            + (f", or, once the dev examples are most of an open comparison's uncertainty, {decide.evaluation_size:,} "
               "more labelled examples the study does not train on, carved from the task's training data and scored "
               "from the saved cells (once)" if decide.evaluation_size else "")
            + ". *Within tolerance?* shows the claims of the sequential rule after "
            f"the last round: {1 - results.options.confidence:.0%} one-sided error spent over the {decide.looks} "
            f"looks ({decide.spending} spending), so that the claims hold however often one looks (docs/pipeline.md, "
            "\"Deciding in rounds\"). The intervals shown are the fixed ones, on the seeds both settings have and on "
            "the data the claims are made on (once a round added evaluation examples, on the dev and evaluation "
            "examples together).\n")


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
        added = f"+{done.examples:,} evaluation examples" if done.examples else ", ".join(map(str, done.seeds))
        rows.append([number, added, ", ".join(done.settings) if done.seeds else "–", len(keys), f"{spent:.1f}",
                     by_claim["yes"], by_claim["no"], by_claim["undecided"]])
    header = ["round", "seeds" if not any(done.examples for done in decision.rounds) else "seeds or examples",
              f"{setting_header} trained", "cells", "training time (s)",
              *[f"then {text}" for text in CLAIMS.values()]]
    stalled = "; ".join(f"{name}: {chance:.0%}" for name, chance in decision.stalled.items())
    if decision.answer is not None:
        outcome = f"Decided after round {len(decision.rounds)}: **{decision.answer}**."
    elif decision.next is None and len(decision.rounds) < decision.looks.maximum:
        outcome = (f"Not decided after round {len(decision.rounds)} of at most {decision.looks.maximum}, and the "
                   f"seeds the rounds left give have less than a {rule.FUTILE:.0%} chance of settling any "
                   f"comparison in question (the chance of a claim: {stalled}): no more rounds; what would settle "
                   "each is below.")
    elif decision.next is not None and decision.next.examples:
        outcome = (f"Not decided after round {len(decision.rounds)} of at most {decision.looks.maximum}: the dev "
                   f"examples are most of the uncertainty, so the next round would add {decision.next.examples:,} "
                   "evaluation examples (scored from the saved cells; nothing trains) "
                   f"(`layertune repro --decide {study}`).")
    elif decision.next is not None:
        # A stalled setting can still get seeds: as what a setting in question is compared with.
        partners = [name for name in decision.stalled if name in decision.next.settings]
        left_out = [name for name in decision.stalled if name not in decision.next.settings]
        chances = {name: f"{name}: {chance:.0%}" for name, chance in decision.stalled.items()}
        outcome = (f"Not decided after round {len(decision.rounds)} of at most {decision.looks.maximum}: the next "
                   f"round would train seed(s) {', '.join(map(str, decision.next.seeds))} of "
                   f"{', '.join(decision.next.settings)} (`layertune repro --decide {study}`)"
                   + (f"; {', '.join(partners)} only as what the others are compared with, since the seeds the rounds "
                      f"left give could hardly settle their own claims (the chance of a claim: "
                      f"{'; '.join(chances[name] for name in partners)})" if partners else "")
                   + (f"; none for settings the seeds the rounds left give could hardly settle (the chance of "
                      f"a claim: {'; '.join(chances[name] for name in left_out)})" if left_out else "") + ".")
    else:
        outcome = (f"Not decided, and all {decision.looks.maximum} rounds are spent: what would settle each "
                   "comparison in question is below.")
    strays = [str(number) for number, follows in enumerate(decision.follows_rule, start=2) if not follows]
    if strays:
        outcome += (f" Round(s) {', '.join(strays)} are not what today's rule ({RULE}) chooses from the rounds "
                    "before: clear the record to decide the study again.")
    return (f"### Rounds\n\n{markdown_table(header, rows, 'rllrrlll')}\n"
            f"Training time over all rounds: {total:.1f} s. {outcome} The grid alone (round 1), by the fixed test at "
            f"{results.options.confidence:.0%}: {decision.grid_answer}.\n")


def rounds_details(decision: Decision) -> dict:
    """What a rebuild reproduces byte for byte (no times): each round's seeds, settings and claims, the answer and
    the round that would come next."""
    return {"order": decision.order, "answer": decision.answer, "looks": decision.looks.maximum, "rule": RULE,
            "rounds": [{**_round_details(done), "claims": claims, **({"follows_rule": follows} if number else {})}
                       for number, (done, claims, follows) in enumerate(zip(
                           decision.rounds, decision.claims, [True, *decision.follows_rule]))],
            "next_round": None if decision.next is None else _round_details(decision.next),
            "stalled": decision.stalled, "grid_answer": decision.grid_answer}


def _round_details(done: Round) -> dict:
    # "examples" only for the round that adds them: the details of a study with none stay as they were
    return {"seeds": list(done.seeds), "settings": list(done.settings),
            **({"examples": done.examples} if done.examples else {})}
