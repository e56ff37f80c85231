"""Beyond one process: cells trained several at a time give the serial build's results; cells trained on other
machines are shared through a DVC remote and its run-cache, so a third machine builds the reports training nothing;
a team MLflow server on PostgreSQL records every cell; one cell trained by two processes is one output, one run.

Tiny studies (the repository's own dvc.yaml, tiny models, a toy data mirror) in git repositories with DVC set up."""

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.projects import make_dvc_project, study

TINY = {"download": {"mirror": "mirror"}, "studies": {
    "ablation": study("layers", ["sst2"], {"tiny": "models/tiny-a"}, [0, 2], [1, 2]),
    "ner": study("ner", ["conll2003"], {"tiny": "models/tiny-a"}, [0, 1], [1, 2]),
    "multi_encoder": study("encoders", ["sst2"], {"a": "models/tiny-a", "b": "models/tiny-b",
                                                  "dme": {"combine": "dme", "members": ["a", "b"]}}, [1], [1, 2]),
}}
CELLS = 4 + 4 + 6


def env_of(project: Path) -> dict:
    return {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{project / 'mlflow.db'}", "LAYERTUNE_DATA_MIRROR": "",
            "LAYERTUNE_WARM_IDLE": "10", "TQDM_DISABLE": "1"}


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


def finished_runs(project: Path) -> list[tuple[str, str]]:
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{project / 'mlflow.db'}")
    runs = [run for experiment in client.search_experiments() for run in client.search_runs([experiment.experiment_id])]
    return sorted((run.info.run_name, run.info.status) for run in runs)


def reports(project: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted((project / "reports").glob("*.json"))}


@pytest.fixture(scope="module")
def origin(tmp_path_factory):
    """The team's repository, and its serial build (in a clone) to compare with."""
    folder = make_dvc_project(tmp_path_factory.mktemp("origin"), TINY)
    serial = clone(folder, tmp_path_factory.mktemp("serial") / "repo")
    sh(serial, "dvc", "repro")
    return folder, serial


@pytest.mark.integration
def test_two_workers_build_exactly_what_a_serial_build_does(origin, tmp_path):
    repository, serial = origin
    parallel = clone(repository, tmp_path / "parallel")
    log = sh(parallel, "layertune", "repro", "--jobs", "2")
    assert f"{CELLS} cell(s) to train, 2 at a time" in log
    assert reports(parallel) == reports(serial) and len(reports(parallel)) == 3
    runs = finished_runs(parallel)
    assert len(runs) == CELLS and {status for _, status in runs} == {"FINISHED"}
    assert sh(parallel, "dvc", "status").split() == ["plan:", "always", "changed"]  # the plan runs every time


@pytest.mark.integration
def test_cells_trained_on_two_machines_build_the_reports_on_a_third(origin, tmp_path):
    """A trains the seed-1 cells, B the seed-2 cells; each pushes its outputs and run-cache to the shared remote.
    On C, `dvc repro --pull` fetches the run-cache and restores every cell from it instead of training it."""
    repository, serial = origin
    remote = tmp_path / "remote"
    for name, seed in (("a", 1), ("b", 2)):
        machine = clone(repository, tmp_path / name, remote)
        sh(machine, "dvc", "repro", "--glob", f"train-*-{seed}")
        sh(machine, "dvc", "push", "--run-cache")
    third = clone(repository, tmp_path / "c", remote)
    log = sh(third, "dvc", "repro", "--pull")
    restored = {line.split("'")[1] for line in log.splitlines() if "is cached - skipping run" in line}
    assert len({name for name in restored if name.startswith("train-")}) == CELLS
    assert "Running stage 'train-" not in log  # not one cell trained here
    # nothing trained here, yet MLflow shows every restored cell: its folder, logged by the evaluate stage
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{third / 'mlflow.db'}")
    runs = [run for experiment in client.search_experiments() for run in client.search_runs([experiment.experiment_id])]
    assert sorted(run.info.status for run in runs) == ["FINISHED"] * CELLS
    assert all("layertune.logged_from" in run.data.tags for run in runs)
    assert reports(third) == reports(serial)
    assert sh(third, "dvc", "status").split() == ["plan:", "always", "changed"]  # the plan runs every time


def rest(url: str, endpoint: str, body: dict | None = None, **query) -> dict:
    """MLflow's REST API: a GET with ``query``, or a POST of ``body``."""
    import urllib.parse
    import urllib.request

    request = urllib.request.Request(f"{url}/api/2.0/mlflow/{endpoint}?{urllib.parse.urlencode(query)}",
                                     data=body and json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request) as answer:
        return json.load(answer)


@pytest.mark.integration
def test_a_team_mlflow_server_on_postgresql_records_every_cell(origin, tmp_path):
    """`mlflow server` over a real PostgreSQL on 127.0.0.1: every cell of a study is a FINISHED run there, its
    parameters and per-epoch metrics answer through the REST API, and the experiment opens on its runs table."""
    from tests.team_server import team_server

    repository, serial = origin
    machine = clone(repository, tmp_path / "machine")
    with team_server() as url:
        sh(machine, "dvc", "repro", "aggregate@ablation", env={"MLFLOW_TRACKING_URI": url})
        experiment = rest(url, "experiments/get-by-name", experiment_name="layertune-ablation")["experiment"]
        assert {"key": "mlflow.experimentKind", "value": "custom_model_development"} in experiment["tags"]
        runs = rest(url, "runs/search", {"experiment_ids": [experiment["experiment_id"]]})["runs"]
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


@pytest.mark.integration
def test_one_cell_trained_by_two_processes_is_one_folder_and_one_run(origin, tmp_path):
    """A cell run under `accelerate launch --num_processes 2` as docs/pipeline.md shows, then recorded with
    `dvc commit`: one cell folder, one FINISHED MLflow run, and DVC sees the stage as built."""
    from tests.test_data_parallel import launch

    repository, _ = origin
    machine = clone(repository, tmp_path / "machine")
    sh(machine, "dvc", "repro", "tokenize@ablation")
    stage, cell = "train-ablation@sst2-tiny-2-1", "sst2-tiny-2-1"
    launch("-m", "kedro", "run", "--pipelines", "train", "--params", f"study=ablation,cell={cell}", cwd=machine,
           env=env_of(machine))
    sh(machine, "dvc", "commit", "--force", stage)
    assert stage not in sh(machine, "dvc", "status", stage)
    folders = sorted(p.name for p in (machine / "data" / "04_models" / "ablation").iterdir())
    assert folders == [cell]
    assert finished_runs(machine) == [(cell, "FINISHED")]
