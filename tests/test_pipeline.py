"""The real entry point end to end on a tiny config: `kedro run` of every stage of three studies (a layer study, a
tagging study, a single-vs-combined study) through the project's own settings, catalog and hooks, on a toy data
mirror and tiny random models, tracked in a fresh MLflow database."""

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.projects import ROOT, make_dvc_project, make_project, project_env, run, study

PARAMS = {
    "download": {"mirror": "mirror"},
    "studies": {
        "layers": study("layers", ["sst2"], {"tiny": "models/tiny-a"}, [0, 2], [1, 2], encoder={"pooling": "mean"}),
        "tags": study("ner", ["conll2003"], {"tiny": "models/tiny-a"}, [0, 1], [1],
                      per_tunable_layers={0: {"head_learning_rate": 3.0e-3}}),
        "combo": study("encoders", ["sst2"], {"a": "models/tiny-a", "b": "models/tiny-b",
                                              "dme": {"combine": "dme", "members": ["a", "b"]}}, [1], [1]),
        # its top_k-0 cells are the layers study's 0-layer cells (the same spec, models, code and data): copied
        "tuning": {**study("methods", ["sst2"], {"tiny": "models/tiny-a"}, None, [1, 2], encoder={"pooling": "mean"}),
                   "tunable_layers": None,
                   "methods": {"top_k-0": {"tunable_layers": 0}, "top_k-all": {"tunable_layers": "all"},
                               "lora-top1": {"method": {"name": "lora", "r": 2}, "tunable_layers": 1,
                                             "learning_rate": 3.0e-3},
                               "bitfit": {"method": "bitfit", "tunable_layers": "all", "learning_rate": 3.0e-3}}},
    },
}


# The tests that read the build below: one worker runs them all, so that one builds it (~30 s) while the other goes on.
reads_the_build = pytest.mark.xdist_group("built_pipeline")


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
        run(project, "train", study=name)
        assert sorted(p.name for p in (project / "data" / "cache").rglob("*")) == cache_before, \
            "cells found the tokenize stage's caches: they wrote none of their own"
        run(project, "evaluate", study=name)
        run(project, "aggregate", study=name)
    return plans


@reads_the_build
def test_every_cell_of_every_study_has_its_folder(built):
    project, plans = built
    for name, plan in plans.items():
        for cell in plan.cells:
            folder = project / "data" / "04_models" / cell.path
            assert {p.name for p in folder.iterdir()} == {"cell.json", "metrics.json", "history.json", "drift.csv",
                                                          "predictions.json", "run_info.json", "model",
                                                          "build.json", ".layertune-output"}
    tagging = json.loads((project / "data/04_models/tags/conll2003-tiny-0-1/predictions.json").read_text())
    assert set(tagging) == {"dev", "test"}  # CoNLL-2003 has a labelled test split


@reads_the_build
def test_one_finished_mlflow_run_per_cell_under_the_builds_with_params_history_and_model(built):
    from mlflow import MlflowClient

    project, plans = built
    client = MlflowClient(f"sqlite:///{project / 'mlflow.db'}")
    for name, plan in plans.items():
        experiment = client.get_experiment_by_name(f"layertune-{name}")
        runs = {run.info.run_name: run for run in client.search_runs([experiment.experiment_id])}
        [build] = [run for run_name, run in runs.items() if run_name.startswith("build ")]
        copied = {cell.key: f"layers/sst2-tiny-0-{cell.seed}" for cell in plan.cells if cell.method == "top_k-0"}
        assert build.info.status == "FINISHED" and build.data.params["cells"] == str(len(plan.cells) - len(copied))
        assert build.data.params.get("copied") == (str(len(copied)) if copied else None)
        runs = {run_name: run for run_name, run in runs.items() if run is not build}
        assert set(runs) == {cell.key for cell in plan.cells}
        for cell in plan.cells:
            run = runs[cell.key]
            assert run.info.status == "FINISHED"
            assert run.data.params["tunable_layers"] == str(cell.tunable_layers)
            assert run.data.params["method"] == cell.spec.encoders[0].method.name
            if cell.method is not None:  # a methods study: the setting's name and the method's own settings
                assert run.data.params["method_setting"] == cell.method
                assert run.data.params.get("method_r") == ("2" if cell.method == "lora-top1" else None)
            assert run.data.params["seed"] == str(cell.seed) and run.data.params["study"] == name
            history = client.get_metric_history(run.info.run_id, "eval_loss")
            assert [m.step for m in history] == [1, 2]
            assert (project / run.data.tags["model_path"] / "config.json").is_file()
            assert run.data.tags["dvc_stage"] == f"train@{name}"
            assert run.data.tags["mlflow.parentRunId"] == build.info.run_id
            assert run.data.tags.get("layertune.copied_from") == copied.get(cell.key)


@reads_the_build
def test_a_cell_another_study_built_is_copied_not_trained_and_holds_its_sources_results(built):
    """The methods study's top_k-0 cells are the layers study's 0-layer cells: copied from their folders (the train
    stage trained only the others: its MLflow build says so), they hold their sources' weights and predictions."""
    project, plans = built
    models = project / "data" / "04_models"
    for cell in plans["tuning"].cells:
        record = json.loads((models / cell.path / "build.json").read_text())
        if cell.method != "top_k-0":
            assert "copied_from" not in record
            continue
        source = models / record["copied_from"]
        assert record["copied_from"] == f"layers/sst2-tiny-0-{cell.seed}" and record["cell"] == cell.key
        assert record["key"] == json.loads((source / "build.json").read_text())["key"]
        for name in ("predictions.json", "metrics.json", "model/model.safetensors"):
            assert (models / cell.path / name).read_bytes() == (source / name).read_bytes()


@reads_the_build
def test_reports_of_all_four_kinds(built):
    project, _ = built
    layers = json.loads((project / "reports/layers.json").read_text())
    assert set(layers["sst2"]["tiny"]) == {"recommended_layers", "best_layers", "best_score", "mean"}
    assert set(layers["sst2"]["tiny"]["mean"]) == {"0", "2"}
    details = json.loads((project / "reports/layers/details.json").read_text())
    assert details["sst2"]["tiny"]["seeds"] == 2 and set(details["sst2"]["tiny"]["ci_low"]) == {"0", "2"}
    markdown = (project / "reports/layers.md").read_text()
    assert "| tunable layers | trainable parameters | accuracy (points) |" in markdown
    assert (project / "reports/layers/figures/quality_vs_layers.png").stat().st_size > 1000
    tags = (project / "reports/tags.md").read_text()
    assert "Baselines without a model" in tags and "test F1" in tags
    assert set(json.loads((project / "reports/tags/details.json").read_text())["conll2003"]["baselines"]) == {
        "majority_tag", "word_majority_tag"}
    assert set(json.loads((project / "reports/tags.json").read_text())["conll2003"]) == {"tiny"}
    combo = (project / "reports/combo.md").read_text()
    assert "dme attention of `dme` on the first 2 dev examples" in combo
    headline = json.loads((project / "reports/combo.json").read_text())["sst2"]["1"]
    assert set(headline) == {"reference", "mean", "verdict"} and set(headline["mean"]) == {"a", "b", "dme"}
    assert set(headline["verdict"]) == {"dme", *({"a", "b"} - {headline["reference"]})}
    details = json.loads((project / "reports/combo/details.json").read_text())["sst2"]["1"]
    assert {name: c["verdict"] for name, c in details["versus_reference"].items()} == headline["verdict"]
    tuning = json.loads((project / "reports/tuning/details.json").read_text())["sst2"]["tiny"]
    methods = {"top_k-0", "top_k-all", "lora-top1", "bitfit"}
    assert set(tuning["mean"]) == set(tuning["trainable_parameters"]) == set(tuning["within_tolerance"]) == methods
    parameters = tuning["trainable_parameters"]
    assert parameters["top_k-0"] < parameters["lora-top1"] < parameters["top_k-all"]
    assert parameters["top_k-0"] < parameters["bitfit"] < parameters["top_k-all"]
    assert tuning["best_method"] in methods and tuning["within_tolerance"][tuning["best_method"]] == "yes"
    cheapest = tuning["cheapest_by_trainable_parameters"]
    assert cheapest in methods or tuning["undecided_by_trainable_parameters"]
    markdown = (project / "reports/tuning.md").read_text()
    assert "| method | what trains | trainable parameters |" in markdown and "lora (r 2, alpha 16.0" in markdown
    assert "on the top layer, rate 0.003 |" in markdown and "on no layer (the head alone), head rate" in markdown
    assert "Cheapest method within tolerance, by trainable parameters:" in markdown
    for figure in ("score_vs_trainable_parameters", "score_vs_train_time_s"):
        assert (project / f"reports/tuning/figures/{figure}.png").stat().st_size > 1000
    assert set(json.loads((project / "reports/tuning.json").read_text())["sst2"]["tiny"]) == {
        "cheapest_by_trainable_parameters", "best_method", "best_score", "mean"}


@reads_the_build
def test_the_plots_tables_of_all_four_kinds(built):
    """dvc.yaml's plots read these: a score per setting (the value each kind varies, the report's mean), a loss per
    cell, epoch and split."""
    import pandas as pd

    project, plans = built
    varied = {"layers": ["0", "2"], "tags": ["0", "1"], "combo": ["a", "b", "dme"],
              "tuning": ["top_k-0", "top_k-all", "lora-top1", "bitfit"]}
    for name, settings in varied.items():
        scores = pd.read_csv(project / f"reports/{name}.scores.csv", dtype={"setting": str})
        assert sorted(scores["setting"]) == sorted(settings), name
        assert (scores["ci_low"] <= scores["score"]).all() and (scores["score"] <= scores["ci_high"]).all()
        losses = pd.read_csv(project / f"reports/{name}.losses.csv")
        assert set(losses["cell"]) == {cell.key for cell in plans[name].cells}
        assert set(losses["split"]) == {"train", "dev"} and set(losses["epoch"]) == {1, 2}
    headline = json.loads((project / "reports/layers.json").read_text())["sst2"]["tiny"]["mean"]
    layers = pd.read_csv(project / "reports/layers.scores.csv", dtype={"setting": str})
    assert {row.setting: round(row.score, 4) for row in layers.itertuples()} == headline
    assert set(layers["series"]) == {"sst2 / tiny"}
    assert set(pd.read_csv(project / "reports/combo.scores.csv")["series"]) == {"sst2 / 1 tunable layers"}


@reads_the_build
def test_a_saved_multi_encoder_predicts_with_attention(built, monkeypatch):
    from layertune.heads import TextClassifier

    project, _ = built
    monkeypatch.chdir(project)  # its base models are named relative to the project ("models/tiny-a")
    model = TextClassifier.from_pretrained("data/04_models/combo/sst2-dme-1-1/model")
    predictions, attention = model.predict_with_attention(["a good film", "worst story ever"])
    assert set(predictions) <= {"negative", "positive"}
    assert [round(sum(row), 6) for row in attention] == [1.0, 1.0] and len(attention[0]) == 2


def test_a_bad_parameter_stops_the_plan_with_one_message_naming_its_key(tmp_path):
    """`kedro run --pipelines plan` (what the plan stage runs) on a bad params.yaml: one message naming the key, no
    traceback, nothing planned."""
    params = copy.deepcopy(PARAMS)
    params["studies"]["layers"]["seeds"] = [1, -1]
    project = make_project(tmp_path, params)
    done = subprocess.run([sys.executable, "-m", "kedro", "run", "--pipelines", "plan"], cwd=project, text=True,
                          env={**os.environ, **project_env(project)}, capture_output=True)
    assert done.returncode == 2
    assert "Traceback" not in done.stderr + done.stdout
    assert ("Error: params.yaml is invalid:\n  studies.layers.seeds[1]: Input should be greater than or equal to 0 "
            "(got -1)\n") in done.stderr
    assert not (project / "data").exists()  # checked before any node ran, and before the stage's lock was taken


def test_bad_local_data_stops_the_plan_with_one_error_line(tmp_path):
    """The plan's check of a study's local data (a label column that is not there) ends `kedro run --pipelines plan`
    as a bad parameter does: exit 2, one `Error:` line naming the key, no failed node, traceback or resume advice."""
    params = copy.deepcopy(PARAMS)
    project = make_project(tmp_path, params)
    (project / "reviews.csv").write_text("review,sentiment\n" + "".join(f"film {i},{'ab'[i % 2]}\n" for i in range(20)))
    params["studies"]["layers"]["tasks"] = {"reviews": {"path": "reviews.csv", "label": "stars"}}
    (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    done = subprocess.run([sys.executable, "-m", "kedro", "run", "--pipelines", "plan"], cwd=project, text=True,
                          env={**os.environ, **project_env(project)}, capture_output=True)
    output = done.stderr + done.stdout
    assert done.returncode == 2, output
    assert "Error: studies.layers.tasks.reviews.label: column 'stars' not in " in done.stderr
    assert [line for line in output.splitlines() if "Error" in line] == [done.stderr.strip().splitlines()[-1]]
    for noise in ("Traceback", "failed", "resume", "--from-nodes"):
        assert noise not in output, output
    assert not (project / "data" / "00_plan").exists()


def test_nested_yaml_aliases_stop_kedro_run_in_one_line_before_its_loader_reads_them(tmp_path):
    """Kedro's config loader would take hours over a params.yaml of nested aliases (9^8 values here): the stage's
    hook reads the file safely first, so `kedro run` ends in seconds with one `Error:` line, exit 2."""
    from tests.test_repro import LAUGHS

    project = make_project(tmp_path, copy.deepcopy(PARAMS))
    (project / "params.yaml").write_text("a: &a [1, 2, 3, 4, 5, 6, 7, 8, 9]\n" + LAUGHS)
    done = subprocess.run([sys.executable, "-m", "kedro", "run", "--pipelines", "plan"], cwd=project, text=True,
                          env={**os.environ, **project_env(project)}, capture_output=True, timeout=120)
    output = done.stderr + done.stdout
    assert done.returncode == 2, output
    assert "params.yaml: its aliases (*name) expand it to more than 100,000 values" in done.stderr
    assert "Traceback" not in output and not (project / "data").exists()


@reads_the_build
def test_an_unknown_study_is_one_message_naming_the_planned_ones(built):
    """Checked before the stage runs (Kedro's command line prints it as `Error: …`, no traceback)."""
    from click import ClickException

    project, _ = built
    for stage in ("prepare", "train"):
        with pytest.raises(ClickException, match=r"^unknown study 'nope' \(--params study=<name>\); studies: "
                                                 r"combo, layers, tags, tuning \(those of the last plan"):
            run(project, stage, study="nope")


def trained(log: str) -> list[str]:
    """The cells a `dvc repro` log says were trained."""
    return sorted(line.split("] ")[1].split()[0] for line in log.splitlines() if " trained" in line and "] " in line)


@pytest.mark.slow
@pytest.mark.integration  # DVC builds a tiny project three times (as tests/test_scale.py does): ~1 min
def test_a_base_model_changed_in_place_retrains_exactly_the_cells_built_on_it(tmp_path):
    """The plan hashes each base model's files into the plan of the cells built on it, and runs at every `dvc
    repro`: new weights for tiny-b, in place, retrain b's cell (and rerun the tokenize stage, whose cached states
    depend on them), never a's."""
    from layertune.testing import make_tiny_model

    two = {"a": "models/tiny-a", "b": "models/tiny-b"}
    params = {"download": {"mirror": "mirror"}, "studies": {"ablation": study("layers", ["sst2"], two, [1], [1])}}
    project = make_dvc_project(tmp_path, params)
    env = {**os.environ, **project_env(project)}

    def repro() -> str:
        done = subprocess.run(["dvc", "repro", "train@ablation"], cwd=project, env=env, capture_output=True,
                              text=True)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        return done.stdout + done.stderr

    assert trained(repro()) == ["sst2-a-1-1", "sst2-b-1-1"]
    unchanged = repro()
    assert [line for line in unchanged.splitlines() if line.startswith("Running stage")] == ["Running stage 'plan':"]
    make_tiny_model(project / "models" / "tiny-b", "bert", seed=2, extra_words=("really", "peter", "paris"))
    log = repro()
    assert "Running stage 'train@ablation'" in log and "Running stage 'tokenize@ablation'" in log
    assert "Stage 'prepare@ablation' didn't change" in log
    assert trained(log) == ["sst2-b-1-1"] and "ablation: 1 of 2 cell(s) to train" in log


@pytest.mark.slow
@pytest.mark.integration  # DVC builds a one-cell study, an experiment adds a seed, then a study: ~3 min
def test_dvc_builds_a_new_seed_and_a_new_study_from_params_alone_and_shows_the_plots(tmp_path):
    """A study's cells come from params.yaml through the plan: `dvc exp run -S` adding a seed trains just that cell;
    a study added to params.yaml, by editing it or with `-S`, is built by `dvc repro` with no other step.
    `dvc plots show` renders the declared plots."""
    params = {"download": {"mirror": "mirror"},
              "studies": {"layers": study("layers", ["sst2"], {"tiny": "models/tiny-a"}, [0], [1])}}
    project = make_dvc_project(tmp_path, params)
    env = {**os.environ, **project_env(project)}

    def dvc(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["dvc", *args], cwd=project, env=env, capture_output=True, text=True)

    def log(done: subprocess.CompletedProcess) -> str:
        assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
        return done.stdout + done.stderr

    log(dvc("repro"))
    plots = json.loads(dvc("plots", "show", "--json").stdout)["data"]
    assert set(plots) == {"reports/layers.scores.csv", "reports/layers.losses.csv"}
    for name, (x, y, rows) in {"reports/layers.scores.csv": ("setting", "score", 1),
                               "reports/layers.losses.csv": ("epoch", "loss", 4)}.items():
        [rendered] = plots[name]
        assert rendered["type"] == "vega" and "<DVC_METRIC" not in json.dumps(rendered["content"])  # all filled
        values = rendered["content"]["data"]["values"]
        assert len(values) == rows and all(x in row and y in row for row in values)
    assert [(row["epoch"], row["split"]) for row in plots["reports/layers.losses.csv"][0]["content"]["data"]["values"]] \
        == [("1", "train"), ("1", "dev"), ("2", "train"), ("2", "dev")]  # two epochs, dev scored after each
    html = dvc("plots", "show", "-o", str(tmp_path / "html"))
    assert html.returncode == 0 and "reports/layers.scores.csv" in (tmp_path / "html" / "index.html").read_text()
    # (A cell trained again gives the same tables, byte for byte: .ci/repro-check.sh, on two builds from scratch.)
    tables = {name: (project / "reports" / name).read_bytes() for name in ("layers.scores.csv", "layers.losses.csv")}

    seed = log(dvc("exp", "run", "-S", "studies.layers.seeds=[1,2]"))
    assert trained(seed) == ["sst2-tiny-0-2"] and "layers: 1 of 2 cell(s) to train" in seed
    assert {line.split(",")[2] for line in (project / "reports/layers.losses.csv").read_text().splitlines()[1:]} \
        == {"1", "2"}
    assert (project / "reports/layers.scores.csv").read_bytes() != tables["layers.scores.csv"]  # over two seeds now

    other = log(dvc("exp", "run", "-S", "+studies.other={report:{kind:layers},tasks:[sst2],"
                                        "encoders:{tiny:'models/tiny-a'},tunable_layers:[0],seeds:[1],"
                                        "training:{epochs:1}}"))
    assert trained(other) == ["sst2-tiny-0-1"] and "Running stage 'train@other'" in other
    assert "Running stage 'train@layers'" not in other  # nothing of the other study changed
    assert json.loads((project / "reports/other.json").read_text())["sst2"]["tiny"]["mean"].keys() == {"0"}


def test_each_trained_cells_line_says_the_time_left_for_its_study_by_what_each_setting_costs():
    from layertune.specs import CellSpec, CorpusSpec, EncoderSpec
    from layertune.study import StudyCell
    from pipelines.train.nodes import time_left

    spec = CellSpec(corpus=CorpusSpec(task="sst2"), encoders=[EncoderSpec(model="m")])

    def cell(task, layers, seed):
        return StudyCell(study="ablation", task=task, encoder="m", tunable_layers=layers, seed=seed, spec=spec)

    grid = [cell(task, layers, seed) for task in ("sst2", "stsb") for layers in (0, 1, "all") for seed in (1, 2)]
    cost = {("sst2", 0): 10.0, ("sst2", 1): 20.0, ("sst2", "all"): 50.0,
            ("stsb", 0): 20.0, ("stsb", 1): 60.0, ("stsb", "all"): 150.0}
    took = [(c, cost[c.task, c.tunable_layers]) for c in grid[:9]]  # sst2's six cells, stsb's K = 0 and one K = 1

    # stsb-1's second seed as its first (60 s); stsb's all as sst2's all (50 s) times stsb's cost against sst2's on
    # the most layers both have trained (1: 60 s against 20): 150 s each. One process: wall time as the cells' sum.
    assert time_left(260.0, took, grid[9:], "ablation") == "; about 6.0 min left for ablation"  # 360 s
    # (the mean cell so far, 29 s, would have said 1.4 min; the mean ratio over K = 0 and 1, 2.5x, 5.2 min)
    assert time_left(130.0, took, grid[9:], "ablation") == "; about 3.0 min left for ablation"  # two jobs at once
    # the study's first task: a setting not trained anywhere yet costs at least the costliest so far
    assert time_left(20.0, took[:2], grid[2:6], "ablation") == "; at least 40 s left for ablation"
    assert time_left(260.0, took, [], "ner") == "; none left for ner"
    untimed = [(c, None) for c, _ in took]  # a scheduler that reports no starts: the mean cell's wall time
    assert time_left(90.0, untimed, grid[9:], "ner") == "; about 30 s left for ner"


def test_a_setting_no_task_has_trained_is_estimated_by_its_layers_and_an_unstarted_task_by_its_text():
    """On a study's first task a top-K setting not trained yet costs its layers at the task's per-layer cost so far
    (not only 'at least' the costliest so far); a task none of whose cells has trained costs the others' times as
    much as its training text is larger."""
    from layertune.specs import CellSpec, CorpusSpec, EncoderSpec
    from layertune.study import StudyCell
    from pipelines.train.nodes import time_left, training_text_size

    spec = CellSpec(corpus=CorpusSpec(task="sst2"), encoders=[EncoderSpec(model="m")])

    def cell(task, layers, seed=1):
        return StudyCell(study="ablation", task=task, encoder="m", tunable_layers=layers, seed=seed, spec=spec)

    took = [(cell("sst2", 0), 5.0), (cell("sst2", 1), 10.0), (cell("sst2", 2), 22.0)]  # 10 and 11 s a layer
    assert time_left(37.0, took, [cell("sst2", 4)], "ablation") == "; about 42 s left for ablation"  # 4 x 10.5 s
    assert time_left(37.0, took, [cell("sst2", 1, seed=2)], "ablation") == "; about 10 s left for ablation"
    # with no layered cell timed, the costliest so far is a bound again
    assert time_left(5.0, took[:1], [cell("sst2", 3)], "ablation") == "; at least 5 s left for ablation"
    sizes = {"sst2": 1_000, "stsb": 2_500}
    assert time_left(37.0, took, [cell("stsb", 2)], "ablation", sizes) == "; about 55 s left for ablation"
    assert time_left(37.0, took, [cell("stsb", 2)], "ablation") == "; about 22 s left for ablation"  # as sst2's

    class Tagged:  # a corpus's text columns as training_text_size reads them: words of a tagged sentence joined
        text_columns = ("tokens",)
        train = {"tokens": [["EU", "rejects"], ["Peter"]]}

    assert training_text_size(Tagged()) == len("EU rejects") + len("Peter")


def test_the_committed_dvc_lock_holds_the_stages_of_dvc_yaml_and_no_other():
    """The committed build: an entry per stage. DVC keeps the entry of a stage that dvc.yaml no longer has, and every
    `dvc` command parses the whole file: the 150 entries of earlier designs it held cost about 1 s per stage of every
    build."""
    listed = subprocess.run(["dvc", "stage", "list", "--name-only"], cwd=ROOT, capture_output=True, text=True)
    assert listed.returncode == 0, listed.stderr
    locked, stages = set(yaml.safe_load((ROOT / "dvc.lock").read_text())["stages"]), set(listed.stdout.split())
    assert not locked - stages, f"dvc.lock holds stages that dvc.yaml does not: remove them: {sorted(locked - stages)}"
    assert not stages - locked, f"stages never built: build them and commit dvc.lock: {sorted(stages - locked)}"


def test_the_committed_reports_are_those_of_the_build_dvc_lock_records():
    """Every output committed with the code (``cache: false``: the reports, their tables and figures) is, byte for
    byte, what the build that dvc.lock records wrote: a report from another build (another machine's rounds, a
    rebuild committed without its lock) or edited by hand fails here, by DVC's own hashes."""
    from dvc.repo import Repo

    with Repo(str(ROOT)) as repo:
        committed = [(stage.addressing, out) for stage in repo.index.stages for out in stage.outs if not out.use_cache]
        assert committed, "dvc.yaml commits no output"
        changed = [f"{name}: {out.def_path}" for name, out in committed if out.changed_checksum()]
    assert not changed, f"not what the build in dvc.lock wrote (commit the build's dvc.lock with them): {changed}"


def test_kedro_called_by_hand_leaves_pyproject_toml_as_written(tmp_path):
    """kedro-telemetry, unless told no, writes a project id into pyproject.toml the first time `kedro` runs in a
    project (and sends usage data): the project's `.telemetry` tells it no, whatever the environment says."""
    project = make_project(tmp_path / "project", {"download": {"mirror": "mirror"}, "studies": {
        "layers": study("layers", ["sst2"], {"tiny": "models/tiny-a"}, [0], [1])}})
    written = (project / "pyproject.toml").read_bytes()
    env = {key: value for key, value in os.environ.items() if key not in ("KEDRO_DISABLE_TELEMETRY", "DO_NOT_TRACK")}
    done = subprocess.run([sys.executable, "-m", "kedro", "registry", "list"], cwd=project, capture_output=True,
                          text=True, env={**env, **project_env(project)}, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "train" in done.stdout and (project / "pyproject.toml").read_bytes() == written
