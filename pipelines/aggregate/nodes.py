"""aggregate: the study's reports from every cell's training and evaluation outputs."""

import pandas as pd

from layertune import reports
from layertune.study import model_layers, section


def collect_results(evaluations: dict[str, dict], trainings: dict[str, dict], study: dict) -> pd.DataFrame:
    """One row per cell of the study grid (cells left over from earlier grids are ignored)."""
    results = reports.results_table(evaluations.values(), trainings.values())
    return reports.select_cells(results, section("study", study).cells())


def tabulate(results: pd.DataFrame, study: dict, aggregate: dict) -> tuple:
    """Ablation table (CSV, Markdown), the deterministic metrics, timings, and plot data."""
    study, options = section("study", study), section("aggregate", aggregate)
    summary = reports.summarize(results)
    chosen = reports.recommend(summary, options.tolerance)
    layers = {model: model_layers(model) for model in study.models}
    markdown = reports.ablation_markdown(summary, chosen, study.name, study.seeds, layers)
    return (reports.ablation_table(summary), markdown, reports.report_metrics(summary, chosen),
            reports.timing_table(results), reports.plot_data(summary, results))


def draw(results: pd.DataFrame, trainings: dict[str, dict], histories: dict[str, list],
         drifts: dict[str, pd.DataFrame]) -> dict:
    """Figures; histories and drift tables sit beside each cell's metrics, which say which cell they are."""
    cell_of = {folder: tuple(str(m[k]) if k == "tunable_layers" else m[k] for k in reports.CELL_KEYS)
               for folder, m in trainings.items()}
    return reports.figures(results, {cell_of[f]: h for f, h in histories.items() if f in cell_of},
                           {cell_of[f]: d for f, d in drifts.items() if f in cell_of})
