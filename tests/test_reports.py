"""Reports from a synthetic results table: mean ± std over seeds, the best in bold, the recommendation, figures."""

import json

import numpy as np
import pandas as pd
import pytest

from layertune import reports
from layertune.study import Cell
from pipelines.datasets import FileDataset, FileTreeDataset

LAYERS = [0, 1, 2, "all"]
# Mean dev score per setting: SST-2 saturates at 2 layers, MRPC keeps improving.
MEANS = {"sst2": {0: 0.80, 1: 0.85, 2: 0.905, "all": 0.91}, "mrpc": {0: 0.70, 1: 0.75, 2: 0.80, "all": 0.84}}
OFFSETS = [-0.01, 0.0, 0.01]  # seed offsets: std over seeds = 0.01


def evaluations():
    rows = []
    for task, means in MEANS.items():
        metric = "accuracy" if task == "sst2" else "f1"
        for k in LAYERS:
            for seed, offset in zip([1, 2, 3], OFFSETS, strict=True):
                rows.append({"task": task, "model": "org/m", "tunable_layers": k, "seed": seed, "metric": metric,
                             "score": means[k] + offset})
    return rows


def trainings():
    return [{**{k: r[k] for k in ("task", "model", "tunable_layers", "seed")}, "best_epoch": 1,
             "train_time_s": 10.0 + (4 if r["tunable_layers"] == "all" else r["tunable_layers"]),
             "samples_per_s": 100.0, "trainable_parameters": 1000} for r in evaluations()]


@pytest.fixture
def results():
    return reports.results_table(evaluations(), trainings())


def test_summary_is_mean_and_std_over_seeds(results):
    summary = reports.summarize(results)
    row = summary[(summary.task == "mrpc") & (summary.tunable_layers == "2")].iloc[0]
    assert row["mean"] == pytest.approx(0.80) and row["std"] == pytest.approx(0.01) and row["seeds"] == 3
    assert list(summary[summary.task == "sst2"].tunable_layers) == ["0", "1", "2", "all"]


def test_markdown_rows_layers_columns_tasks_best_in_bold(results):
    summary = reports.summarize(results)
    text = reports.ablation_markdown(summary, reports.recommend(summary, 0.01), "demo", [1, 2, 3], {"org/m": 4})
    table = [line for line in text.splitlines() if line.startswith("| ")]
    assert table[0] == "| tunable layers | SST-2 (accuracy) | MRPC (f1) |"
    assert table[1] == "| 0 | 80.0 ± 1.0 | 70.0 ± 1.0 |"
    assert table[4] == "| all | **91.0 ± 1.0** | **84.0 ± 1.0** |"
    assert "org/m (4 layers)" in text and "within 1 point(s)" in text


def test_recommendation_is_the_fewest_layers_within_tolerance(results):
    chosen = reports.recommend(reports.summarize(results), tolerance=0.01).set_index("task")
    assert chosen.loc["sst2", "best_layers"] == "all" and chosen.loc["sst2", "recommended_layers"] == "2"
    assert chosen.loc["mrpc", "recommended_layers"] == "all"
    loose = reports.recommend(reports.summarize(results), tolerance=0.07).set_index("task")
    assert loose.loc["mrpc", "recommended_layers"] == "2" and loose.loc["sst2", "recommended_layers"] == "1"


def test_metrics_are_deterministic_and_free_of_timings(results, tmp_path):
    files = []
    for name, order in (("a", results), ("b", results.sample(frac=1, random_state=0))):
        summary = reports.summarize(reports.results_table(order.to_dict("records"), trainings()))
        FileDataset(str(tmp_path / f"{name}.json")).save(
            reports.report_metrics(summary, reports.recommend(summary, 0.01)))
        files.append((tmp_path / f"{name}.json").read_bytes())
    assert files[0] == files[1]
    metrics = json.loads(files[0])["org/m"]["sst2"]
    assert metrics["mean"]["2"] == 0.905 and metrics["recommended_layers"] == 2 and metrics["best_layers"] == "all"
    assert "time" not in files[0].decode()


def test_ablation_csv_and_plot_data(results):
    summary = reports.summarize(results)
    table = reports.ablation_table(summary)
    assert list(table.columns) == ["model", "tunable_layers", "sst2 accuracy", "sst2 accuracy std", "mrpc f1",
                                   "mrpc f1 std"]
    assert table["mrpc f1"].tolist() == [70.0, 75.0, 80.0, 84.0]
    data = reports.plot_data(summary, results)
    assert set(data) == {"quality/sst2", "quality/mrpc", "time/sst2", "time/mrpc"}
    assert data["time/sst2"]["train_time_s"].tolist() == [10.0, 11.0, 12.0, 14.0]


def test_missing_cells_are_named(results):
    grid = [Cell("sst2", "org/m", 5, 1), Cell("sst2", "org/m", 0, 1)]
    with pytest.raises(ValueError, match="sst2/org/m/layers-5/seed-1"):
        reports.select_cells(results, grid)
    assert len(reports.select_cells(results, grid[1:])) == 1


def test_figures_are_written_as_png(results, tmp_path):
    histories, drift = {}, {}
    for r in results.itertuples():
        key = (r.model, r.task, r.tunable_layers, r.seed)
        histories[key] = [{"epoch": e, "train_loss": 1 / e, "eval_loss": 1.2 / e, f"eval_{r.metric}": r.score}
                          for e in (1, 2)]
        trained = ["layer.1"] if r.tunable_layers in ("1", "2", "all") else []
        drift[key] = pd.DataFrame({
            "parameter": ["embeddings.w", "layer.0.w", "layer.1.w", "head.w"],
            "part": ["embeddings", "layer.0", "layer.1", "head"],
            "trainable": [False, False, bool(trained), True], "numel": [4, 4, 4, 2],
            "mean_abs_change": [0.0, 0.0, 0.01 if trained else 0.0, 0.5],
            "relative_l2": [0.0, 0.0, 0.02 if trained else 0.0, 1.0],
            "delta_l2": [0.0, 0.0, 0.02 if trained else 0.0, 1.0], "reference_l2": [1.0, 1.0, 1.0, 1.0]})
    figures = reports.figures(results, histories, drift)
    assert {"quality_vs_layers", "training_time_vs_layers", "drift_heatmap", "curves/org/m/sst2"} <= set(figures)
    FileTreeDataset(str(tmp_path / "figures"), ".png").save(figures)
    written = sorted(p.relative_to(tmp_path / "figures").as_posix() for p in (tmp_path / "figures").rglob("*.png"))
    assert "drift_heatmap.png" in written and "curves/org/m/mrpc.png" in written
    assert all((tmp_path / "figures" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for name in written)
    heat = reports.drift_matrix(drift)
    assert "head" not in set(heat["part"]) and np.isclose(
        heat[(heat.part == "layer.1") & (heat.tunable_layers == "2")]["relative_l2"].iloc[0], 0.02)
