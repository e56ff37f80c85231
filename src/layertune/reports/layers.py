"""The layer-ablation report: per task and encoder, the dev score for each number of tunable layers, and the fewest
layers that are not worse than the best by more than the tolerance, decided by a paired test.

The rule: the *best* setting is the one with the highest mean score. A setting is good enough when a one-sided
paired test (same dev examples, same seeds; `layertune.statistics`) shows that its shortfall from the best is below
the tolerance.
The recommendation is the fewest tunable layers that is good enough. Where a setting with fewer layers is neither
shown good enough nor shown worse by more than the tolerance, the data cannot decide whether it would do, and the
report names the candidates instead of a winner.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial

import pandas as pd

from layertune.reports.common import (
    WITHIN_TOLERANCE,
    Report,
    PAIRED_TEST,
    Setting,
    StudyResults,
    display,
    drift_figure,
    in_layers_order,
    learning_curves_figure,
    markdown_table,
    points,
    quality_figure,
    round_metric,
    score_text,
    settings,
    settings_table,
    settle_details,
    settle_section,
    settle_undecided,
    setup_text,
    signed_points,
    time_figure,
)
from layertune.reports import references
from layertune.reports.decided import Decision, decide_question, rounds_details, rounds_section, versus_header
from layertune.reports.decided import rule_text as decided_rule
from layertune.statistics import (
    Comparison,
    Estimate,
    SeedSpread,
    Settlement,
    difference_spread,
    first_good_enough,
    within_tolerance,
)
from layertune.study import layers_order



@dataclass
class Recommendation:
    """The answer for one task and encoder: the best setting, every setting against it, and the recommendation
    (``recommended`` is None where the data cannot decide; ``candidates`` then lists the layer counts in question,
    and ``settle`` what would decide each undecided one)."""

    task: str
    encoder: str
    best: Setting
    comparisons: dict[str, Comparison]
    recommended: int | str | None
    candidates: list[int | str]
    settle: dict[str, Settlement] = field(default_factory=dict)
    decision: Decision | None = None  # a study decided in rounds: its rounds and the claims after each
    reference: str = ""  # the setting the others are compared with: the best on the claims' data


def recommend(group: list[Setting], tolerance: float, confidence: float,
              decision: Callable[[dict[str, Estimate], list[str]], Decision] | None = None) -> Recommendation:
    """The fewest tunable layers shown within ``tolerance`` of the best (see the module's rule); in a study decided
    in rounds, the claims of ``decision`` (`layertune.reports.decided.decide_question`) in place of the test's, and
    the comparisons on the data they are made on."""
    best = max(group, key=lambda s: s.mean)
    order = layers_order(s.tunable_layers for s in group)
    decided, compared = None, group
    if decision is not None:
        decided = decision({str(s.tunable_layers): s.estimate for s in group}, [str(k) for k in order])
        compared = decided.on_claims_data(group)
    reference = max(compared, key=lambda s: s.mean)  # the best on the claims' data (in grid order, as `best`)
    ordered = sorted(compared, key=lambda s: order.index(s.tunable_layers))
    pooled = SeedSpread.pooled([s.estimate for s in ordered])
    comparisons = {str(s.tunable_layers): _against(s, reference, tolerance, confidence, pooled) for s in ordered}
    if decided is not None:
        comparisons = {name: replace(c, verdict=decided.last[name]) for name, c in comparisons.items()}
    recommended, candidates = first_good_enough([(s.tunable_layers, comparisons[str(s.tunable_layers)].verdict)
                                                 for s in ordered])
    in_doubt = {str(s.tunable_layers): (s, comparisons[str(s.tunable_layers)].verdict) for s in ordered
                if s.tunable_layers in candidates}
    settle = settle_undecided(in_doubt, reference, tolerance, confidence, pooled, decided and decided.next_levels)
    return Recommendation(best.task, best.encoder, best, comparisons, recommended, candidates, settle, decided,
                          str(reference.tunable_layers))


def _against(setting: Setting, best: Setting, tolerance: float, confidence: float,
             pooled: SeedSpread | None) -> Comparison:
    if setting is best:  # good enough by definition (with tolerance 0 its own test could not pass)
        return Comparison(0.0, 0.0, 0.0, "yes")
    return within_tolerance(setting.estimate, best.estimate, tolerance, confidence,
                            difference_spread(setting.estimate, best.estimate, pooled))


def recommendations(found: list[Setting], tolerance: float, confidence: float,
                    results: StudyResults | None = None) -> list[Recommendation]:
    """One per task and encoder; by the rounds' claims where ``results`` are of a study decided in rounds."""
    groups: dict[tuple[str, str], list[Setting]] = {}
    for setting in found:
        groups.setdefault((setting.task, setting.encoder), []).append(setting)
    decided = results is not None and results.plan.spec.decide is not None
    return [recommend(group, tolerance, confidence,
                      partial(decide_question, results, task, encoder) if decided else None)
            for (task, encoder), group in groups.items()]


def answer_text(recommendation: Recommendation) -> str:
    if recommendation.recommended is not None:
        return f"**{recommendation.recommended}**"
    *fewer, last = [str(k) for k in recommendation.candidates]
    return f"cannot decide: {', '.join(fewer)} or {last}" if fewer else f"cannot decide ({last} is in question)"


def rule_text(tolerance: float, confidence: float) -> str:
    return (f"Recommended: the fewest tunable layers whose score is not worse than the best setting's (highest mean) "
            f"by more than {100 * tolerance:g} point(s), shown by a one-sided paired test at {confidence:.0%} "
            f"({PAIRED_TEST}). *Within tolerance?* says what the test shows: yes, no (worse by more than the "
            "tolerance) or undecided; where a setting with fewer layers is undecided, the data cannot decide whether "
            "it would do, and no single number is named.\n")


def task_section(results: StudyResults, found: list[Setting], chosen: list[Recommendation]) -> str:
    """Per task: a table per encoder (rows: tunable layers), then the recommendation."""
    scores = results.scores.set_index("key")
    lines = []
    for recommendation in chosen:
        task, encoder = recommendation.task, recommendation.encoder
        rows = []
        for setting in (s for s in found if (s.task, s.encoder) == (task, encoder)):
            comparison = recommendation.comparisons[str(setting.tunable_layers)]
            cells = [c for c in results.plan.cells if c.setting == (task, encoder, setting.tunable_layers)]
            trainable = int(scores.loc[cells[0].key, "trainable_parameters"])
            seconds = scores.loc[[c.key for c in cells], "train_time_s"].mean()
            versus = "best" if str(setting.tunable_layers) == recommendation.reference else (
                f"{signed_points(comparison.difference)} [{signed_points(comparison.low)}, "
                f"{signed_points(comparison.high)}]")
            rows.append([setting.tunable_layers, f"{trainable:,}", score_text(setting), versus,
                         WITHIN_TOLERANCE[comparison.verdict], f"{seconds:.1f}"])
        rows = sorted(rows, key=lambda row: layers_order([r[0] for r in rows]).index(row[0]))
        metric = recommendation.best.metric
        lines += [f"## {display(task)} ({metric}), {encoder}\n",
                  markdown_table(["tunable layers", "trainable parameters", f"{metric} (points)",
                                  versus_header(recommendation.decision, recommendation.reference),
                                  "within tolerance?", "training time (s)"],
                                 rows, "lrrrlr"),
                  f"Recommended number of tunable layers: {answer_text(recommendation)} "
                  f"(best: {recommendation.best.tunable_layers}, {points(recommendation.best.mean)}).\n"]
        if recommendation.decision is not None:
            lines.append(rounds_section(results, recommendation.decision, "tunable layers", results.plan.name))
        if recommendation.settle:
            lines.append(settle_section(recommendation.settle, "tunable layers", results.options.tolerance,
                                        recommendation.decision and recommendation.decision.next_levels))
    return "\n".join(lines)


# Per task and encoder, what `dvc exp show` compares between experiments (the rest is in the details).
HEADLINE = ("recommended_layers", "best_layers", "best_score", "mean")


def report_details(found: list[Setting], chosen: list[Recommendation], tolerance: float) -> dict:
    """``{task: {encoder: {metric, mean: {K: …}, std, ci_low, ci_high, best_layers, best_score, recommended_layers,
    undecided_between, within_tolerance, what_would_settle, …}}}``."""
    details: dict = {}
    for setting in found:
        entry = details.setdefault(setting.task, {}).setdefault(setting.encoder, {
            "metric": setting.metric, "mean": {}, "std": {}, "ci_low": {}, "ci_high": {}, "seeds": len(setting.scores)})
        k = str(setting.tunable_layers)
        entry["mean"][k], entry["std"][k] = round_metric(setting.mean), round_metric(setting.std)
        entry["ci_low"][k], entry["ci_high"][k] = map(round_metric, setting.interval)
    for recommendation in chosen:
        details[recommendation.task][recommendation.encoder].update(
            best_layers=recommendation.best.tunable_layers, best_score=round_metric(recommendation.best.mean),
            recommended_layers=recommendation.recommended, undecided_between=recommendation.candidates,
            tolerance=tolerance, within_tolerance={k: c.verdict for k, c in recommendation.comparisons.items()},
            what_would_settle=settle_details(recommendation.settle))
        if recommendation.decision is not None:
            details[recommendation.task][recommendation.encoder]["decided"] = rounds_details(recommendation.decision)
    return details


def headline(details: dict) -> dict:
    """``{task: {encoder: {recommended_layers, best_layers, best_score, mean: {K: …}}}}`` of `report_details`."""
    return {task: {encoder: {key: entry[key] for key in HEADLINE} for encoder, entry in encoders.items()}
            for task, encoders in details.items()}


def layer_figures(results: StudyResults, table: pd.DataFrame) -> dict:
    figures = {"quality_vs_layers": quality_figure(in_layers_order(table), "Dev score vs tunable layers "
                                                   "(bars: 95% interval over dev examples and seeds)"),
               "training_time_vs_layers": time_figure(results.scores)}
    drift = drift_figure(results)
    if drift is not None:
        figures["drift_heatmap"] = drift
    for task in results.plan.spec.tasks:
        for encoder in results.plan.spec.encoders:
            figures[f"curves_{task}_{encoder}"] = learning_curves_figure(results, task, encoder)
    return figures


def layers_report(results: StudyResults) -> Report:
    """``reports/<study>.md``: setup, the rule, a table and a recommendation per task and encoder, figures."""
    options = results.options
    found = settings(results)
    chosen = recommendations(found, options.tolerance, options.confidence, results)
    figures = layer_figures(results, settings_table(found))
    gaps = references.gaps_to_probe(results, found)
    markdown = "\n".join([
        f"# Layer ablation: {results.plan.name}\n",
        setup_text(results),
        rule_text(options.tolerance, options.confidence),
        *([decided_rule(results)] if results.plan.spec.decide else []),
        task_section(results, found, chosen),
        "## References and convergence\n",
        references.section(results, "tunable layers", found, gaps),
        "## Figures\n",
        *[f"![{name}]({results.plan.name}/figures/{name}.png)\n" for name in figures],
    ])
    details = report_details(found, chosen, options.tolerance)
    return Report(markdown, headline(details), details, {"settings": settings_table(found), "cells": results.scores,
                                                         **references.tables(results, gaps)}, figures)
