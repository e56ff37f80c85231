"""The real entry point end to end on a tiny config: `kedro run` of every stage of three studies (a layer study, a
tagging study, a single-vs-combined study) through the project's own settings, catalog and hooks, on a toy data
mirror and tiny random models, tracked in a fresh MLflow database."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.projects import make_project, project_env, run, study
PARAMS = {
    "download": {"mirror": "mirror"},
    "studies": {
        "layers": study("layers", ["sst2"], {"tiny": "models/tiny-a"}, [0, 2], [1, 2], encoder={"pooling": "mean"}),
        "tags": study("ner", ["conll2003"], {"tiny": "models/tiny-a"}, [0, 1], [1],
                      per_tunable_layers={0: {"head_learning_rate": 3.0e-3}}),
        "combo": study("encoders", ["sst2"], {"a": "models/tiny-a", "b": "models/tiny-b",
                                              "dme": {"combine": "dme", "members": ["a", "b"]}}, [1], [1]),
    },
}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A project folder with this repository's pipelines and conf, the tiny params above, every stage run."""
    project = make_project(tmp_path_factory.mktemp("project"), PARAMS)
    # The plan stage through the command line itself; later stages through a Kedro session, as `kedro run` does.
    subprocess.run([sys.executable, "-m", "kedro", "run", "--pipelines", "plan"], cwd=project, check=True,
                   env={**os.environ, **project_env(project)}, capture_output=True)
    return project, run_stages(project)


def run_stages(project: Path) -> dict:
    from layertune.study import StudyPlan

    run(project, "download")
    plans = {name: StudyPlan.model_validate_json((project / f"data/00_plan/{name}/study.json").read_text())
             for name in PARAMS["studies"]}
    for name, plan in plans.items():
        run(project, "prepare", study=name)
        run(project, "tokenize", study=name)
        cache_before = sorted(p.name for p in (project / "data" / "cache").rglob("*"))
        for cell in plan.cells:
            run(project, "train", study=name, cell=cell.key)
        assert sorted(p.name for p in (project / "data" / "cache").rglob("*")) == cache_before, \
            "cells found the tokenize stage's caches: they wrote none of their own"
        run(project, "evaluate", study=name)
        run(project, "aggregate", study=name)
    return plans


def test_every_cell_of_every_study_has_its_folder(built):
    project, plans = built
    for name, plan in plans.items():
        for cell in plan.cells:
            folder = project / "data" / "04_models" / cell.path
            assert {p.name for p in folder.iterdir()} == {"cell.json", "metrics.json", "history.json", "drift.csv",
                                                          "predictions.json", "run_info.json", "model"}
    tagging = json.loads((project / "data/04_models/tags/conll2003-tiny-0-1/predictions.json").read_text())
    assert set(tagging) == {"dev", "test"}  # CoNLL-2003 has a labelled test split


def test_one_finished_mlflow_run_per_cell_with_params_history_and_model(built):
    from mlflow import MlflowClient

    project, plans = built
    client = MlflowClient(f"sqlite:///{project / 'mlflow.db'}")
    for name, plan in plans.items():
        experiment = client.get_experiment_by_name(f"layertune-{name}")
        runs = {run.info.run_name: run for run in client.search_runs([experiment.experiment_id])}
        assert set(runs) == {cell.key for cell in plan.cells}
        for cell in plan.cells:
            run = runs[cell.key]
            assert run.info.status == "FINISHED"
            assert run.data.params["tunable_layers"] == str(cell.tunable_layers)
            assert run.data.params["seed"] == str(cell.seed) and run.data.params["study"] == name
            history = client.get_metric_history(run.info.run_id, "eval_loss")
            assert [m.step for m in history] == [1, 2]
            assert (project / run.data.tags["model_path"] / "config.json").is_file()
            assert run.data.tags["dvc_stage"] == cell.dvc_stage


def test_reports_of_all_three_kinds(built):
    project, _ = built
    layers = json.loads((project / "reports/layers.json").read_text())
    assert set(layers["sst2"]["tiny"]["mean"]) == {"0", "2"} and layers["sst2"]["tiny"]["seeds"] == 2
    assert "recommended_layers" in layers["sst2"]["tiny"] and "ci_low" in layers["sst2"]["tiny"]
    markdown = (project / "reports/layers.md").read_text()
    assert "| tunable layers | trainable parameters | accuracy (points) |" in markdown
    assert (project / "reports/layers/figures/quality_vs_layers.png").stat().st_size > 1000
    tags = (project / "reports/tags.md").read_text()
    assert "Baselines without a model" in tags and "test F1" in tags
    assert set(json.loads((project / "reports/tags.json").read_text())["conll2003"]["baselines"]) == {
        "majority_tag", "word_majority_tag"}
    combo = (project / "reports/combo.md").read_text()
    assert "dme attention of `dme` on the first 2 dev examples" in combo
    verdicts = json.loads((project / "reports/combo.json").read_text())["sst2"]["1"]["versus_reference"]
    assert set(verdicts) == {"dme", *({"a", "b"} - {json.loads((project / "reports/combo.json").read_text())["sst2"]
                                                      ["1"]["reference"]})}


def test_a_saved_multi_encoder_predicts_with_attention(built, monkeypatch):
    from layertune.heads import TextClassifier

    project, _ = built
    monkeypatch.chdir(project)  # its base models are named relative to the project ("models/tiny-a")
    model = TextClassifier.from_pretrained("data/04_models/combo/sst2-dme-1-1/model")
    predictions, attention = model.predict_with_attention(["a good film", "worst story ever"])
    assert set(predictions) <= {"negative", "positive"}
    assert [round(sum(row), 6) for row in attention] == [1.0, 1.0] and len(attention[0]) == 2
