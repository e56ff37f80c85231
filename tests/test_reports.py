"""Reports from synthetic results: the recommendation rule (and when the data cannot decide), tables, metrics that
are byte-identical between builds, figures, and evaluate's checks."""

import json
from dataclasses import dataclass

import numpy as np
import pandas as pd
import pytest

from layertune.corpus import Corpus
from layertune.reports import build_report
from layertune.reports.common import Setting, StudyResults
from layertune.reports.layers import recommend
from layertune.statistics import Estimate
from layertune.stages import score_cells
from layertune.study import plan_studies


def setting(layers, samples, scores=(0.8,)) -> Setting:
    """One seed's full-dev score and its resamples."""
    return Setting("sst2", "m", layers, "accuracy", Estimate(np.asarray(scores, dtype=float), np.asarray([samples])))


def test_recommends_the_fewest_layers_shown_within_tolerance():
    rng = np.random.default_rng(0)
    best = 0.80 + rng.normal(0, 0.002, 1000)
    found = [setting(0, best - 0.10, [0.70]), setting(1, best - 0.002, [0.798]), setting(2, best, [0.80])]
    chosen = recommend(found, tolerance=0.01, confidence=0.95)
    assert chosen.best.tunable_layers == 2 and chosen.recommended == 1 and chosen.candidates == []
    assert {k: c.verdict for k, c in chosen.comparisons.items()} == {"0": "no", "1": "yes", "2": "yes"}


def test_names_no_winner_when_the_data_cannot_decide():
    rng = np.random.default_rng(1)
    best = 0.80 + rng.normal(0, 0.002, 1000)
    shortfall = rng.uniform(0.0, 0.02, 1000)  # straddles the 1-point tolerance
    found = [setting(0, best - shortfall, [0.79]), setting(1, best, [0.80])]
    chosen = recommend(found, tolerance=0.01, confidence=0.95)
    assert chosen.recommended is None and chosen.candidates == [0, 1]


def test_the_best_setting_is_always_good_enough():
    samples = np.full(100, 0.8)
    chosen = recommend([setting("all", samples, [0.8]), setting(2, samples - 0.05, [0.75])], 0.0, 0.95)
    assert chosen.recommended == "all"


@dataclass
class Cell:
    """Stands in for a saved cell folder (`layertune.cell.CellFolder`)."""

    dev: dict
    accuracy: float
    path: str = "data/04_models/s/cell"

    def predictions(self):
        return {"dev": self.dev}

    def metrics(self):
        return {"eval_accuracy": self.accuracy, "best_epoch": 1, "train_time_s": 1.0, "samples_per_s": 100.0,
                "trainable_parameters": 770, "total_parameters": 9000, "peak_memory_mb": 1.0}

    def history(self):
        return [{"epoch": 1, "train_loss": 0.6, "eval_loss": 0.5, "eval_accuracy": self.accuracy}]

    def drift(self):
        return pd.DataFrame({"parameter": ["e", "l"], "part": ["embeddings", "layer.0"], "numel": [4, 4],
                             "mean_abs_change": [0.0, 0.1], "relative_l2": [0.0, 0.1], "delta_l2": [0.0, 0.2],
                             "reference_l2": [2.0, 2.0]})


@pytest.fixture(scope="module")
def results(tiny_model_dirs):
    """A 3-setting, 2-seed layer study on 400 dev examples: K = 0 clearly worse, 1 and 2 nearly the same."""
    params = {"download": {"mirror": None}, "studies": {"s": {
        "report": {"kind": "layers", "resamples": 300}, "tasks": ["sst2"],
        "encoders": {"m": str(tiny_model_dirs["bert"])}, "tunable_layers": [0, 1, 2], "seeds": [1, 2]}}}
    plan = plan_studies(params).studies["s"]
    rng = np.random.default_rng(0)
    references = rng.integers(0, 2, 400).tolist()
    cells = {}
    for cell in plan.cells:
        accuracy = {0: 0.6, 1: 0.85, 2: 0.86}[cell.tunable_layers]
        predictions = [r if rng.random() < accuracy else 1 - r for r in references]
        cells[cell.key] = Cell({"predictions": predictions, "references": references},
                               float(np.mean(np.equal(predictions, references))))
    dev = pd.DataFrame({"sentence": ["x"] * 400, "label": references})
    import datasets

    split = datasets.Dataset.from_pandas(dev)
    corpus = Corpus(name="sst2", train=split, dev=split, text_columns=("sentence",), task_type="classification",
                    metrics=("accuracy",), main_metric="accuracy", label_names=("negative", "positive"))
    corpora = {"sst2": lambda: corpus}
    return StudyResults(plan, score_cells(plan, cells, {"sst2": corpus}), cells, corpora)


def test_layer_report_tables_rule_and_recommendation(results):
    report = build_report(results)
    assert "| tunable layers | trainable parameters | accuracy (points) | vs best (points) | within tolerance? |" \
        in report.markdown
    assert "one-sided paired test at 95%" in report.markdown
    entry = report.metrics["sst2"]["m"]
    assert entry["within_tolerance"]["0"] == "no" and entry["seeds"] == 2
    assert entry["ci_low"]["1"] < entry["mean"]["1"] < entry["ci_high"]["1"]
    assert entry["recommended_layers"] in (1, 2, None) and set(entry) >= {"best_layers", "undecided_between"}
    assert set(report.figures) >= {"quality_vs_layers", "training_time_vs_layers", "drift_heatmap"}


def test_metrics_are_byte_identical_between_builds(results, tmp_path):
    from pipelines.datasets import FileDataset

    for name in ("a", "b"):
        FileDataset(str(tmp_path / f"{name}.json")).save(build_report(results).metrics)
    assert (tmp_path / "a.json").read_bytes() == (tmp_path / "b.json").read_bytes()
    assert "train_time" not in (tmp_path / "a.json").read_text()  # timings vary between builds: not in metrics


def test_figures_are_written_as_png(results, tmp_path):
    from pipelines.datasets import FileTreeDataset

    FileTreeDataset(str(tmp_path), ".png").save(build_report(results).figures)
    assert (tmp_path / "quality_vs_layers.png").read_bytes()[:4] == b"\x89PNG"


def test_evaluate_names_missing_cells_and_refuses_inconsistent_folders(results):
    cells = dict(results.cells)
    first = results.plan.cells[0]
    del cells[first.key]
    with pytest.raises(ValueError, match=f"have no results: {first.dvc_stage}"):
        score_cells(results.plan, cells, {"sst2": results.corpora["sst2"]()})
    broken = dict(results.cells)
    broken[first.key] = Cell(results.cells[first.key].dev, accuracy=0.123)
    with pytest.raises(ValueError, match="saved dev predictions score .* but training measured 0.123"):
        score_cells(results.plan, broken, {"sst2": results.corpora["sst2"]()})


def test_metrics_json_is_plain_json(results):
    json.dumps(build_report(results).metrics)  # no numpy scalars: dvc metrics and git diffs read it
