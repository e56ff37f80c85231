"""What every report is built from: the study's results, per-setting statistics, score text, Markdown tables,
and figures.

A *setting* is a cell without its seed: (task, encoder, tunable layers). Its statistics are the mean and sample std
of its seeds' dev scores, and an interval over dev examples and seeds (`layertune.statistics`); the bootstrap draws
are shared by every setting of a task, so differences between settings are paired. Scores are shown in points
(×100), as published tables do; metrics files keep metric units, rounded, so equal results give equal bytes.
"""

from __future__ import annotations

import html
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from layertune.statistics import (
    SETTLE_MAX_EXAMPLES,
    SETTLE_MAX_SEEDS,
    Estimate,
    Resamples,
    SeedSpread,
    Settlement,
    difference_spread,
    interval,
    paired_difference,
    what_would_settle,
)
from layertune.study import CombinedEncoder, StudyPlan, layers_order

if TYPE_CHECKING:
    from layertune.cell import CellFolder
    from layertune.corpus import Corpus

DISPLAY_NAMES = {"cola": "CoLA", "sst2": "SST-2", "mrpc": "MRPC", "rte": "RTE", "stsb": "STS-B", "imdb": "IMDb",
                 "conll2003": "CoNLL-2003"}
DIGITS = 4  # metrics-file rounding: far below seed-to-seed spread, above float noise
PRECISIONS = {"no": "float32", "bf16": "bfloat16 (autocast)", "fp16": "float16 (autocast)"}
# A within-tolerance question's verdict on a setting, as the layer and methods tables show it.
WITHIN_TOLERANCE = {"yes": "yes", "no": "no, worse", "undecided": "undecided"}


@dataclass
class StudyResults:
    """Everything a report may read: the plan, evaluate's score table (one row per cell), each cell's saved folder
    by key, and the prepared corpora by task (loaded when called)."""

    plan: StudyPlan
    scores: pd.DataFrame
    cells: Mapping[str, CellFolder]
    corpora: Mapping[str, Callable[[], Corpus]]
    # task -> the evaluation examples a decided study added (`layertune.reports.decided`): their references, and
    # each scored cell's predictions by key
    evaluation: Mapping[str, dict] = field(default_factory=dict)
    # task -> the references beside the cells (`layertune.probes.study_references`): no-model baseline, linear probes
    references: Mapping[str, dict] = field(default_factory=dict)

    @property
    def options(self):
        return self.plan.spec.report


@dataclass
class Report:
    """``<study>.md``; ``<study>.json``, the headline numbers that `dvc metrics` and `dvc exp show` compare (per
    task: the answer, the best score, the mean score of each setting); ``<study>/details.json``, every number of
    the report (spreads, intervals, tests); ``<study>/<table>.csv`` and ``<study>/figures/<name>.png``."""

    markdown: str
    metrics: dict
    details: dict
    tables: dict[str, pd.DataFrame] = field(default_factory=dict)
    figures: dict[str, Any] = field(default_factory=dict)


@dataclass
class Setting:
    """One (task, encoder, tunable layers): its seeds' dev scores and their resamples (`layertune.statistics`)."""

    task: str
    encoder: str
    tunable_layers: int | str
    metric: str
    estimate: Estimate = field(repr=False)
    confidence: float = 0.95
    spread: SeedSpread | None = None  # seed spread pooled over the task's settings (default: this one's seeds)

    @property
    def scores(self) -> list[float]:
        return self.estimate.scores.tolist()

    @property
    def mean(self) -> float:
        return self.estimate.mean

    @property
    def std(self) -> float:
        return float(np.std(self.estimate.scores, ddof=1)) if self.estimate.seeds > 1 else math.nan

    @property
    def interval(self) -> tuple[float, float]:
        return interval(self.estimate, self.confidence, self.spread)


# How every comparison of a report is tested (layertune.statistics), in the words the reports use.
PAIRED_TEST = ("same dev examples and seeds: a bootstrap over dev examples, and Student t over the seeds with the "
               "spread of the two settings' own seed-by-seed differences, shrunk toward the spread pooled over the "
               "settings by one degree of freedom")


def settings(results: StudyResults, split: str = "dev") -> list[Setting]:
    """Every setting of the study, in grid order; the settings of a task share their dev resamples (paired)."""
    from layertune.metrics import metric_for

    plan, options = results.plan, results.options
    found = []
    for task in plan.spec.tasks:
        cells = [cell for cell in plan.cells if cell.task == task]
        groups = {cell.setting: [c for c in cells if c.setting == cell.setting] for cell in cells}
        corpus = results.corpora[task]()
        references = results.cells[cells[0].key].predictions()[split]["references"]
        draws = Resamples.draw(len(references), options.resamples)
        metrics = metric_for(corpus.main_metric, corpus.metrics)
        scores = results.scores.set_index("key")[f"{split}_{corpus.main_metric}"]
        for (_, encoder, layers), group in groups.items():
            predictions = [results.cells[cell.key].predictions()[split] for cell in group]
            if any(p["references"] != references for p in predictions):
                raise ValueError(f"{task}: the cells of {plan.name} were scored on different {split} examples")
            estimate = draws.estimate(metrics, corpus.main_metric, [p["predictions"] for p in predictions], references,
                                      [float(scores[cell.key]) for cell in group])
            found.append(Setting(task, encoder, layers, corpus.main_metric, estimate, options.confidence))
        spread = SeedSpread.pooled([s.estimate for s in found if s.task == task])
        for setting in (s for s in found if s.task == task):
            setting.spread = spread
    return found


def settings_table(found: list[Setting]) -> pd.DataFrame:
    """One row per setting: mean, std, interval and seed count, in metric units."""
    return pd.DataFrame([{"task": s.task, "encoder": s.encoder, "tunable_layers": str(s.tunable_layers),
                          "metric": s.metric, "seeds": len(s.scores), "mean": s.mean, "std": s.std,
                          "ci_low": s.interval[0], "ci_high": s.interval[1]} for s in found])


# ------------------------------------------------------------------------------------------------------- text


def _per_k_text(overrides: Mapping, layer_values: list, where: str) -> str:
    """The training overrides of each K on the grid, as the setup line lists them ("; on SST-2 with 2 tunable
    layers: learning_rate 5e-05")."""
    return "".join(f"; {where}with {k} tunable layers: " + ", ".join(f"{a} {v}" for a, v in o.items())
                   for k, o in overrides.items() if k in layer_values)


def display(task: str) -> str:
    return DISPLAY_NAMES.get(task, task)


# Markdown's inline markup (emphasis, code, links and images, strikethrough), its escape and a table's cell border.
_MARKDOWN = str.maketrans({c: f"\\{c}" for c in "\\`*_[]|~"})


def literal(value: object, code: bool = False) -> str:
    """``value`` (a label, a model or file name, a dev sentence: anything from the user or the data) as literal text
    in a report's Markdown and in the HTML rendered from it: HTML's special characters as entities, Markdown's
    markup characters escaped, line breaks as spaces, so that ``<img src=x onerror=alert(1)>`` is shown, never run.
    ``code``: as a code span where nothing needed escaping (a code span shows escapes as typed). Names of tasks,
    encoders and methods need none of this (their pattern admits no such character)."""
    text = " ".join(str(value).splitlines())
    escaped = html.escape(text, quote=False).translate(_MARKDOWN)
    return f"`{text}`" if code and escaped == text else escaped


def points(value: float) -> str:
    return "–" if value is None or math.isnan(value) else f"{100 * value:.1f}"


def signed_points(value: float) -> str:
    return f"{100 * value:+.1f}"


def score_text(setting: Setting) -> str:
    """``76.2 ± 1.2 [74.0, 78.1]``: mean ± std over seeds, and the interval over dev examples and seeds (points)."""
    low, high = setting.interval
    spread = "" if math.isnan(setting.std) else f" ± {points(setting.std)}"
    return f"{points(setting.mean)}{spread} [{points(low)}, {points(high)}]"


def markdown_table(header: list[str], rows: list[list[Any]], align: str | None = None) -> str:
    """A GitHub Markdown table; ``align`` is one character per column, ``l`` or ``r`` (default: first left)."""
    align = align or "l" + "r" * (len(header) - 1)
    rules = ["---" if a == "l" else "---:" for a in align]
    lines = [header, rules, *[[str(value) for value in row] for row in rows]]
    return "\n".join("| " + " | ".join(line) + " |" for line in lines) + "\n"


def round_metric(value: float) -> float | None:
    return None if value is None or math.isnan(value) else round(float(value), DIGITS)


def layers_value(value: Any) -> int | str:
    return "all" if str(value) == "all" else int(value)


def in_layers_order(table: pd.DataFrame) -> pd.DataFrame:
    """Rows sorted by tunable layers (0, 1, … all), keeping the order of everything else."""
    order = {str(k): i for i, k in enumerate(layers_order(table["tunable_layers"].map(layers_value)))}
    return table.iloc[table["tunable_layers"].astype(str).map(order).argsort(kind="stable")].reset_index(drop=True)


def setup_text(results: StudyResults) -> str:
    """What was trained: data, encoders, training, and how uncertainty is shown."""
    spec, options = results.plan.spec, results.options
    data = spec.data
    sizes = (f"{data.train_size:,} training examples" if data.train_size else "all training examples") + (
        f", {data.validation_size:,} more carved from the training data as the validation slice that picks each "
        "cell's best epoch and stops it" if data.validation_size else "") + ", " + (
        f"{data.dev_size:,} dev examples" if data.dev_size else "the full dev set") + f" (subsample seed {data.seed})"
    encoders = "; ".join(f"`{name}`: " + " + ".join(literal(single.model) for _, single in spec.members(name))
                         + (f" ({entry.combine.method})" if isinstance(entry, CombinedEncoder) else "")
                         for name, entry in spec.encoders.items())
    training = spec.training
    pooling = spec.encoder.pooling or "each model's own (else [CLS])"
    selects_on = "validation" if data.validation_size else "dev"
    if training.early_stopping_patience:
        epochs = (f"at most {training.epochs} epochs, stopped once the validation "
                  f"{training.metric_for_best_model or 'score'} has not improved for "
                  f"{training.early_stopping_patience} epoch(s) in a row")
    else:
        epochs = f"{training.epochs} epoch(s)"
    kept = (f"the epoch with the best {selects_on} score is kept" if training.selects_best
            else "the model after the last epoch is kept")
    precision = sorted(set(results.scores["mixed_precision"])) if "mixed_precision" in results.scores else ["no"]
    computed = " and ".join(PRECISIONS.get(p, p) for p in precision)
    return (
        "## Setup\n\n"
        f"- Data: {sizes}.\n" + "".join(dataset_lines(results)) +
        f"- Encoders: {encoders}; pooling {pooling}; a {spec.head.head} head.\n"
        f"- Training: {epochs}, batch {training.batch_size}, learning rate "
        f"{training.learning_rate:g} (head {training.head_rate:g})"
        + _per_k_text(spec.per_tunable_layers, spec.layer_values, "")
        + "".join(_per_k_text(per_k, spec.layer_values, f"on {display(task)} ")
                  for task, per_k in spec.per_task.items())
        + f"; {kept}; computed in {computed}; seeds {', '.join(map(str, spec.seeds))}.\n"
        f"- Scores in points (×100): mean ± std over seeds, and in brackets a {options.confidence:.0%} interval that "
        f"covers both the choice of dev examples (bootstrap, {options.resamples:,} resamples, shared by all settings "
        "of a task so that comparisons are paired) and of seeds (Student t, with the seed-to-seed spread pooled over "
        "the settings of a task), added in quadrature."
        + (" With one seed, seed-to-seed variation is not measured: the intervals cover dev examples only."
           if len(spec.seeds) == 1 else "")
        + (" Dev is scored once, after training, by weights it did not choose." if selects_on == "validation"
           else " Dev also picks the best epoch, so scores are slightly optimistic." if training.selects_best
           else " Dev is scored after the epochs, and the last epoch's weights are kept.") + "\n"
    )


def dataset_lines(results: StudyResults) -> list[str]:
    """For each task that is not a built-in one: where its data came from (a hub dataset with its commit), and
    what loading it found or decided (task type inferred or given, classes, metric, a carved dev split)."""
    lines = []
    for task, dataset in results.plan.spec.tasks.items():
        if dataset.task is not None:
            continue
        corpus = results.corpora[task]()
        where = f"Hugging Face dataset {literal(dataset.hub)}" + (
            f" ({literal(dataset.config)})" if dataset.config else "") + f" at commit {literal(dataset.revision)}" \
            if dataset.hub else f"local files {literal(dataset.path)}"
        found = [literal(note) for note in corpus.notes if not note.startswith(("Loaded from", "Read from"))]
        metric = f"Scored by {corpus.main_metric}" + ("" if dataset.metric else " (the task type's default)") + "."
        lines.append(f"- `{task}`: {where}. " + " ".join([*found, metric]) + "\n")
    return lines


# ------------------------------------------------------------------------------------------- what would settle it


def settle_undecided(comparisons: Mapping[str, tuple[Setting, str]], best: Setting, tolerance: float,
                     confidence: float, pooled: SeedSpread | None,
                     levels: tuple[float, float] | None = None) -> dict[str, Settlement]:
    """For each undecided comparison of a question the data cannot answer (``{name: (setting, verdict)}``), what
    would decide it (`layertune.statistics.what_would_settle`), its seed part as the test's: the pair's own spread
    shrunk toward ``pooled`` (the settings', `layertune.statistics.difference_spread`), to which each new seed adds
    a degree of freedom. ``levels``: in a study decided in rounds, the one-sided errors of the rule's next look for a
    claim within tolerance and one of worse (`Decision.next_levels`), in place of the fixed test's ``confidence``:
    a comparison the fixed test already decides is undecided there only at the rounds' stricter level."""
    # The best is undecided only under the rounds' rule (the fixed test counts it good enough): no comparison to settle.
    undecided = {name: setting for name, (setting, verdict) in comparisons.items()
                 if verdict == "undecided" and setting is not best}

    def level_of(setting: Setting) -> float:
        if levels is None:
            return confidence
        within = paired_difference(setting.estimate, best.estimate).mean > -tolerance  # the claim it would reach
        return 1 - levels[0 if within else 1]

    return {name: what_would_settle(setting.estimate, best.estimate, tolerance, level_of(setting),
                                    difference_spread(setting.estimate, best.estimate, pooled))
            for name, setting in undecided.items()}


def settle_section(settlements: Mapping[str, Settlement], setting_header: str, tolerance: float,
                   levels: tuple[float, float] | None = None) -> str:
    """A table per undecided question: each comparison's gap to the tolerance, its half-width's two parts, and the
    seeds or paired dev examples that would decide it; then where seeds will not help. ``levels``: the rounds' next
    look's, where they were used (`settle_undecided`)."""
    test = ("the same test" if levels is None else
            f"the rounds' test at their next look, against the best, at one-sided error {levels[0]:.2%} for within "
            f"tolerance and {levels[1]:.2%} for worse,")
    rows = [[name, WITHIN_TOLERANCE[s.decides], points(s.gap),
             f"{points(s.dev)} / {points(s.seed)}", _seeds_text(s), _examples_text(s),
             f"{s.together[0]} seeds, {s.together[1]:,} examples" if s.together else "–"]
            for name, s in settlements.items()]
    hopeless = [name for name, s in settlements.items() if s.seeds_cannot_decide]
    return (f"What would settle it, if the observed differences hold ({test} and {100 * tolerance:g}-point "
            "tolerance; seeds: for the best and each setting in doubt, on the same dev examples; examples: a larger "
            "paired dev set on which every setting is scored, with the same seeds):\n\n"
            + markdown_table([setting_header, "would be within tolerance?", "gap (points)",
                              "half-width: dev examples / seeds (points)", "seeds per setting", "dev examples",
                              "both"], rows, "llrrrrr")
            + ("\n" + f"More seeds will not help for {', '.join(hopeless)}: the dev examples alone leave it wider than "
               "the gap, however many seeds run.\n" if hopeless else ""))


def _seeds_text(settlement: Settlement) -> str:
    if settlement.gap == 0:
        return "none: the difference is the tolerance"
    if not settlement.seed_spread_measured:
        return "one seed: spread not measured"
    if settlement.seeds is not None:
        return f"{settlement.seeds} ({settlement.seeds - settlement.seeds_now} more)"
    return "will not help" if settlement.seeds_cannot_decide else f"more than {SETTLE_MAX_SEEDS}"


def _examples_text(settlement: Settlement) -> str:
    if settlement.examples is not None:
        return f"{settlement.examples:,} (now {settlement.examples_now:,})"
    if settlement.examples_now is None or settlement.gap == 0:
        return "–"
    return "will not help" if settlement.seed >= settlement.gap else f"more than {SETTLE_MAX_EXAMPLES} times today's"


def settle_details(settlements: Mapping[str, Settlement]) -> dict:
    """``{name: {decides, gap, dev_half_width, seed_half_width, dev_floor, seeds_now, seeds_needed, examples_now,
    examples_needed, together, seeds_will_not_help}}`` in metric units."""
    return {name: {"decides": s.decides, "gap": round_metric(s.gap), "dev_half_width": round_metric(s.dev),
                   "seed_half_width": round_metric(s.seed), "dev_floor": round_metric(s.dev_floor),
                   "seeds_now": s.seeds_now, "seeds_needed": s.seeds, "examples_now": s.examples_now,
                   "examples_needed": s.examples, "together": list(s.together) if s.together else None,
                   "seeds_will_not_help": s.seeds_cannot_decide} for name, s in settlements.items()}


# ---------------------------------------------------------------------------------------------------- figures


def theme() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import seaborn as sns

    sns.set_theme(style="whitegrid", context="notebook")


def quality_figure(table: pd.DataFrame, title: str):
    """Dev score against tunable layers, one panel per task, one line per encoder, intervals over dev examples and seeds as bars."""
    import matplotlib.pyplot as plt

    theme()
    tasks = list(dict.fromkeys(table["task"]))
    figure, axes = plt.subplots(1, len(tasks), figsize=(5.2 * len(tasks), 4), squeeze=False)
    for axis, task in zip(axes[0], tasks):
        part = table[table["task"] == task]
        order = [str(k) for k in layers_order(part["tunable_layers"].map(layers_value))]
        for offset, (encoder, rows) in enumerate(part.groupby("encoder", sort=False)):
            rows = rows.set_index("tunable_layers").loc[[k for k in order if k in set(rows["tunable_layers"])]]
            # Side by side, centred on the tick, so that intervals of several encoders do not hide each other.
            x = np.array([order.index(k) for k in rows.index]) + 0.08 * (offset - (part["encoder"].nunique() - 1) / 2)
            axis.errorbar(x, 100 * rows["mean"], yerr=[100 * (rows["mean"] - rows["ci_low"]),
                                                        100 * (rows["ci_high"] - rows["mean"])],
                          marker="o", capsize=3, label=encoder)
        axis.set(xticks=range(len(order)), xticklabels=order, xlabel="tunable top layers",
                 ylabel=f"dev {part['metric'].iloc[0]} (points)", title=display(task))
        axis.legend(fontsize=8)
    figure.suptitle(title)
    figure.tight_layout()
    return figure


def time_figure(scores: pd.DataFrame):
    """Training time per cell against tunable layers (mean over seeds, one line per task and encoder)."""
    import seaborn as sns

    theme()
    data = in_layers_order(scores.assign(series=scores["task"].map(display) + " / " + scores["encoder"]))
    grid = sns.catplot(data, kind="point", x="tunable_layers", y="train_time_s", hue="series", errorbar="sd",
                       height=4, aspect=1.5)
    grid.set_axis_labels("tunable top layers", "training time (s)")
    grid.figure.suptitle("Training time vs tunable layers (mean ± sd over seeds)", y=1.03)
    return grid.figure


def learning_curves_figure(results: StudyResults, task: str, encoder: str):
    """Train loss, and the loss and score of the split that picked the epoch (the validation slice, else dev), per
    epoch: a panel per tunable-layers value, a line per seed."""
    import seaborn as sns

    theme()
    rows = []
    for cell in results.plan.cells:
        if (cell.task, cell.encoder) != (task, encoder):
            continue
        metric = results.scores.set_index("key").loc[cell.key, "metric"]
        for record in results.cells[cell.key].history():
            for series, panel in (("train_loss", "loss"), ("validation_loss", "loss"), ("eval_loss", "loss"),
                                  (f"validation_{metric}", metric), (f"eval_{metric}", metric)):
                if series not in record:  # scored after the last epoch only (eval_strategy "end"), or not this split
                    continue
                rows.append({"tunable_layers": str(cell.tunable_layers), "seed": str(cell.seed),
                             "epoch": record["epoch"], "series": series, "panel": panel, "value": record[series]})
    curves = pd.DataFrame(rows)
    order = [str(k) for k in layers_order(curves["tunable_layers"].map(layers_value))]
    grid = sns.relplot(curves, kind="line", x="epoch", y="value", hue="series", style="seed", col="tunable_layers",
                       row="panel", col_order=order, facet_kws={"sharey": "row"}, height=2.6, aspect=1.0, marker="o")
    grid.set_titles("{row_name} | layers {col_name}")
    grid.figure.suptitle(f"Learning curves: {display(task)}, {encoder}", y=1.02)
    return grid.figure


def drift_figure(results: StudyResults):
    """Relative L2 change of each encoder part from its pretrained weights (mean over seeds), per task and encoder
    of single language models: rows are parts, columns tunable layers."""
    import matplotlib.pyplot as plt
    import seaborn as sns

    from layertune.drift import layer_drift

    theme()
    rows = []
    for cell in results.plan.cells:
        if len(cell.spec.encoders) == 1:
            parts = layer_drift(results.cells[cell.key].drift())
            rows += [{"task": cell.task, "encoder": cell.encoder, "tunable_layers": str(cell.tunable_layers),
                      "part": row.part, "relative_l2": row.relative_l2} for row in parts.itertuples()
                     if row.part != "head"]  # the head starts random in every cell: its change says nothing
    if not rows:
        return None
    long = pd.DataFrame(rows).groupby(["task", "encoder", "part", "tunable_layers"], sort=False)["relative_l2"].mean()
    panels = list(long.reset_index().groupby(["task", "encoder"], sort=False))
    figure, axes = plt.subplots(1, len(panels), figsize=(1.0 + 3.4 * len(panels), 4.4), squeeze=False)
    for axis, ((task, encoder), part) in zip(axes[0], panels):
        matrix = 100 * part.pivot(index="part", columns="tunable_layers", values="relative_l2")
        order = [str(k) for k in layers_order(part["tunable_layers"].map(layers_value))]
        matrix = matrix.reindex(index=sorted(matrix.index, key=_part_order), columns=order)
        sns.heatmap(matrix, ax=axis, cmap="viridis", annot=True, fmt=".1f", annot_kws={"size": 7},
                    cbar_kws={"label": "relative L2 change (%)"})
        axis.set(title=f"{display(task)} ({encoder})", xlabel="tunable top layers", ylabel="")
    figure.suptitle("Drift of the encoder from its pretrained weights (mean over seeds)")
    figure.tight_layout()
    return figure


def _part_order(part: str) -> tuple:
    if part == "embeddings":
        return (0, 0)
    if part.startswith("layer."):
        return (1, int(part.split(".")[1]))
    return (2, {"pooler": 0}.get(part, 1))
