"""The tuning-methods report: per task and encoder, each method's dev score with its interval, what it costs
(trainable parameters, training time), and the cheapest method not worse than the best by more than the tolerance,
decided by a paired test — by trainable parameters, and by training time. Peak memory is in the JSON only: on a CPU
it is the peak of the process that trained the cell, which carries the peaks of the cells it trained before, so a
table of it would compare the order the cells trained in, not the methods.

The rule is the layer report's with cost in place of layer count: the *best* method has the highest mean score; a
method is good enough when a one-sided paired test (same dev examples and seeds) shows its shortfall from the best is
below the tolerance; the answer is the cheapest good-enough method. Where a cheaper method is neither shown good
enough nor shown worse, the data cannot decide, and the report names the candidates instead of a winner.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np
import pandas as pd

from layertune.reports.common import (
    PAIRED_TEST,
    WITHIN_TOLERANCE,
    Report,
    Setting,
    StudyResults,
    display,
    literal,
    markdown_table,
    points,
    round_metric,
    score_text,
    settings,
    settle_details,
    settle_section,
    settle_undecided,
    setup_text,
    signed_points,
    theme,
)
from layertune.reports import references
from layertune.reports.decided import Decision, decide_question, rounds_details, rounds_section, versus_header
from layertune.reports.decided import rule_text as decided_rule
from layertune.statistics import (
    Comparison,
    SeedSpread,
    Settlement,
    difference_spread,
    first_good_enough,
    within_tolerance,
)

COSTS = {"trainable_parameters": "trainable parameters", "train_time_s": "training time"}


@dataclass
class MethodRow:
    """One method of one task and encoder: its setting, what it costs (means over seeds) and the test against the
    best."""

    setting: Setting
    trainable_parameters: int
    train_time_s: float
    peak_memory_mb: float
    comparison: Comparison

    @property
    def name(self) -> str:
        return str(self.setting.tunable_layers)  # a methods study's settings are named by their method setting


@dataclass
class MethodAnswer:
    """Per cost: the cheapest good-enough method, or None with the candidates the data cannot separate; ``settle``:
    what would decide each undecided candidate by trainable parameters (by training time the candidates vary from
    run to run)."""

    task: str
    encoder: str
    best: MethodRow
    rows: list[MethodRow]
    cheapest: dict[str, str | None]
    candidates: dict[str, list[str]]
    settle: dict[str, Settlement] = field(default_factory=dict)
    decision: Decision | None = None  # a study decided in rounds: its rounds and the claims after each
    reference: str = ""  # the method the others are compared with: the best on the claims' data


def cheapest(rows: list[MethodRow], cost: str) -> tuple[str | None, list[str]]:
    """The cheapest row by ``cost`` shown good enough, or None and the candidates (`first_good_enough`). Equal costs
    keep the table's order."""
    ordered = sorted(rows, key=lambda row: getattr(row, cost))
    return first_good_enough([(row.name, row.comparison.verdict) for row in ordered])


def answers(results: StudyResults, found: list[Setting]) -> list[MethodAnswer]:
    options, scores = results.options, results.scores.set_index("key")
    groups: dict[tuple[str, str], list[Setting]] = {}
    for setting in found:
        groups.setdefault((setting.task, setting.encoder), []).append(setting)
    out = []
    for (task, encoder), group in groups.items():
        best = max(group, key=lambda s: s.mean)
        costs = {}  # per method: trainable parameters, and the means over seeds of training time and peak memory
        for setting in group:
            keys = [c.key for c in results.plan.cells if c.setting == (task, encoder, setting.tunable_layers)]
            costs[str(setting.tunable_layers)] = (int(scores.loc[keys[0], "trainable_parameters"]),
                                                  float(scores.loc[keys, "train_time_s"].mean()),
                                                  float(scores.loc[keys, "peak_memory_mb"].mean()))
        decision, compared = None, group
        if results.plan.spec.decide is not None:  # the rounds' claims in place of the fixed test's, on their data
            order = sorted(costs, key=lambda name: costs[name][0])
            decision = decide_question(results, task, encoder, {str(s.tunable_layers): s.estimate for s in group},
                                       order)
            compared = decision.on_claims_data(group)
        reference = max(compared, key=lambda s: s.mean)
        pooled = SeedSpread.pooled([s.estimate for s in compared])
        rows = []
        for setting, on_claims in zip(group, compared):
            name = str(setting.tunable_layers)
            comparison = Comparison(0.0, 0.0, 0.0, "yes") if on_claims is reference else within_tolerance(
                on_claims.estimate, reference.estimate, options.tolerance, options.confidence,
                difference_spread(on_claims.estimate, reference.estimate, pooled))
            if decision is not None:
                comparison = replace(comparison, verdict=decision.last[name])
            rows.append(MethodRow(setting, *costs[name], comparison))
        chosen = {cost: cheapest(rows, cost) for cost in COSTS}
        in_doubt = {row.name: (s, row.comparison.verdict) for s, row in zip(compared, rows)
                    if row.name in chosen["trainable_parameters"][1]}
        out.append(MethodAnswer(task, encoder, next(r for r in rows if r.setting is best), rows,
                                {cost: found[0] for cost, found in chosen.items()},
                                {cost: found[1] for cost, found in chosen.items()},
                                settle_undecided(in_doubt, reference, options.tolerance, options.confidence, pooled,
                                                 decision and decision.next_levels),
                                decision, str(reference.tunable_layers)))
    return out


def method_text(results: StudyResults, name: str) -> str:
    """``lora (r 8, alpha 16, dropout 0.1) on the top 2 layers, rate 0.001``: the rate its cells trained at (the
    head's, for the head alone), as the study resolved it."""
    setting = results.plan.spec.methods[name]
    method = setting.method
    options = ", ".join(f"{k} {literal(v)}" for k, v in method.model_dump(exclude={"name"}).items() if v is not None)
    layers = "all layers" if setting.tunable_layers == "all" else (
        "no layer (the head alone)" if setting.tunable_layers == 0 else "the top layer" if setting.tunable_layers == 1
        else f"the top {setting.tunable_layers} layers")
    training = next(cell.spec.training for cell in results.plan.cells if cell.setting[2] == name)
    rate = f"head rate {training.head_learning_rate or training.learning_rate:g}" if setting.tunable_layers == 0 \
        else f"rate {training.learning_rate:g}"
    return f"{method.name}" + (f" ({options})" if options else "") + f" on {layers}, {rate}"


def answer_text(answer: MethodAnswer, cost: str) -> str:
    if answer.cheapest[cost] is not None:
        return f"**{answer.cheapest[cost]}**"
    *cheaper, last = answer.candidates[cost]
    return f"cannot decide: {', '.join(cheaper)} or {last}" if cheaper else f"cannot decide ({last} is in question)"


def rule_text(tolerance: float, confidence: float) -> str:
    return (f"The answer: the cheapest method (by trainable parameters, and by training time) whose score is not "
            f"worse than the best method's (highest mean) by more than {100 * tolerance:g} point(s), shown by a "
            f"one-sided paired test at {confidence:.0%} ({PAIRED_TEST}). Where a cheaper method is undecided, the "
            "data cannot decide whether it would do, and no single method is named.\n")


def task_sections(results: StudyResults, chosen: list[MethodAnswer]) -> str:
    lines = []
    for answer in chosen:
        metric = answer.best.setting.metric
        rows = [[f"`{row.name}`", method_text(results, row.name), f"{row.trainable_parameters:,}",
                 score_text(row.setting), "best" if row.name == answer.reference else
                 f"{signed_points(row.comparison.difference)} [{signed_points(row.comparison.low)}, "
                 f"{signed_points(row.comparison.high)}]", WITHIN_TOLERANCE[row.comparison.verdict],
                 f"{row.train_time_s:.1f}"] for row in answer.rows]
        lines += [f"## {display(answer.task)} ({metric}), {answer.encoder}\n",
                  markdown_table(["method", "what trains", "trainable parameters", f"{metric} (points)",
                                  versus_header(answer.decision, answer.reference), "within tolerance?",
                                  "training time (s)"], rows, "llrrrlr"),
                  f"Cheapest method within tolerance, by trainable parameters: {answer_text(answer, 'trainable_parameters')}"
                  f"; by training time: {answer_text(answer, 'train_time_s')} (best: {answer.best.name}, "
                  f"{points(answer.best.setting.mean)}).\n"]
        if answer.decision is not None:
            lines.append(rounds_section(results, answer.decision, "methods", results.plan.name))
        if answer.settle:
            lines.append(settle_section(answer.settle, "method", results.options.tolerance,
                                        answer.decision and answer.decision.next_levels))
    return "\n".join(lines)


def report_details(chosen: list[MethodAnswer], tolerance: float) -> dict:
    """Every number of the report that the same params, data and seeds reproduce byte for byte: times and memory
    (and the answer by training time) vary from run to run, so they are in the Markdown and methods.csv only."""
    details: dict = {}
    for answer in chosen:
        entry = details.setdefault(answer.task, {})[answer.encoder] = {
            "metric": answer.best.setting.metric, "seeds": len(answer.best.setting.scores), "tolerance": tolerance,
            "best_method": answer.best.name, "best_score": round_metric(answer.best.setting.mean),
            "cheapest_by_trainable_parameters": answer.cheapest["trainable_parameters"],
            "undecided_by_trainable_parameters": answer.candidates["trainable_parameters"],
            "what_would_settle": settle_details(answer.settle),
            **({"decided": rounds_details(answer.decision)} if answer.decision is not None else {})}
        for key in ("mean", "std", "ci_low", "ci_high", "trainable_parameters", "within_tolerance"):
            entry[key] = {}
        for row in answer.rows:
            low, high = row.setting.interval
            values = {"mean": round_metric(row.setting.mean), "std": round_metric(row.setting.std),
                      "ci_low": round_metric(low), "ci_high": round_metric(high),
                      "trainable_parameters": row.trainable_parameters, "within_tolerance": row.comparison.verdict}
            for key, value in values.items():
                entry[key][row.name] = value
    return details


# Per task and encoder, what `dvc exp show` compares.
HEADLINE = ("cheapest_by_trainable_parameters", "best_method", "best_score", "mean")


def headline(details: dict) -> dict:
    return {task: {encoder: {key: entry[key] for key in HEADLINE} for encoder, entry in encoders.items()}
            for task, encoders in details.items()}


def pareto_figure(chosen: list[MethodAnswer], cost: str):
    """Dev score against ``cost``, one panel per task and encoder, intervals as bars, the Pareto front (no other
    method both cheaper and better on average) drawn as a step line."""
    import matplotlib.pyplot as plt

    theme()
    figure, axes = plt.subplots(1, len(chosen), figsize=(5.6 * len(chosen), 4.2), squeeze=False)
    for axis, answer in zip(axes[0], chosen):
        rows = sorted(answer.rows, key=lambda row: (getattr(row, cost), -row.setting.mean))
        x = np.array([max(getattr(row, cost), 1e-3) for row in rows])
        y = np.array([100 * row.setting.mean for row in rows])
        low = y - np.array([100 * row.setting.interval[0] for row in rows])
        high = np.array([100 * row.setting.interval[1] for row in rows]) - y
        axis.errorbar(x, y, yerr=[low, high], fmt="o", capsize=3, color="tab:blue")
        front, top = [], -np.inf
        for xi, yi in zip(x, y):
            if yi > top:
                front.append((xi, yi))
                top = yi
        axis.step(*zip(*front), where="post", color="tab:orange", label="Pareto front")
        for xi, yi, row in zip(x, y, rows):
            axis.annotate(row.name, (xi, yi), textcoords="offset points", xytext=(4, 4), fontsize=8)
        axis.set(xscale="log" if cost == "trainable_parameters" else "linear",
                 xlabel=COSTS[cost] + (" (s)" if cost == "train_time_s" else ""),
                 ylabel=f"dev {answer.best.setting.metric} (points)", title=f"{display(answer.task)}, {answer.encoder}")
        axis.legend(fontsize=8)
    figure.suptitle(f"Dev score vs {COSTS[cost]} (bars: 95% interval over dev examples and seeds)")
    figure.tight_layout()
    return figure


def methods_report(results: StudyResults) -> Report:
    """``reports/<study>.md``: setup, the rule, per task and encoder a table of methods and the answer, figures."""
    if results.plan.spec.methods is None:
        raise ValueError(f"report kind 'methods' needs a study with methods (named tuning methods); "
                         f"{results.plan.name} has tunable_layers: use report kind 'layers'")
    options = results.options
    found = settings(results)
    chosen = answers(results, found)
    figures = {f"score_vs_{cost}": pareto_figure(chosen, cost) for cost in COSTS}
    gaps = references.gaps_to_probe(results, found)
    markdown = "\n".join([
        f"# Tuning methods: {results.plan.name}\n",
        setup_text(results),
        rule_text(options.tolerance, options.confidence),
        *([decided_rule(results)] if results.plan.spec.decide else []),
        task_sections(results, chosen),
        "## References and convergence\n",
        references.section(results, "method", found, gaps),
        "## Figures\n",
        *[f"![{name}]({results.plan.name}/figures/{name}.png)\n" for name in figures],
    ])
    details = report_details(chosen, options.tolerance)
    table = pd.DataFrame([{"task": a.task, "encoder": a.encoder, "method": r.name,
                           "trainable_parameters": r.trainable_parameters, "mean": r.setting.mean,
                           "ci_low": r.setting.interval[0], "ci_high": r.setting.interval[1],
                           "train_time_s": r.train_time_s, "peak_memory_mb": r.peak_memory_mb,
                           "within_tolerance": r.comparison.verdict} for a in chosen for r in a.rows])
    return Report(markdown, headline(details), details, {"methods": table, "cells": results.scores,
                                                         **references.tables(results, gaps)}, figures)
