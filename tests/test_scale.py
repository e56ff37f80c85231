"""Beyond one process: cells trained several at a time give the serial build's results; a build is shared through a
DVC remote, so another machine that pulls it trains only the cells it adds; cells set aside and planned again are not
trained again; a team MLflow server on PostgreSQL records every cell; a study trained by two processes at once is one
folder per cell, one run each.

Tiny studies (the repository's own dvc.yaml, tiny models, a toy data mirror) in git repositories with DVC set up."""

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.projects import built_once, make_dvc_project, study

TINY = {"download": {"mirror": "mirror"}, "studies": {
    "ablation": study("layers", ["sst2"], {"tiny": "models/tiny-a"}, [0, 2], [1, 2]),
    "ner": study("ner", ["conll2003"], {"tiny": "models/tiny-a"}, [0, 1], [1, 2]),
    "multi_encoder": study("encoders", ["sst2"], {"a": "models/tiny-a", "b": "models/tiny-b",
                                                  "dme": {"combine": "dme", "members": ["a", "b"]}}, [1], [1, 2]),
}}
CELLS = 4 + 4 + 6
# Each builds the tiny project with DVC. One worker runs them in turn: the first builds the shared origin, which the
# others would wait for, idle, on another worker.
pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.xdist_group("scale")]


def env_of(project: Path) -> dict:
    return {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{project / 'mlflow.db'}", "LAYERTUNE_DATA_MIRROR": "",
            "TQDM_DISABLE": "1"}


def sh(project: Path, *command: str, env: dict | None = None) -> str:
    done = subprocess.run(command, cwd=project, env={**env_of(project), **(env or {})}, capture_output=True,
                          text=True)
    assert done.returncode == 0, f"{' '.join(command)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout + done.stderr


def clone(origin: Path, folder: Path, remote: Path | None = None) -> Path:
    subprocess.run(["git", "clone", "--quiet", str(origin), str(folder)], check=True)
    if remote is not None:
        sh(folder, "dvc", "remote", "modify", "--local", "shared", "url", str(remote))
    return folder


def cell_runs(project: Path) -> list[tuple[str, str]]:
    """(run name, status) of every cell's run, the builds' parent runs aside."""
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{project / 'mlflow.db'}")
    runs = [run for experiment in client.search_experiments() for run in client.search_runs([experiment.experiment_id])]
    return sorted((run.info.run_name, run.info.status) for run in runs if not run.info.run_name.startswith("build "))


def reports(project: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted((project / "reports").glob("*.json"))}


def trained(log: str) -> list[str]:
    """The cells a build's log says were trained."""
    return sorted(line.split("] ")[1].split()[0] for line in log.splitlines() if " trained" in line and "] " in line)


@pytest.fixture(scope="session")
def origin(tmp_path_factory):
    """The team's repository, and its serial build (in a clone) to compare with: built once per test run, whichever
    worker asks first. Tests read both; what they change is a clone or a copy."""
    def build(folder: Path) -> None:
        make_dvc_project(folder / "origin", TINY)
        sh(clone(folder / "origin", folder / "serial"), "dvc", "repro")

    folder = built_once(tmp_path_factory, "scale", build)
    return folder / "origin", folder / "serial"


def copy_of(built: Path, folder: Path) -> Path:
    """A copy of a built clone (its DVC cache and outputs; its MLflow store left behind): another machine that ran
    the same build, without building it again."""
    shutil.copytree(built, folder, symlinks=True)
    (folder / "mlflow.db").unlink(missing_ok=True)  # its runs name the original's folders; this store starts empty
    return folder


def untrained_copy_of(built: Path, folder: Path, *study_names: str) -> Path:
    """`copy_of` a built clone with the cells and reports of ``study_names`` gone (their tokenized data kept): a
    machine where only their training is left to do, without building the stages before it again."""
    machine = copy_of(built, folder)
    for study_name in study_names:
        shutil.rmtree(machine / "data" / "04_models" / study_name)
        shutil.rmtree(machine / "reports" / study_name)  # its details, tables and figures
        for report in (machine / "reports").glob(f"{study_name}.*"):  # .md, .json and the plots' tables
            report.unlink()
    return machine


def test_two_workers_build_exactly_what_a_serial_build_does(origin, tmp_path):
    _, serial = origin
    # The serial build with every cell and report gone: --jobs changes how cells train, not the data they read.
    parallel = untrained_copy_of(serial, tmp_path / "parallel", *TINY["studies"])
    log = sh(parallel, "layertune", "repro", "--jobs", "2")
    assert log.count("cell(s) to train, 2 at a time") == 3 and len(trained(log)) == CELLS
    assert reports(parallel) == reports(serial) and len(reports(parallel)) == 3
    # Without a study named, study by study, the fewest cells first (a tie in params.yaml's order): each report
    # lands as its study's cells are trained, where a plain `dvc repro` writes them all at its end. The stages
    # before train are built already: DVC names each as it skips it ("Stage '<name>' didn't change, skipping").
    stages = [(line.split("'")[1], line.startswith("Running")) for line in log.splitlines()
              if line.startswith(("Running stage", "Stage '"))]  # (stage, whether it ran)
    skipped, ran = ("prepare", "tokenize"), ("train", "evaluate", "aggregate")
    assert [stage for stage in stages if stage[0] != "plan"] == [("download", False)] + [
        (f"{stage}@{name}", stage in ran) for name in ("ablation", "ner", "multi_encoder") for stage in skipped + ran]
    assert "none left for multi_encoder" in log and "left for ablation" in log  # each cell's line: the time left
    locked = {path: yaml.safe_load((path / "dvc.lock").read_text())["stages"] for path in (parallel, serial)}
    assert {name: (stage["cmd"], stage.get("params")) for name, stage in locked[parallel].items()} == \
        {name: (stage["cmd"], stage.get("params")) for name, stage in locked[serial].items()}
    runs = cell_runs(parallel)
    assert len(runs) == CELLS and {status for _, status in runs} == {"FINISHED"}
    assert sh(parallel, "dvc", "status").split() == ["plan:", "always", "changed"]  # the plan runs every time


def test_a_machine_that_pulled_the_build_trains_only_the_cells_it_adds(origin, tmp_path):
    """Machine A builds and pushes to the shared remote; machine B, a fresh clone, pulls and adds a seed with
    `dvc exp run -S`: only the new seed's cells train there, and B's MLflow shows the pulled cells too (logged from
    their folders). Seeds removed, then added back, are set aside and taken back on B: nothing trains."""
    _, serial = origin
    remote = tmp_path / "remote"
    a = copy_of(serial, tmp_path / "a")  # machine A's build: the serial one
    sh(a, "dvc", "remote", "modify", "--local", "shared", "url", str(remote))
    assert sh(a, "dvc", "status").split() == ["plan:", "always", "changed"]
    sh(a, "git", "add", "dvc.lock", "reports")  # as this repository commits its build (reports: cache: false)
    sh(a, "git", "-c", "user.name=a", "-c", "user.email=a@example.com", "commit", "--quiet", "-m", "built")
    sh(a, "dvc", "push")
    b = clone(a, tmp_path / "b", remote)
    sh(b, "dvc", "pull")
    assert sh(b, "dvc", "status").split() == ["plan:", "always", "changed"]  # B holds A's build
    log = sh(b, "dvc", "exp", "run", "-S", "studies.ablation.seeds=[1,2,3]")
    assert trained(log) == ["sst2-tiny-0-3", "sst2-tiny-2-3"] and "ablation: 2 of 6 cell(s) to train" in log
    runs = cell_runs(b)
    assert {status for _, status in runs} == {"FINISHED"}
    assert sorted(name for name, _ in runs) == sorted(f"sst2-tiny-{k}-{seed}" for k in (0, 2) for seed in (1, 2, 3))
    three = reports(b)["ablation.json"]

    log = sh(b, "dvc", "exp", "run", "-S", "studies.ablation.seeds=[1]")
    assert trained(log) == [] and sorted(p.name for p in (b / "data/04_models/ablation").iterdir()) == [
        "sst2-tiny-0-1", "sst2-tiny-2-1"]  # the stage's output: the planned cells alone
    log = sh(b, "dvc", "exp", "run", "-S", "studies.ablation.seeds=[1,2,3]")
    assert trained(log) == [] and reports(b)["ablation.json"] == three  # set aside, then taken back


def rest(url: str, endpoint: str, body: dict | None = None, **query) -> dict:
    """MLflow's REST API: a GET with ``query``, or a POST of ``body``."""
    import urllib.parse
    import urllib.request

    request = urllib.request.Request(f"{url}/api/2.0/mlflow/{endpoint}?{urllib.parse.urlencode(query)}",
                                     data=body and json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request) as answer:
        return json.load(answer)


def test_a_team_mlflow_server_on_postgresql_records_every_cell(origin, tmp_path):
    """`mlflow server` over a real PostgreSQL on 127.0.0.1: every cell of a study is a FINISHED run there, its
    parameters and per-epoch metrics answer through the REST API, and the experiment opens on its runs table."""
    from tests.team_server import team_server

    _, serial = origin
    machine = untrained_copy_of(serial, tmp_path / "machine", "ablation")
    with team_server() as url:
        log = sh(machine, "dvc", "repro", "aggregate@ablation", env={"MLFLOW_TRACKING_URI": url})
        assert trained(log) == ["sst2-tiny-0-1", "sst2-tiny-0-2", "sst2-tiny-2-1", "sst2-tiny-2-2"]
        experiment = rest(url, "experiments/get-by-name", experiment_name="layertune-ablation")["experiment"]
        assert {"key": "mlflow.experimentKind", "value": "custom_model_development"} in experiment["tags"]
        runs = rest(url, "runs/search", {"experiment_ids": [experiment["experiment_id"]]})["runs"]
        [build] = [run for run in runs if run["info"]["run_name"].startswith("build ")]
        runs = [run for run in runs if run is not build]
        assert sorted(run["info"]["run_name"] for run in runs) == [
            "sst2-tiny-0-1", "sst2-tiny-0-2", "sst2-tiny-2-1", "sst2-tiny-2-2"]
        assert {run["info"]["status"] for run in runs} == {"FINISHED"}
        for run in runs:
            params = {p["key"]: p["value"] for p in run["data"]["params"]}
            assert f"sst2-tiny-{params['tunable_layers']}-{params['seed']}" == run["info"]["run_name"]
            losses = rest(url, "metrics/get-history", run_id=run["info"]["run_id"], metric_key="train_loss")
            assert sorted(m["step"] for m in losses["metrics"]) == [1, 2]  # one value per epoch
    assert not (machine / "mlflow.db").exists()  # nothing went to the embedded default
    assert reports(machine)["ablation.json"] == reports(serial)["ablation.json"]


def test_a_study_trained_by_two_processes_is_one_folder_and_one_run_per_cell(origin, tmp_path):
    """A study's train stage run under `accelerate launch --num_processes 2` as docs/pipeline.md shows (each cell
    data-parallel over both processes), then recorded with `dvc commit`: one folder per cell, one FINISHED MLflow
    run each, and DVC sees the stage as built."""
    from tests.test_data_parallel import launch

    _, serial = origin
    machine = untrained_copy_of(serial, tmp_path / "machine", "ablation")
    launch("-m", "kedro", "run", "--pipelines", "train", "--params", "study=ablation", cwd=machine,
           env=env_of(machine))
    sh(machine, "dvc", "commit", "--force", "train@ablation")
    assert "train@ablation" not in sh(machine, "dvc", "status", "train@ablation")
    cells = ["sst2-tiny-0-1", "sst2-tiny-0-2", "sst2-tiny-2-1", "sst2-tiny-2-2"]
    assert sorted(p.name for p in (machine / "data" / "04_models" / "ablation").iterdir()) == cells
    assert cell_runs(machine) == [(cell, "FINISHED") for cell in cells]


def test_a_folder_that_does_not_prove_its_cell_trains_again_and_the_report_is_a_clean_builds(origin, tmp_path):
    """Hostile but honest hands on a built study (`pipelines.trained_cells`): another cell's files under a cell's
    build record, a cell without its weights (a copy or pull cut short), a set-aside folder holding another cell's
    files; then a cell folder deleted. Each is found, set aside whole with a warning naming it, and trained again:
    the reports are the clean build's, byte for byte, and MLflow holds one FINISHED run per cell."""
    _, serial = origin
    b = copy_of(serial, tmp_path / "b")
    models = b / "data" / "04_models" / "ablation"

    def files_of(source: Path, target: Path) -> None:  # target's files replaced by source's, its build record kept
        for path in target.iterdir():
            if path.name != "build.json":
                shutil.rmtree(path) if path.is_dir() else path.unlink()
        for path in source.iterdir():
            if path.name != "build.json":
                (shutil.copytree if path.is_dir() else shutil.copy)(path, target / path.name)

    files_of(models / "sst2-tiny-0-2", models / "sst2-tiny-0-1")
    (models / "sst2-tiny-2-1" / "model" / "model.safetensors").unlink()
    retired = b / "data" / "04_models" / ".retired" / "ablation"
    retired.mkdir(parents=True)
    shutil.move(models / "sst2-tiny-2-2", retired / "sst2-tiny-2-2")  # as a removed seed is set aside
    files_of(models / "sst2-tiny-0-2", retired / "sst2-tiny-2-2")
    log = sh(b, "dvc", "repro")
    assert trained(log) == ["sst2-tiny-0-1", "sst2-tiny-2-1", "sst2-tiny-2-2"]
    for cell, problem in (("0-1", "its digest differs"), ("2-1", "model/model.safetensors is missing"),
                          ("2-2", "its digest differs")):
        [warning] = [line for line in log.splitlines() if f"does not prove it holds cell sst2-tiny-{cell}" in line]
        assert problem in warning and "set aside, untouched, in" in warning
    assert sorted(p.name for p in (retired / ".unverified").iterdir()) == [
        "sst2-tiny-0-1-1", "sst2-tiny-2-1-1", "sst2-tiny-2-2-1"]
    assert reports(b) == reports(serial)

    shutil.rmtree(models / "sst2-tiny-0-2")  # its cell trains again for the same build key
    assert trained(sh(b, "dvc", "repro")) == ["sst2-tiny-0-2"] and reports(b) == reports(serial)
    runs = [run for run in cell_runs(b) if run[0].startswith("sst2-tiny-")]
    assert sorted(name for name, status in runs if status == "FINISHED") == [
        f"sst2-tiny-{k}-{seed}" for k in (0, 2) for seed in (1, 2)]


def test_two_cell_folders_swapped_whole_are_set_aside_and_the_report_is_a_clean_builds(origin, tmp_path):
    """Issue 57: the folders of two cells exchanged whole (each with its own cell.json and build record) were each
    taken for an older build of the cell at its place, retrained over, and deleted without a word. Both are set
    aside with a warning naming the cell each holds, both cells train again, and the reports are the clean build's.
    A note left in a third cell's folder is moved aside: that cell stays built, and the output is a clean build's."""
    _, serial = origin
    b = copy_of(serial, tmp_path / "b")
    models = b / "data" / "04_models" / "ablation"
    os.replace(models / "sst2-tiny-0-1", models / "swap")
    os.replace(models / "sst2-tiny-0-2", models / "sst2-tiny-0-1")
    os.replace(models / "swap", models / "sst2-tiny-0-2")
    (models / "sst2-tiny-2-1" / "notes.txt").write_text("mine")
    log = sh(b, "dvc", "repro")
    assert trained(log) == ["sst2-tiny-0-1", "sst2-tiny-0-2"]
    for cell, other in (("0-1", "0-2"), ("0-2", "0-1")):
        [warning] = [line for line in log.splitlines() if f"does not prove it holds cell sst2-tiny-{cell} " in line]
        assert f"(it holds the build of cell sst2-tiny-{other}, not of sst2-tiny-{cell})" in warning
    unverified = b / "data" / "04_models" / ".retired" / "ablation" / ".unverified"
    assert sorted(p.name for p in unverified.iterdir()) == ["sst2-tiny-0-1-1", "sst2-tiny-0-2-1", "sst2-tiny-2-1-1"]
    for cell, other in (("0-1", "0-2"), ("0-2", "0-1")):  # each kept whole, as it was
        assert (unverified / f"sst2-tiny-{cell}-1" / "model" / "model.safetensors").read_bytes() == \
            (serial / "data" / "04_models" / "ablation" / f"sst2-tiny-{other}" / "model" /
             "model.safetensors").read_bytes()
    assert (unverified / "sst2-tiny-2-1-1" / "notes.txt").read_text() == "mine"
    assert not (models / "sst2-tiny-2-1" / "notes.txt").exists()
    assert reports(b) == reports(serial)
    assert sh(b, "dvc", "status").split() == ["plan:", "always", "changed"]
