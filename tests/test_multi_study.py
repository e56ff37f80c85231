"""The single-vs-multi study: its parameters, one system cell, the report, and the Kedro pipeline end to end."""

import pandas as pd
import pytest
from pydantic import ValidationError

from layertune.multi_study import (
    StudySpec, locate_model, report_markdown, run_study, run_system, summary_metrics, system_learning_rate,
)
from layertune.testing import make_tiny_model
from tests.conftest import toy_sentiment_corpus

TRAINING = {"learning_rate": 1e-3, "head_learning_rate": 3e-3, "batch_size": 8, "epochs": 1}


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    """A models folder holding two tiny encoders of different architectures and vocabularies."""
    root = tmp_path_factory.mktemp("models")
    make_tiny_model(root / "tiny-bert", "bert")
    make_tiny_model(root / "tiny-electra", "electra", seed=1, extra_words=("quokka",), hidden_size=48,
                    intermediate_size=96)
    return root


@pytest.fixture(scope="module")
def toy_folder(tmp_path_factory):
    """The toy corpus as train/dev CSV files, loadable by path like any local task."""
    folder = tmp_path_factory.mktemp("toy")
    corpus = toy_sentiment_corpus(24, 12)
    corpus.train.to_csv(folder / "train.csv", index=False)
    corpus.dev.to_csv(folder / "dev.csv", index=False)
    return folder


def study_params(task, models_dir, **changes):
    params = {
        "corpus": {"task": str(task)}, "models_dir": str(models_dir), "models": ["tiny-bert", "tiny-electra"],
        "tunable_layers": [1, 2], "learning_rates": [2e-3, None], "combine_methods": ["dme"], "pooling": "mean",
        "training": TRAINING, "seeds": [0], "mlflow_experiment": None,
    }
    return {**params, **changes}


@pytest.mark.parametrize(("change", "message"), [
    ({"models": ["tiny-bert"]}, "at least 2 items"),
    ({"models": ["a/tiny", "b/tiny"]}, "distinct names"),
    ({"tunable_layers": [1, 2, 3]}, "tunable_layers lists 3 values for 2 models"),
    ({"hidden_dropout_prob": 1.5}, "hidden_dropout_prob"),
    ({"combinations": [[0, 0]]}, "at least two different models"),
    ({"combinations": [[0, 2]]}, "by their index, 0 to 1"),
    ({"combine_methods": ["sum"]}, "'concat' or 'dme'"),
    ({"training": {"learning_rate": [1e-3, 1e-4]}}, "per-model rates as learning_rates"),
    ({"seed": [0]}, "seed"),
])
def test_bad_study_parameters_are_named(tmp_path, change, message):
    with pytest.raises(ValidationError, match=message):
        StudySpec.model_validate(study_params(tmp_path, tmp_path, **change))


def test_systems_rates_models_and_one_dme_cell(toy_folder, tiny_models, tmp_path):
    study = StudySpec.model_validate(study_params(toy_folder, tiny_models, combine_methods=["concat", "dme"]))
    systems = study.systems()
    assert [s.name for s in systems] == ["tiny-bert", "tiny-electra", "concat: tiny-bert + tiny-electra",
                                         "dme: tiny-bert + tiny-electra"]
    assert system_learning_rate(study, systems[0]) == 2e-3
    assert system_learning_rate(study, systems[3]) == [2e-3, 1e-3]  # electra's null rate: the study's
    assert locate_model("tiny-bert", tiny_models) == str(tiny_models / "tiny-bert")
    assert locate_model("sentence-transformers/all-MiniLM-L6-v2", tiny_models).startswith("sentence-transformers")
    row = run_system(study.corpus.load(), study, systems[3], seed=0, cache_dir=tmp_path)
    assert row["combine_method"] == "dme" and row["metric"] == "accuracy" and 0 <= row["score"] <= 1
    assert row["attention/tiny-bert"] + row["attention/tiny-electra"] == pytest.approx(1.0)


def test_combinations_pick_subsets(tmp_path):
    params = study_params(tmp_path, tmp_path, models=["a", "b", "c"], tunable_layers="all", learning_rates=None,
                          combinations=[[0, 1], [0, 1, 2]])
    names = [s.name for s in StudySpec.model_validate(params).systems()]
    assert names == ["a", "b", "c", "dme: a + b", "dme: a + b + c"]


def test_missing_model_fails_before_training(toy_folder, tiny_models, tmp_path):
    params = study_params(toy_folder, tiny_models, models=["tiny-bert", "no-such-model"])
    with pytest.raises(ValueError, match="models.1.: 'no-such-model' is not in the models folder"):
        run_study(StudySpec.model_validate(params), cache_dir=tmp_path)


def test_report_shows_mean_std_best_and_attention():
    rows = [("L6", "L6", "single", 0, 0.80), ("L6", "L6", "single", 1, 0.84),
            ("dme", "L6 + L3", "dme", 0, 0.85), ("dme", "L6 + L3", "dme", 1, 0.87)]
    results = pd.DataFrame([{"task": "sst2", "metric": "accuracy", "system": s, "encoders": e, "combine_method": c,
                             "seed": seed, "score": score, "train_time_s": 10.0} for s, e, c, seed, score in rows])
    results["attention/L6"] = [None, None, 0.7, 0.5]
    results["attention/L3"] = [None, None, 0.3, 0.5]
    report = report_markdown(results)
    assert "| L6 | 2 | 82.0 ± 2.8 | 10 |  |" in report
    assert "| dme | 2 | **86.0 ± 1.4** | 10 | L6 0.60, L3 0.40 |" in report
    metrics = summary_metrics(results.iloc[[0, 2]])
    assert metrics == {"sst2": {"L6": {"metric": "accuracy", "mean": 0.80, "std": 0.0, "seeds": 1},
                                "dme": {"metric": "accuracy", "mean": 0.85, "std": 0.0, "seeds": 1}}}
    assert "| **80.0** |" in report_markdown(results.iloc[[0]])  # one seed: no ± std


def test_pipeline_writes_report_and_tracks_each_cell(toy_folder, tiny_models, tmp_path, monkeypatch):
    from kedro.io import DataCatalog, MemoryDataset
    from kedro.runner import SequentialRunner
    from mlflow import MlflowClient

    from pipelines.multi_encoder import create_pipeline

    monkeypatch.delenv("LAYERTUNE_DATA_MIRROR", raising=False)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    params = study_params(toy_folder, tiny_models, seeds=[0, 1], mlflow_experiment="multi-test")
    catalog = DataCatalog({"params:multi_encoder": MemoryDataset(params),
                           "params:download": MemoryDataset({"mirror": None}),
                           "multi_encoder_cache": MemoryDataset(tmp_path / "cache")})
    outputs = SequentialRunner().run(create_pipeline(), catalog)

    report, metrics = outputs["multi_encoder_report"].load(), outputs["multi_encoder_metrics"].load()
    task = toy_folder.name
    dme = "dme: tiny-bert + tiny-electra"
    assert set(metrics[task]) == {"tiny-bert", "tiny-electra", dme} and metrics[task][dme]["seeds"] == 2
    assert f"| {dme} | 2 |" in report and "**" in report
    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name("multi-test").experiment_id])
    assert len(runs) == 6 and {r.info.status for r in runs} == {"FINISHED"}
    dme_run = next(r for r in runs if r.data.params["system"] == dme)
    assert dme_run.data.params["learning_rate"] == "[0.002, 0.001]"
    weights = [dme_run.data.metrics[f"attention/tiny-{name}"] for name in ("bert", "electra")]
    assert sum(weights) == pytest.approx(1)


@pytest.mark.integration
def test_real_minilms_combine_on_real_sst2(data_mirror, minilm_l3, tmp_path):
    """all-MiniLM-L6-v2 and the real MiniLM-L3 (different checkpoints and depths) as one dme encoder."""
    params = study_params("sst2", minilm_l3.parent, models=["sentence-transformers/all-MiniLM-L6-v2", minilm_l3.name],
                          corpus={"task": "sst2", "train_size": 64, "dev_size": 64, "data_seed": 0},
                          tunable_layers=1, learning_rates=None)
    study = StudySpec.model_validate(params)
    assert study.encoder_spec(1).model == str(minilm_l3)
    row = run_system(study.corpus.load(data_mirror), study, study.systems()[-1], seed=0, cache_dir=tmp_path)
    assert row["system"] == "dme: all-MiniLM-L6-v2 + paraphrase-MiniLM-L3-v2" and 0 < row["score"] <= 1
    assert row["attention/all-MiniLM-L6-v2"] + row["attention/paraphrase-MiniLM-L3-v2"] == pytest.approx(1)
