"""A study over the user's own data (issue "Your data, your model"): tasks described in place in params.yaml, checked
at plan time with the key named, local files fingerprinted into the plan, hub datasets pinned to a commit, the
reports in the user's words; and the worked example of docs/pipeline.md built through the real `dvc repro`."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import datasets
import pandas as pd
import pytest
import yaml

from layertune.specs import CorpusSpec, DatasetSpec
from layertune.errors import CorpusArgumentError
from layertune.study import ParamsError
from pipelines.plans import download_folder, plan_studies
from tests.projects import ROOT, make_dvc_project, project_env, study

sys.path.insert(0, str(ROOT / "examples"))
from make_your_data import SIMILARITY_CLASSES, write_examples  # noqa: E402

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def reviews_csv(path: Path, rows: list[tuple[str, str]] | None = None) -> Path:
    rows = rows or [(f"a {'good' if i % 2 else 'bad'} film number {i}", "positive" if i % 2 else "negative")
                    for i in range(40)]
    path.parent.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(rows, columns=["review", "sentiment"]).to_csv(path, index=False)
    return path


def params_with(tasks, **extra) -> dict:
    """params.yaml with one study `mine` over ``tasks`` on a local tiny model (written by the caller)."""
    return {"download": {"mirror": None}, "studies": {"mine": {
        **study("layers", tasks, {"tiny": extra.pop("model")}, [0, 1], [1]), **extra}}}


@pytest.fixture
def tiny(tmp_path):
    from layertune.testing import make_tiny_model

    return str(make_tiny_model(tmp_path / "tiny", "bert", seed=0))


def plan_error(params) -> str:
    with pytest.raises(ParamsError) as error:
        plan_studies(params)
    return str(error.value)


# ------------------------------------------------------------------------------------------ the library's spec


def test_a_dataset_is_one_of_task_path_or_hub():
    with pytest.raises(ValueError, match="exactly one of task .*got task, path"):
        DatasetSpec(task="sst2", path="x.csv")
    with pytest.raises(ValueError, match="unknown task 'sst3'. Did you mean 'sst2'.*path: <file or folder>"):
        DatasetSpec(task="sst3")
    with pytest.raises(ValueError, match="label: a built-in task has its own columns"):
        DatasetSpec(task="sst2", label="y")
    with pytest.raises(ValueError, match="unknown metric 'acc'. Did you mean 'accuracy'"):
        DatasetSpec(path="x.csv", metric="acc")


def test_a_subsample_is_at_most_the_split(tmp_path):
    """``train_size`` / ``dev_size`` are upper bounds (one study's data section serves tasks of every size)."""
    corpus = CorpusSpec(path=str(reviews_csv(tmp_path / "r.csv")), label="sentiment", train_size=10,
                        dev_size=10_000).load()
    assert len(corpus.train) == 10 and len(corpus.dev) == 4  # dev: the 10% carved from 40 rows, kept whole


def test_string_labels_integer_labels_with_names_and_an_inferred_task_type_note(tmp_path):
    corpus = CorpusSpec(path=str(reviews_csv(tmp_path / "r.csv")), label="sentiment",
                        label_names=["positive", "negative"], dev_fraction=0.25).load()
    assert corpus.label_names == ("positive", "negative") and len(corpus.dev) == 10
    assert any("Task type classification (inferred: the labels are text)" in note for note in corpus.notes)
    numbers = tmp_path / "n.parquet"
    pd.DataFrame({"text": [f"t{i}" for i in range(30)], "stars": [i % 3 for i in range(30)]}).to_parquet(numbers)
    corpus = CorpusSpec(path=str(numbers), label="stars", label_names=["low", "mid", "high"], metric="matthews_correlation"
                        ).load()
    assert corpus.label_names == ("low", "mid", "high") and corpus.main_metric == "matthews_correlation"
    named = {text: corpus.label_names[label] for text, label in zip(corpus.train["text"], corpus.train["label"])}
    assert all(name == ("low", "mid", "high")[int(text[1:]) % 3] for text, name in named.items())
    as_regression = CorpusSpec(path=str(numbers), label="stars", task_type="regression").load()
    assert as_regression.task_type == "regression" and as_regression.main_metric == "spearmanr"
    with pytest.raises(CorpusArgumentError, match=r"integer labels \[2\] have no name") as error:
        CorpusSpec(path=str(numbers), label="stars", label_names=["low", "mid"]).load()
    assert error.value.argument == "label_names"


def test_one_text_column_may_be_given_as_a_string(tmp_path, tiny):
    """``text: review`` is the column ``[review]``, in the library's spec and in a study's task entry."""
    assert DatasetSpec(path="x.csv", text="review").text == ["review"]
    path = tmp_path / "two_texts.csv"
    pd.DataFrame({"title": [f"title {i}" for i in range(40)], "review": [f"review {i}" for i in range(40)],
                  "sentiment": ["positive", "negative"] * 20}).to_csv(path, index=False)
    plan = plan_studies(params_with({"reviews": {"path": str(path), "label": "sentiment", "text": "review"}},
                                    model=tiny))
    corpus = plan.prepare["mine"].corpora["reviews"]
    assert corpus.text == ["review"]
    assert corpus.load().text_columns == ("review",)


# -------------------------------------------------------------------------------------- checked at plan time


@pytest.mark.parametrize(("entry", "key", "message"), [
    ({"label": "labels"}, "studies.mine.tasks.reviews.label",
     r"column 'labels' not in .*reviews.csv; columns: review, sentiment"),
    ({"label": "sentiment", "text": ["body"]}, "studies.mine.tasks.reviews.text", r"has no column 'body'"),
    ({"label": "sentiment", "label_names": ["pos", "neg"]}, "studies.mine.tasks.reviews.label_names",
     r"label\(s\) 'negative', 'positive' are not in label_names"),
    ({"label": "sentiment", "metric": "spearmanr"}, "studies.mine.tasks.reviews.metric",
     r"Unknown metric for classification 'spearmanr'"),
    ({"label": "sentiment", "task_type": "regression"}, "studies.mine.tasks.reviews.task_type",
     r"needs numbers as labels"),
])
def test_a_bad_dataset_key_is_named_at_plan_time(tmp_path, tiny, entry, key, message):
    path = reviews_csv(tmp_path / "reviews.csv")
    error = plan_error(params_with({"reviews": {"path": str(path), **entry}}, model=tiny))
    assert error.startswith(f"{key}: ") and __import__("re").search(message, error), error


def test_bad_data_is_named_at_plan_time(tmp_path, tiny):
    def error_for(rows=None, files=None) -> str:
        folder = tmp_path / f"case{len(list(tmp_path.iterdir()))}"
        if files:
            for name, file_rows in files.items():
                reviews_csv(folder / name, file_rows)
            path = folder
        else:
            path = reviews_csv(folder / "reviews.csv", rows)
        return plan_error(params_with({"reviews": {"path": str(path), "label": "sentiment"}}, model=tiny))

    missing = plan_error(params_with({"reviews": {"path": str(tmp_path / "nope.csv")}}, model=tiny))
    assert missing.startswith("studies.mine.tasks.reviews.path: ") and "nope.csv does not exist" in missing
    one_class = error_for([(f"film {i}", "positive") for i in range(10)])
    assert one_class.startswith("studies.mine.tasks.reviews: ") and "every label is 'positive'" in one_class
    blank = error_for([("a film", "positive"), ("", "negative"), *[(f"film {i}", "negative") for i in range(8)]])
    assert blank.startswith("studies.mine.tasks.reviews: ") and "column 'review' is blank" in blank
    train = [(f"film {i}", ("negative", "positive")[i % 2]) for i in range(10)]
    unseen = error_for(files={"train.csv": train, "dev.csv": [("a film", "neutral"), ("b film", "positive")]})
    assert unseen.startswith("studies.mine.tasks.reviews: ") and "label(s) 'neutral' never occur" in unseen


def test_a_tab_separated_file_named_csv_is_said_to_be_one(tmp_path, tiny):
    """It gave pandas' ParserError ("Expected 1 fields in line 3, saw 2"), or one column named 'review\tsentiment'."""
    path = tmp_path / "reviews.csv"
    rows = [(f"a film{', really' * (i % 3)} number {i}", ("negative", "positive")[i % 2]) for i in range(40)]
    pd.DataFrame(rows, columns=["review", "sentiment"]).to_csv(path, sep="\t", index=False)
    error = plan_error(params_with({"reviews": {"path": str(path), "label": "sentiment"}}, model=tiny))
    assert error == (f"studies.mine.tasks.reviews: {path} looks separated by tabs, not commas (its header "
                     "'review\\tsentiment'), and a .csv file is read as separated by commas: rename it to "
                     "reviews.tsv, or save it with commas.")
    path.rename(tmp_path / "reviews.tsv")
    plan_studies(params_with({"reviews": {"path": str(tmp_path / "reviews.tsv"), "label": "sentiment"}}, model=tiny))


def test_task_lists_and_names(tmp_path, tiny):
    error = plan_error(params_with(["sst2", {"reviews": {"path": "x.csv"}}], model=tiny))
    assert "studies.mine.tasks: " in error and "tasks[1]: a list of tasks holds built-in task names" in error
    error = plan_error(params_with({"My-Reviews": {"path": "x.csv"}}, model=tiny))
    assert error.startswith("params.yaml is invalid:\n  studies.mine.tasks.My-Reviews: 'My-Reviews' is not a valid")
    plan = plan_studies(params_with({"sst2": None, "sentiment": "sst2"}, model=tiny))
    assert [c.task for c in plan.prepare["mine"].corpora.values()] == ["sst2", "sst2"]
    assert plan.download.tasks == ["sst2"]


def test_a_hub_dataset_is_pinned_to_a_commit_and_downloaded_at_it(tmp_path, tiny, monkeypatch):
    import huggingface_hub

    asked = []

    class Hub:
        def dataset_info(self, repo_id, revision=None):
            asked.append((repo_id, revision))
            if repo_id != "someone/reviews":
                raise huggingface_hub.errors.RepositoryNotFoundError(f"404 {repo_id}")
            return type("Info", (), {"sha": COMMIT})()

    monkeypatch.setattr(huggingface_hub, "HfApi", Hub)
    plan = plan_studies(params_with({"hubbed": {"hub": "someone/reviews", "splits": {"train": "train", "dev": "val"},
                                                "label": "sentiment"}}, model=tiny))
    corpus = plan.prepare["mine"].corpora["hubbed"]
    assert corpus.revision == COMMIT and asked == [("someone/reviews", None)]
    assert plan.studies["mine"].cells[0].spec.corpus.revision == COMMIT  # the cells and reports read the pin
    assert plan.prepare["mine"].downloaded["hubbed"] == f"someone--reviews@{COMMIT}"
    assert list(plan.download.hub) == [f"someone--reviews@{COMMIT}"]
    error = plan_error(params_with({"gone": {"hub": "someone/gone"}}, model=tiny))
    assert error.startswith("studies.mine.tasks.gone.hub: cannot resolve hub dataset 'someone/gone'")
    assert "revision: <40-hex commit>" in error
    asked.clear()
    plan_studies(params_with({"pinned": {"hub": "someone/gone", "revision": COMMIT}}, model=tiny))
    assert asked == []  # a full commit needs no hub at plan time

    # download: the hub's splits as they are, under our names; prepare reads them like local files
    rows = {"text": ["good", "bad"] * 10, "sentiment": ["pos", "neg"] * 10}
    served = datasets.DatasetDict({"train": datasets.Dataset.from_dict(rows),
                                   "val": datasets.Dataset.from_dict(rows), "extra": datasets.Dataset.from_dict(rows)})
    fetched = []
    with monkeypatch.context() as hub:
        hub.setattr(datasets, "load_dataset", lambda name, config=None, revision=None: fetched.append(
            (name, config, revision)) or served)
        splits = corpus.fetch()
    assert fetched == [("someone/reviews", None, COMMIT)] and sorted(splits) == ["dev", "train"]
    folder = tmp_path / "raw"
    for split, dataset in splits.items():
        folder.mkdir(exist_ok=True)
        dataset.to_parquet(folder / f"{split}.parquet")
    loaded = corpus.load(files={split: str(folder / f"{split}.parquet") for split in splits})
    assert loaded.label_names == ("neg", "pos") and len(loaded.dev) == 20


def test_local_files_are_fingerprinted_into_the_prepare_plan(tmp_path, tiny):
    path = reviews_csv(tmp_path / "reviews.csv")
    params = params_with({"reviews": {"path": str(path), "label": "sentiment"}, "sst2": None}, model=tiny)
    before = plan_studies(params).prepare["mine"]
    assert before.fingerprints["sst2"] is None and before.downloaded == {"reviews": None, "sst2": "sst2"}
    assert plan_studies(params).prepare["mine"] == before  # the same files: the same plan
    text = path.read_text().replace("a good film number 1,", "a fine film number 1,")
    path.write_text(text)
    assert plan_studies(params).prepare["mine"].fingerprints["reviews"] != before.fingerprints["reviews"]
    assert download_folder(DatasetSpec(path=str(path))) is None


# ---------------------------------------------------------------------------- the worked example, through DVC


WORKED_EXAMPLE = """\
report: {kind: layers, tolerance: 0.01}
tasks:
  reviews: {path: data/user/reviews.csv, label: sentiment}
  similarity: {path: data/user/similarity.parquet, text: [sentence1, sentence2], label: similarity,
               label_names: [unrelated, distant, related, close, equivalent], dev_fraction: 0.2}
encoders:
  minilm: models/my-encoder
tunable_layers: [0, all]
seeds: [1]
data: {train_size: 200, seed: 42}
encoder: {pooling: mean}
training: {learning_rate: 1.0e-4, batch_size: 16, eval_batch_size: 64, epochs: 1, eval_strategy: end,
           max_length: 64}
"""


def test_the_worked_example_is_the_one_in_the_docs():
    import textwrap

    assert f"studies:\n  mine:\n{textwrap.indent(WORKED_EXAMPLE, '    ')}" in (ROOT / "docs" / "pipeline.md").read_text()


@pytest.mark.slow
@pytest.mark.integration  # the real model, a real `dvc repro` of 4 cells, then an edited row: ~3 min
def test_a_study_of_your_own_data_through_dvc_repro(tmp_path):
    """A local CSV (string labels) and a local parquet (five classes, no dev split), a model given as a local
    folder: `dvc repro` builds the report with intervals and a recommendation and logs to MLflow; editing one row
    of the CSV re-prepares and retrains that task's cells, and nothing else."""
    from layertune.model_paths import resolve_model_path

    params = {"download": {"mirror": None}, "studies": {"mine": yaml.safe_load(WORKED_EXAMPLE)}}
    project = make_dvc_project(tmp_path / "project", params)
    shutil.copytree(resolve_model_path("paraphrase-MiniLM-L3-v2"), project / "models" / "my-encoder")
    write_examples(project / "data" / "user", rows=300)
    env = {**os.environ, **project_env(project)}

    def repro() -> str:
        done = subprocess.run(["dvc", "repro"], cwd=project, env=env, capture_output=True, text=True)
        assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
        return done.stdout + done.stderr

    def trained(log: str) -> list[str]:
        return sorted(line.split("] ")[1].split()[0] for line in log.splitlines() if " trained" in line)

    cells = sorted(f"{task}-minilm-{k}-1" for task in ("reviews", "similarity") for k in (0, "all"))
    assert trained(repro()) == cells
    report = (project / "reports" / "mine.md").read_text()
    assert "## reviews (accuracy), minilm" in report and "## similarity (accuracy), minilm" in report
    assert "local files data/user/similarity.parquet" in report and "Task type classification (inferred" in report
    assert "No validation split: dev is" in report and "recommend" in report.lower()
    headline = json.loads((project / "reports" / "mine.json").read_text())
    assert set(headline) >= {"reviews", "similarity"}
    details = json.loads((project / "reports" / "mine" / "details.json").read_text())
    assert all({"ci_low", "ci_high"} <= set(details[task]["minilm"]) for task in ("reviews", "similarity"))
    from layertune.cell import CellFolder

    model = CellFolder(project / "data" / "04_models" / "mine" / "similarity-minilm-all-1").model()
    assert set(model.predict([("A man plays a guitar.", "A man is playing music.")])) <= set(SIMILARITY_CLASSES)

    import mlflow

    mlflow.set_tracking_uri(project_env(project)["MLFLOW_TRACKING_URI"])
    runs = mlflow.search_runs(experiment_names=["layertune-mine"])
    assert sorted(name for name in runs["tags.mlflow.runName"] if not name.startswith("build ")) == cells
    assert set(runs["status"]) == {"FINISHED"}

    csv = project / "data" / "user" / "reviews.csv"
    lines = csv.read_text().splitlines()
    lines[5] = lines[5].replace(",positive", ",negative") if lines[5].endswith(",positive") else \
        lines[5].replace(",negative", ",positive")
    csv.write_text("\n".join(lines) + "\n")
    log = repro()
    assert "Running stage 'prepare@mine':" in log and "mine: 2 of 4 cell(s) to train" in log
    assert trained(log) == ["reviews-minilm-0-1", "reviews-minilm-all-1"]
