"""`layertune repro`'s checks before any work: what `--ray` needs of the workspace, the DVC remote and the MLflow
store is refused with a message saying what to do (the cluster builds themselves are in test_ray_cluster.py)."""

import subprocess
from pathlib import Path

import pytest

from pipelines import ray_cluster
from pipelines.repro import main as repro
from tests.projects import make_dvc_project, study

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    return make_dvc_project(tmp_path_factory.mktemp("project"), {"download": {"mirror": "mirror"}, "studies": {
        "ablation": study("layers", ["sst2"], {"tiny": "models/tiny-a"}, [0], [1])}})


def test_layertune_repro_is_the_pipelines_command_under_the_library_cli():
    shown = subprocess.run(["layertune", "repro", "--help"], capture_output=True, text=True, check=True).stdout
    assert "--ray [ADDRESS]" in shown and "--jobs" in shown


def test_a_changed_tracked_file_is_refused_naming_it(project, monkeypatch):
    monkeypatch.chdir(project)
    params = project / "params.yaml"
    original = params.read_text()
    (project / "dvc.lock").write_text("schema: '2.0'\n")  # dvc.lock is sent to the nodes: never in the way
    ray_cluster.commit_is_clean()
    params.write_text(original + "# edited\n")
    try:
        with pytest.raises(ValueError, match="these files differ from it: params.yaml; commit them"):
            ray_cluster.commit_is_clean()
    finally:
        params.write_text(original)
        (project / "dvc.lock").unlink()


def test_the_default_remote_goes_to_the_nodes_with_its_path_resolved(project):
    config = ray_cluster.remote_config(project)
    assert config.startswith("[core]\n    remote = shared\n['remote \"shared\"']\n")
    assert f"url = {(project / '..' / 'layertune-dvc-remote').resolve()}\n" in config  # relative to .dvc/ in git


def test_without_a_default_remote_the_build_is_refused(tmp_path):
    subprocess.run(["git", "init", "--quiet"], cwd=tmp_path, check=True)
    subprocess.run(["dvc", "init", "--quiet"], cwd=tmp_path, check=True)
    with pytest.raises(ValueError, match="--ray needs a default DVC remote, which every node reaches"):
        ray_cluster.remote_config(tmp_path)


def test_a_store_on_this_machine_is_for_nodes_of_this_machine_only(monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:///mlflow.db")
    assert ray_cluster.reachable_tracking_uri([]) == f"sqlite:///{Path.cwd() / 'mlflow.db'}"  # cells run elsewhere
    for uri in ("sqlite:///mlflow.db", "file:///srv/mlruns", "http://127.0.0.1:5000", "http://localhost:5000"):
        monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
        with pytest.raises(ValueError, match="the cluster's nodes gpu-7 cannot reach: set MLFLOW_TRACKING_URI"):
            ray_cluster.reachable_tracking_uri(["gpu-7"])
    for uri in ("http://mlflow.team:5000", "postgresql://mlflow@db.team/mlflow", "sqlite:////srv/m.db"):
        monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
        assert ray_cluster.reachable_tracking_uri([] if uri.startswith("sqlite") else ["gpu-7"]) == uri


def test_an_untracked_file_among_the_code_is_refused_and_elsewhere_ignored(project, monkeypatch):
    monkeypatch.chdir(project)
    (project / "notes.txt").write_text("mine")
    (project / "pipelines" / "extra.py").write_text("X = 1\n")
    try:
        with pytest.raises(ValueError, match="differ from it: pipelines/extra.py; commit them"):
            ray_cluster.commit_is_clean()
    finally:
        (project / "pipelines" / "extra.py").unlink()
    ray_cluster.commit_is_clean()
    (project / "notes.txt").unlink()


@pytest.mark.parametrize("arguments, message", [
    (["--cpus-per-cell", "2"], "--cpus-per-cell is an option of --ray"),
    (["--jobs", "0"], "--jobs must be at least 1; got 0"),
    (["--ray", "--cpus-per-cell", "0"], "--cpus-per-cell must be at least 1; got 0"),
    (["nope"], "no study 'nope' in params.yaml; its studies: ablation"),
])
def test_bad_options_are_refused_before_any_work(project, monkeypatch, capsys, arguments, message):
    monkeypatch.chdir(project)
    assert repro(arguments) == 2
    assert message in capsys.readouterr().err
    assert not (project / "data").exists()


def test_the_slurm_example_is_valid_bash():
    subprocess.run(["bash", "-n", str(ROOT / "examples" / "slurm" / "layertune-ray.sbatch")], check=True)
