"""The encoders report: does tuning several language models together beat the best one alone?

Per task and number of tunable layers, every encoder of the study (single models, and combinations of them) with
its score, and each one against the *reference*: the best single model (or, in a study without combinations, the
best encoder), by a two-sided paired test (`layertune.statistics`). "better" and "worse" are what the interval of the difference shows;
where it contains 0, the data cannot separate the two and the report says so. For dme combinations, the attention
each language model gets on a handful of dev examples, read from the saved models.
"""

from __future__ import annotations

from layertune.reports.common import (
    PAIRED_TEST,
    Report,
    Setting,
    StudyResults,
    display,
    literal,
    markdown_table,
    round_metric,
    score_text,
    settings,
    settings_table,
    setup_text,
    signed_points,
    theme,
)
from layertune.reports import references
from layertune.statistics import Comparison, SeedSpread, better_or_worse, difference_spread
from layertune.study import CombinedEncoder

VERDICTS = {"yes": "better", "no": "worse", "undecided": "no difference shown"}


def is_combined(results: StudyResults, encoder: str) -> bool:
    return len(results.plan.spec.members(encoder)) > 1


def combine_method(results: StudyResults, encoder: str) -> str | None:
    entry = results.plan.spec.encoders[encoder]
    return entry.combine.method if isinstance(entry, CombinedEncoder) else None


def compare(results: StudyResults, group: list[Setting]) -> tuple[Setting, dict[str, Comparison]]:
    """The reference (best single encoder, else best encoder) and every other encoder against it."""
    singles = [s for s in group if not is_combined(results, s.encoder)] or group
    reference = max(singles, key=lambda s: s.mean)
    others = [s for s in group if s is not reference]
    pooled = SeedSpread.pooled([s.estimate for s in group])
    return reference, {s.encoder: better_or_worse(s.estimate, reference.estimate, results.options.confidence,
                                                  difference_spread(s.estimate, reference.estimate, pooled))
                       for s in others}


def system_table(results: StudyResults, group: list[Setting], reference: Setting,
                 comparisons: dict[str, Comparison]) -> str:
    scores = results.scores.set_index("key")
    rows = []
    for setting in group:
        cells = [c.key for c in results.plan.cells if c.setting == (setting.task, setting.encoder,
                                                                      setting.tunable_layers)]
        comparison = comparisons.get(setting.encoder)
        versus = "reference" if comparison is None else (
            f"{signed_points(comparison.difference)} [{signed_points(comparison.low)}, "
            f"{signed_points(comparison.high)}]: {VERDICTS[comparison.verdict]}")
        models = " + ".join(literal(single.model.split("/")[-1])
                            for _, single in results.plan.spec.members(setting.encoder))
        rows.append([setting.encoder, models, score_text(setting), versus,
                     f"{int(scores.loc[cells[0], 'trainable_parameters']):,}",
                     f"{scores.loc[cells, 'train_time_s'].mean():.1f}"])
    return markdown_table(["encoder", "language models", f"{reference.metric} (points)",
                           f"vs {reference.encoder} (points)", "trainable parameters", "training time (s)"], rows,
                          "llrlrr")


def answer_text(reference: Setting, comparisons: dict[str, Comparison], results: StudyResults) -> str:
    combined = {name: c for name, c in comparisons.items() if is_combined(results, name)}
    if not combined:
        return ""
    verdicts = "; ".join(f"{name}: {VERDICTS[c.verdict]}" for name, c in combined.items())
    return f"Does tuning several language models together beat the best one ({reference.encoder})? {verdicts}.\n"


def attention_table(results: StudyResults, task: str, encoder: str, tunable_layers) -> str:
    """dme weights per example and language model for the first ``report.examples`` dev examples, from the
    saved model of the first seed's cell."""
    count = results.options.examples
    cell = next(c for c in results.plan.cells if c.setting == (task, encoder, tunable_layers))
    corpus = results.corpora[task]()
    dev = corpus.dev.select(range(min(count, len(corpus.dev))))
    texts = [row[0] if len(row) == 1 else tuple(row) for row in zip(*(dev[c] for c in corpus.text_columns))]
    predictions, weights = results.cells[cell.key].model().predict_with_attention(texts)
    names = [name for name, _ in results.plan.spec.members(encoder)]
    gold = [corpus.label_names[label] if corpus.label_names else f"{label:.2f}" for label in dev["label"]]
    rows = [[_short(text), literal(label), literal(prediction) if isinstance(prediction, str) else f"{prediction:.2f}",
             *[f"{w:.2f}" for w in row]] for text, label, prediction, row in zip(texts, gold, predictions, weights)]
    return (f"dme attention of `{encoder}` on the first {len(rows)} dev examples (seed {cell.seed}, "
            f"{tunable_layers} tunable layers; each row sums to 1):\n\n"
            + markdown_table(["example", "gold", "predicted", *names], rows, "lll" + "r" * len(names)))


def _short(text, width: int = 70) -> str:
    text = (" / ".join(text) if isinstance(text, tuple) else str(text)).strip()
    return literal(text if len(text) <= width else text[: width - 1] + "…")


def encoders_figure(table):
    import matplotlib.pyplot as plt

    theme()
    panels = list(table.groupby(["task", "tunable_layers"], sort=False))
    figure, axes = plt.subplots(1, len(panels), figsize=(1.5 + 1.2 * table["encoder"].nunique() * len(panels), 4),
                                squeeze=False)
    for axis, ((task, layers), part) in zip(axes[0], panels):
        axis.errorbar(range(len(part)), 100 * part["mean"], fmt="o", capsize=4,
                      yerr=[100 * (part["mean"] - part["ci_low"]), 100 * (part["ci_high"] - part["mean"])])
        axis.set(xticks=range(len(part)), title=f"{display(task)}, {layers} tunable layers",
                 ylabel=f"dev {part['metric'].iloc[0]} (points)")
        axis.set_xticklabels(part["encoder"], rotation=30, ha="right")
    figure.suptitle("Single vs combined encoders (bars: 95% interval over dev examples and seeds)")
    figure.tight_layout()
    return figure


def encoders_report(results: StudyResults) -> Report:
    """``reports/<study>.md``: per task and tunable layers, every encoder against the best single one."""
    found = settings(results)
    sections = [f"# Single vs combined encoders: {results.plan.name}\n", setup_text(results),
                f"Each encoder is compared with the reference (the best single language model) by a two-sided paired "
                f"test at {results.options.confidence:.0%} ({PAIRED_TEST}): *better* or *worse* where the interval "
                "of the difference excludes 0, *no difference shown* where the data cannot separate them.\n"]
    details: dict = {}
    groups: dict[tuple, list[Setting]] = {}
    for setting in found:
        groups.setdefault((setting.task, setting.tunable_layers), []).append(setting)
    for (task, layers), group in groups.items():
        reference, comparisons = compare(results, group)
        sections += [f"## {display(task)}, {layers} tunable layers\n",
                     system_table(results, group, reference, comparisons),
                     answer_text(reference, comparisons, results)]
        sections += [attention_table(results, task, s.encoder, layers) for s in group
                     if results.options.examples and combine_method(results, s.encoder) == "dme"]
        details.setdefault(task, {})[str(layers)] = {
            "reference": reference.encoder, "metric": reference.metric,
            "encoders": {s.encoder: {"mean": round_metric(s.mean), "std": round_metric(s.std),
                                     "ci_low": round_metric(s.interval[0]), "ci_high": round_metric(s.interval[1]),
                                     "seeds": len(s.scores)} for s in group},
            "versus_reference": {name: {"difference": round_metric(c.difference), "low": round_metric(c.low),
                                        "high": round_metric(c.high), "verdict": VERDICTS[c.verdict]}
                                 for name, c in comparisons.items()}}
    table = settings_table(found)
    gaps = references.gaps_to_probe(results, found)
    sections += ["## References and convergence\n", references.section(results, "encoder", found, gaps),
                 "## Figures\n", f"![encoders]({results.plan.name}/figures/encoders.png)\n"]
    return Report("\n".join(sections), headline(details), details, {"settings": table, "cells": results.scores,
                                                                     **references.tables(results, gaps)},
                  {"encoders": encoders_figure(table)})


def headline(details: dict) -> dict:
    """Per task and tunable layers, what `dvc exp show` compares: the reference, each encoder's mean score and each
    one's verdict against the reference (intervals and spreads stay in the details)."""
    return {task: {layers: {"reference": entry["reference"],
                            "mean": {name: scores["mean"] for name, scores in entry["encoders"].items()},
                            "verdict": {name: c["verdict"] for name, c in entry["versus_reference"].items()}}
                   for layers, entry in by_layers.items()}
            for task, by_layers in details.items()}

