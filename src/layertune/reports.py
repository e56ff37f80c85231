"""Reports of a layer-ablation study: the ablation table, the recommended number of layers, figures, plot data and
the metrics file that ``dvc metrics show`` reads.

Everything starts from a results table, one row per cell (task, model, tunable_layers, seed) with its dev ``score``
(the task's main metric). Scores are shown in points (×100) as in the published tables; ``metrics.json`` keeps
metric units, rounded, with sorted keys and no timings, so equal results give byte-identical files.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import pandas as pd

from layertune.study import layers_order

DISPLAY_NAMES = {"cola": "CoLA", "sst2": "SST-2", "mrpc": "MRPC", "rte": "RTE", "stsb": "STS-B", "imdb": "IMDb"}
CELL_KEYS = ["model", "task", "tunable_layers", "seed"]
DIGITS = 4  # metrics.json rounding: far below seed-to-seed spread, above float noise


def results_table(evaluations: Iterable[Mapping[str, Any]], trainings: Iterable[Mapping[str, Any]]) -> pd.DataFrame:
    """One row per cell: its dev ``score`` and ``metric`` from evaluation, time and size figures from training."""
    scored = pd.DataFrame(list(evaluations))
    trained = pd.DataFrame(list(trainings))
    if scored.empty:
        raise ValueError("No evaluated cells: run the train and evaluate stages first.")
    for table in (scored, trained):
        if not table.empty:
            table["tunable_layers"] = table["tunable_layers"].astype(str)
    keep = [c for c in ("best_epoch", "train_time_s", "samples_per_s", "trainable_parameters",
                        "total_parameters", "peak_memory_mb") if c in trained.columns]
    if not trained.empty:
        scored = scored.merge(trained[CELL_KEYS + keep], on=CELL_KEYS, how="left")
    return _ordered(scored)


def select_cells(results: pd.DataFrame, cells: Iterable[Any]) -> pd.DataFrame:
    """The rows of ``cells`` (a study's grid); a cell without results is an error naming it."""
    wanted = pd.DataFrame([{k: str(getattr(c, k)) if k == "tunable_layers" else getattr(c, k) for k in CELL_KEYS}
                           for c in cells])
    chosen = wanted.merge(results, on=CELL_KEYS, how="left", indicator=True)
    missing = chosen[chosen["_merge"] == "left_only"]
    if len(missing):
        names = ", ".join(f"{r.task}/{r.model}/layers-{r.tunable_layers}/seed-{r.seed}" for r in missing.itertuples())
        raise ValueError(f"{len(missing)} cell(s) of the study have no results: {names}")
    return _ordered(chosen.drop(columns="_merge"))


def summarize(results: pd.DataFrame) -> pd.DataFrame:
    """Mean, sample std and count of the score over seeds, per (model, task, tunable_layers)."""
    groups = results.groupby(["model", "task", "tunable_layers"], sort=False)
    summary = groups.agg(metric=("metric", "first"), mean=("score", "mean"), std=("score", "std"),
                         seeds=("seed", "count")).reset_index()
    return _ordered(summary)


def recommend(summary: pd.DataFrame, tolerance: float) -> pd.DataFrame:
    """Per (model, task): the best setting, and the recommended one, the fewest tunable layers whose mean score is
    within ``tolerance`` (metric units) of the best mean ('all' counts as more than any number)."""
    rows = []
    for (model, task), group in summary.groupby(["model", "task"], sort=False):
        group = _ordered(group)
        best = group.loc[group["mean"].idxmax()]
        good_enough = group[group["mean"] >= best["mean"] - tolerance - 1e-12]
        chosen = good_enough.iloc[0]
        rows.append({"model": model, "task": task, "metric": best["metric"],
                     "best_layers": best["tunable_layers"], "best_score": best["mean"],
                     "recommended_layers": chosen["tunable_layers"], "recommended_score": chosen["mean"],
                     "tolerance": tolerance})
    return pd.DataFrame(rows)


# ------------------------------------------------------------------------------------------------------ tables


def ablation_table(summary: pd.DataFrame) -> pd.DataFrame:
    """Rows = tunable layers (0 … all), per model; two columns per task, its mean and std in points."""
    table = summary.assign(mean=100 * summary["mean"], std=100 * summary["std"])
    wide = table.pivot_table(index=["model", "tunable_layers"], columns="task", values=["mean", "std"],
                             sort=False, dropna=False)
    tasks = list(dict.fromkeys(summary["task"]))
    columns = {}
    for task in tasks:
        metric = summary.loc[summary["task"] == task, "metric"].iloc[0]
        columns[f"{task} {metric}"] = wide[("mean", task)].round(2)
        columns[f"{task} {metric} std"] = wide[("std", task)].round(2)
    out = pd.DataFrame(columns).reset_index()
    return _ordered(out, by=["model", "tunable_layers"])


def ablation_markdown(summary: pd.DataFrame, recommendations: pd.DataFrame, study: str, seeds: list[int],
                      layer_counts: Mapping[str, int] | None = None) -> str:
    """The ablation table as Markdown: mean ± std over seeds in points, the best of each column in bold, then the
    recommended number of layers per task."""
    tolerance = float(recommendations["tolerance"].iloc[0]) if len(recommendations) else 0.0
    lines = [f"# Layer ablation: {study}", "",
             f"Dev-set score in points (×100) by the number of tunable top layers ('all' also trains the "
             f"embeddings); mean ± std over {len(seeds)} seed(s) ({', '.join(map(str, seeds))}); the best of each "
             f"column in **bold**.", ""]
    for model, part in summary.groupby("model", sort=False):
        tasks = list(dict.fromkeys(part["task"]))
        layers = f" ({layer_counts[model]} layers)" if layer_counts and model in layer_counts else ""
        lines += [f"## {model}{layers}", ""]
        header = ["tunable layers"] + [f"{DISPLAY_NAMES.get(t, t)} ({_metric(part, t)})" for t in tasks]
        lines += ["| " + " | ".join(header) + " |", "|" + "---:|" * len(header)]
        shown = {t: {row.tunable_layers: _mean_std(row.mean, row.std) for row in part[part.task == t].itertuples()}
                 for t in tasks}
        best = {t: max(float(v.split(" ")[0]) for v in shown[t].values()) for t in tasks}
        for k in layers_order(part["tunable_layers"].map(_layers_value)):
            cells = []
            for t in tasks:
                text = shown[t].get(str(k), "–")
                cells.append(f"**{text}**" if text != "–" and float(text.split(" ")[0]) == best[t] else text)
            lines.append(f"| {k} | " + " | ".join(cells) + " |")
        lines.append("")
        chosen = recommendations[recommendations["model"] == model]
        lines += [f"Recommended number of tunable layers: the fewest whose mean score is within {100 * tolerance:g} "
                  f"point(s) of the best.", "",
                  "| task | metric | best setting | best score | recommended | its score |",
                  "|---|---|---:|---:|---:|---:|"]
        for row in chosen.itertuples():
            lines.append(f"| {DISPLAY_NAMES.get(row.task, row.task)} | {row.metric} | {row.best_layers} | "
                         f"{100 * row.best_score:.1f} | **{row.recommended_layers}** | "
                         f"{100 * row.recommended_score:.1f} |")
        lines.append("")
    return "\n".join(lines)


def report_metrics(summary: pd.DataFrame, recommendations: pd.DataFrame) -> dict:
    """``{model: {task: {metric, mean: {layers: score}, std: {...}, best_layers, recommended_layers, …}}}`` in
    metric units, rounded to a few digits: deterministic for `dvc metrics show` and byte-identical rebuilds."""
    report: dict = {}
    for row in summary.itertuples():
        entry = report.setdefault(row.model, {}).setdefault(row.task, {"metric": row.metric, "mean": {}, "std": {}})
        entry["mean"][row.tunable_layers] = _round(row.mean)
        entry["std"][row.tunable_layers] = _round(row.std)
        entry["seeds"] = int(row.seeds)
    for row in recommendations.itertuples():
        entry = report[row.model][row.task]
        entry.update(best_layers=_layers_value(row.best_layers), best_score=_round(row.best_score),
                     recommended_layers=_layers_value(row.recommended_layers),
                     recommended_score=_round(row.recommended_score), tolerance=row.tolerance)
    return report


def timing_table(results: pd.DataFrame) -> pd.DataFrame:
    """Training time and throughput per cell (not deterministic, so kept out of metrics.json)."""
    columns = [c for c in ("train_time_s", "samples_per_s", "trainable_parameters", "best_epoch")
               if c in results.columns]
    return results[CELL_KEYS + columns].round(3)


def plot_data(summary: pd.DataFrame, results: pd.DataFrame) -> dict[str, pd.DataFrame]:
    """Files for ``dvc plots show``: per task, score (points) and training time by tunable layers."""
    data = {}
    for (model, task), part in summary.groupby(["model", "task"], sort=False):
        key = task if summary["model"].nunique() == 1 else f"{model}/{task}"
        data[f"quality/{key}"] = pd.DataFrame({"tunable_layers": part["tunable_layers"],
                                               "score": (100 * part["mean"]).round(2),
                                               "std": (100 * part["std"]).round(2)})
        if "train_time_s" in results.columns:
            times = results[(results.model == model) & (results.task == task)]
            times = times.groupby("tunable_layers", sort=False)["train_time_s"].mean().round(2).reset_index()
            data[f"time/{key}"] = times
    return data


# ----------------------------------------------------------------------------------------------------- figures


def figures(results: pd.DataFrame, histories: Mapping[tuple, list[dict]], drift: Mapping[tuple, pd.DataFrame]
            ) -> dict[str, Any]:
    """PNG-ready matplotlib figures: quality and training time vs tunable layers, learning curves per task
    (one panel per cell setting, a line per seed), and a parameter-drift heatmap (part × tunable layers).

    ``histories`` and ``drift`` are keyed by cell ``(model, task, tunable_layers, seed)``."""
    import matplotlib

    matplotlib.use("Agg")
    import seaborn as sns

    sns.set_theme(style="whitegrid", context="notebook")
    order = [str(k) for k in layers_order(results["tunable_layers"].map(_layers_value))]
    scores = results.assign(score=100 * results["score"], task=results["task"].map(lambda t: DISPLAY_NAMES.get(t, t)))
    many_models = results["model"].nunique() > 1
    dodge = 0.2 if results["task"].nunique() > 1 else False  # seaborn divides by (number of hues - 1)
    out = {}

    grid = sns.catplot(scores, kind="point", x="tunable_layers", y="score", hue="task", order=order,
                       col="model" if many_models else None, errorbar="sd", dodge=dodge, height=4, aspect=1.5)
    grid.set_axis_labels("tunable top layers", "dev score (points)")
    grid.figure.suptitle("Quality vs tunable layers (mean ± sd over seeds)", y=1.03)
    out["quality_vs_layers"] = grid.figure

    if "train_time_s" in results.columns:
        grid = sns.catplot(scores, kind="point", x="tunable_layers", y="train_time_s", hue="task", order=order,
                           col="model" if many_models else None, errorbar="sd", dodge=dodge, height=4, aspect=1.5)
        grid.set_axis_labels("tunable top layers", "training time (s)")
        grid.figure.suptitle("Training time vs tunable layers", y=1.03)
        out["training_time_vs_layers"] = grid.figure

    for (model, task), part in results.groupby(["model", "task"], sort=False):
        curves = _curves(part, histories)
        if curves.empty:
            continue
        grid = sns.relplot(curves, kind="line", x="epoch", y="value", hue="series", style="seed", col="tunable_layers",
                           row="panel", col_order=[k for k in order if k in set(curves["tunable_layers"])],
                           facet_kws={"sharey": "row"}, height=2.6, aspect=1.0, marker="o")
        grid.set_titles("{row_name} | layers {col_name}")
        grid.figure.suptitle(f"Learning curves: {DISPLAY_NAMES.get(task, task)}, {model}", y=1.02)
        out[f"curves/{model}/{task}"] = grid.figure

    heat = drift_matrix(drift)
    if not heat.empty:
        out["drift_heatmap"] = _drift_figure(heat, order)
    return out


def drift_matrix(drift: Mapping[tuple, pd.DataFrame]) -> pd.DataFrame:
    """Relative L2 change per encoder part (embeddings, layer.i, pooler), mean over seeds, long form."""
    from layertune.drift import layer_drift

    rows = []
    for (model, task, layers, seed), table in drift.items():
        per_part = layer_drift(table)
        rows += [{"model": model, "task": task, "tunable_layers": str(layers), "seed": seed, "part": r.part,
                  "relative_l2": r.relative_l2} for r in per_part.itertuples()]
    if not rows:
        return pd.DataFrame()
    long = pd.DataFrame(rows)
    long = long[long["part"] != "head"]  # trained from scratch in every cell: its change says nothing about layers
    return long.groupby(["model", "task", "part", "tunable_layers"], sort=False)["relative_l2"].mean().reset_index()


def _drift_figure(heat: pd.DataFrame, order: list[str]):
    import matplotlib.pyplot as plt
    import seaborn as sns

    panels = list(heat.groupby(["model", "task"], sort=False))
    figure, axes = plt.subplots(1, len(panels), figsize=(1.0 + 3.2 * len(panels), 4.2), squeeze=False)
    for ax, ((model, task), part) in zip(axes[0], panels):
        matrix = 100 * part.pivot(index="part", columns="tunable_layers", values="relative_l2")
        matrix = matrix.reindex(index=sorted(matrix.index, key=_part_order),
                                columns=[k for k in order if k in matrix.columns])
        sns.heatmap(matrix, ax=ax, cmap="viridis", annot=True, fmt=".1f", annot_kws={"size": 7},
                    cbar_kws={"label": "relative L2 change (%)"})
        ax.set_title(f"{DISPLAY_NAMES.get(task, task)} ({model.split('/')[-1]})")
        ax.set_xlabel("tunable top layers")
        ax.set_ylabel("")
    figure.suptitle("Drift of the encoder from its pretrained weights (mean over seeds)")
    figure.tight_layout()
    return figure


def _curves(part: pd.DataFrame, histories: Mapping[tuple, list[dict]]) -> pd.DataFrame:
    rows = []
    for cell in part.itertuples():
        metric = f"eval_{cell.metric}"
        for record in histories.get((cell.model, cell.task, cell.tunable_layers, cell.seed), []):
            for series, panel in (("train_loss", "loss"), ("eval_loss", "loss"), (metric, cell.metric)):
                if series in record:
                    rows.append({"tunable_layers": cell.tunable_layers, "seed": str(cell.seed),
                                 "epoch": record["epoch"], "series": series, "panel": panel, "value": record[series]})
    return pd.DataFrame(rows)


# ----------------------------------------------------------------------------------------------------- helpers


def _layers_value(value: Any) -> int | str:
    return "all" if str(value) == "all" else int(value)


def _ordered(table: pd.DataFrame, by: list[str] | None = None) -> pd.DataFrame:
    """Rows in study order: model and task as first seen, tunable layers 0, 1, … all, then seed."""
    by = by or [c for c in ("model", "task", "tunable_layers", "seed") if c in table.columns]
    keys = {}
    for column in by:
        if column == "tunable_layers":
            keys[column] = table[column].map(lambda k: (str(k) == "all", 0 if str(k) == "all" else int(k)))
        elif column == "seed":
            keys[column] = table[column]
        else:
            first_seen = {v: i for i, v in enumerate(dict.fromkeys(table[column]))}
            keys[column] = table[column].map(first_seen)
    order = pd.DataFrame(keys).apply(tuple, axis=1).sort_values(kind="stable").index
    return table.loc[order].reset_index(drop=True)


def _part_order(part: str) -> tuple:
    if part == "embeddings":
        return (0, 0)
    if part.startswith("layer."):
        return (1, int(part.split(".")[1]))
    return (2, {"pooler": 0, "head": 1}.get(part, 2))


def _metric(part: pd.DataFrame, task: str) -> str:
    return str(part.loc[part["task"] == task, "metric"].iloc[0])


def _mean_std(mean: float, std: float) -> str:
    return f"{100 * mean:.1f}" if std is None or math.isnan(std) else f"{100 * mean:.1f} ± {100 * std:.1f}"


def _round(value: float) -> float | None:
    return None if value is None or math.isnan(value) else round(float(value), DIGITS)
