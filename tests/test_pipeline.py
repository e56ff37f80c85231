"""The stages' Kedro pipelines on an in-memory catalog, with a tiny random model and a toy SST-2-shaped corpus."""

import shutil
from pathlib import Path

import pytest
from kedro.io import DataCatalog, MemoryDataset
from kedro.runner import SequentialRunner

from layertune.study import ParamsError, validate_params
from pipelines.datasets import CorporaDataset, FeatureCacheDataset
from pipelines.download.nodes import download_corpora
from pipelines.pipeline_registry import register_pipelines
from tests.conftest import toy_sentiment_corpus

MODEL = "models/tiny-bert"  # a model name is a relative folder name of the study


def study_params(**overrides) -> dict:
    params = {
        "study": {"name": "toy", "tasks": ["sst2"], "models": [MODEL], "tunable_layers": [0, 2], "seeds": [1]},
        "cell": {"task": "sst2", "model": MODEL, "tunable_layers": 0, "seed": 1},
        "download": {"mirror": None},
        "prepare": {"train_size": 48, "dev_size": 1000, "balanced": None, "seed": 42},
        "tokenize": {"max_length": 32, "frozen_prefix": True, "cache_dtype": "float32"},
        "train": {"learning_rate": 1e-3, "head_learning_rate": None, "batch_size": 8, "epochs": 2,
                  "weight_decay": 0.0, "warmup_ratio": 0.0, "max_grad_norm": 1.0, "pooling": "cls",
                  "head": "linear", "group_by_length": False, "mixed_precision": "no"},
        "evaluate": {"batch_size": 16},
        "aggregate": {"tolerance": 0.01},
    }
    for key, value in overrides.items():
        params[key] = {**params[key], **value}
    return params


def catalog_for(params: dict, root: Path) -> DataCatalog:
    datasets = {f"params:{name}": MemoryDataset(value) for name, value in params.items()}
    datasets.update(parameters=MemoryDataset(params), raw_corpora=CorporaDataset(str(root / "raw")),
                    prepared_corpora=CorporaDataset(str(root / "prepared")),
                    feature_cache=FeatureCacheDataset(str(root / "features")))
    return DataCatalog(datasets)


@pytest.fixture
def project(tiny_bert, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    shutil.copytree(tiny_bert, tmp_path / MODEL)
    CorporaDataset(str(tmp_path / "raw")).save({"sst2": toy_sentiment_corpus(64, 24)})
    return tmp_path


def cache_entries(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in (root / "features").rglob("*") if p.is_dir()}


def test_download_validates_all_params_first():
    with pytest.raises(ParamsError, match=r"train\.learnin_rate"):
        download_corpora(study_params(train={"learnin_rate": 1.0}))


def test_download_reads_the_mirror(project, data_mirror, monkeypatch):
    monkeypatch.delenv("LAYERTUNE_DATA_MIRROR", raising=False)
    corpora = download_corpora(study_params(study={"tasks": ["rte"]}, download={"mirror": str(data_mirror)}))
    assert list(corpora) == ["rte"] and len(corpora["rte"].train) == 2490 and len(corpora["rte"].dev) == 277


def test_stages_on_an_in_memory_catalog(project):
    pipelines = register_pipelines()
    params = study_params()
    validate_params(params)
    catalog = catalog_for(params, project)
    SequentialRunner().run(pipelines["prepare"] + pipelines["tokenize"], catalog)
    manifest = catalog.load("feature_manifest")
    assert manifest[f"sst2/{MODEL}"]["examples"] == {"train": 48, "dev": 24}
    assert manifest[f"sst2/{MODEL}"]["frozen_prefix_boundaries"] == [2, 4]
    built = cache_entries(project)

    cells, models = {}, {}
    for layers in (0, 2):
        cell = {"task": "sst2", "model": MODEL, "tunable_layers": layers, "seed": 1}
        catalog = catalog_for(study_params(cell=cell), project)
        SequentialRunner().run(pipelines["train"], catalog)
        cells[layers] = {name: catalog.load(name) for name in ("cell_metrics", "cell_history", "cell_drift")}
        models[layers] = catalog.load("cell_model")
    assert cache_entries(project) == built  # every cell found the tokenize stage's caches: nothing new written

    folders = {layers: f"layers-{layers}/seed-1" for layers in cells}
    catalog = catalog_for(params, project)
    catalog["task_models"] = MemoryDataset({folders[k]: (lambda m=m: m) for k, m in models.items()})
    catalog["task_trainings"] = MemoryDataset({folders[k]: v["cell_metrics"] for k, v in cells.items()})
    SequentialRunner().run(pipelines["evaluate"], catalog)
    evaluations, predictions = catalog.load("task_evaluations"), catalog.load("task_predictions")
    for layers, outputs in cells.items():
        metrics, evaluation = outputs["cell_metrics"], evaluations[folders[layers]]
        assert metrics["tunable_layers"] == layers and metrics["frozen_prefix_cache_used"]
        assert len(outputs["cell_history"]) == 2
        # The saved best model, reloaded and run whole, scores exactly what training measured.
        assert evaluation["score"] == pytest.approx(metrics["eval_accuracy"], abs=1e-9)
        assert len(predictions[folders[layers]]) == 24
    assert cells[0]["cell_metrics"]["trainable_parameters"] < cells[2]["cell_metrics"]["trainable_parameters"]

    reports = DataCatalog({
        "params:study": MemoryDataset(params["study"]), "params:aggregate": MemoryDataset(params["aggregate"]),
        "cell_trainings": MemoryDataset({folders[k]: v["cell_metrics"] for k, v in cells.items()}),
        "cell_histories": MemoryDataset({folders[k]: v["cell_history"] for k, v in cells.items()}),
        "cell_drifts": MemoryDataset({folders[k]: v["cell_drift"] for k, v in cells.items()}),
        "cell_evaluations": MemoryDataset(evaluations),
    })
    SequentialRunner().run(pipelines["aggregate"], reports)
    markdown, metrics = reports.load("ablation_markdown"), reports.load("report_metrics")
    assert "| tunable layers | SST-2 (accuracy) |" in markdown and "| 2 |" in markdown
    assert set(metrics[MODEL]["sst2"]["mean"]) == {"0", "2"}
    assert {"quality_vs_layers", "drift_heatmap"} <= set(reports.load("figures"))


def test_aggregate_names_missing_cells(project):
    from pipelines.aggregate.nodes import collect_results

    evaluation = {"task": "sst2", "model": MODEL, "tunable_layers": 0, "seed": 1, "metric": "accuracy", "score": 0.5}
    with pytest.raises(ValueError, match="layers-2/seed-1"):
        collect_results({"a": evaluation}, {}, study_params()["study"])
