"""`layertune repro --ray`: a study's cells as tasks on a Ray cluster, from its one train stage, simulated on this
machine with `ray.cluster_utils.Cluster` (a head that trains nothing and two worker nodes, each declaring a GPU: a
cell takes one) and the embedded MLflow store. The studies are a layer study and a study of tuning methods on tiny
models and a toy data mirror, compared with their serial `dvc repro`.

Slow (a serial build, one up to the long-celled study's tokenized data, five cluster builds from copies of them);
one xdist worker runs them all, in order."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.projects import make_dvc_project, study
from tests.test_scale import clone, copy_of, reports, sh, trained, untrained_copy_of

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.xdist_group("ray_cluster")]
STUDIES = ("ablation", "methods")


# The ci profile's two study kinds on tiny models (what runs where is the question, not what a real model learns): a
# layer study whose two cells train for seconds, so that a node can be lost while both train, and a study of tuning
# methods (peft's LoRA, BitFit) whose models travel through Ray's object store.
CLUSTER_STUDIES = {"download": {"mirror": "mirror"}, "studies": {
    "ablation": study("layers", ["sst2"], {"tiny": "models/tiny-a"}, [0, 2], [1],
                      per_tunable_layers={0: {"epochs": 150}}),
    "methods": {**study("methods", ["sst2"], {"tiny": "models/tiny-a"}, None, [1]), "tunable_layers": None,
                "methods": {"top_k-0": {"tunable_layers": 0},
                            "lora-top2": {"method": {"name": "lora", "r": 2}, "tunable_layers": 2,
                                          "learning_rate": 3.0e-3},
                            "bitfit": {"method": "bitfit", "tunable_layers": "all", "learning_rate": 3.0e-3}}},
}}
CLUSTER_STUDIES["studies"]["ablation"]["training"]["epochs"] = 16  # about 10 s a cell, each setting


@pytest.fixture(scope="module")
def origin(tmp_path_factory):
    """The team's repository with the two studies above, and their serial build (in a clone)."""
    folder = make_dvc_project(tmp_path_factory.mktemp("origin"), CLUSTER_STUDIES)
    serial = clone(folder, tmp_path_factory.mktemp("serial") / "repo")
    started = time.monotonic()
    sh(serial, "dvc", "repro", env=ENV)
    print(f"serial build: {time.monotonic() - started:.1f} s")
    return folder, serial


ENV = {"RAY_USAGE_STATS_ENABLED": "0", "LAYERTUNE_DATA_MIRROR": ""}


@pytest.fixture(scope="module")
def cluster():
    """A head (no CPU: it trains nothing) and two worker nodes of two CPUs and a GPU each."""
    os.environ.update({"RAY_USAGE_STATS_ENABLED": "0"})
    from ray.cluster_utils import Cluster

    # A lost node is noticed within about 3 s instead of Ray's default 15 s or more (health checks every 3 s, 5 missed)
    checks = {"health_check_period_ms": 1000, "health_check_timeout_ms": 1000, "health_check_failure_threshold": 3}
    simulated = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False,
                                                              "_system_config": checks})
    for _ in range(2):
        simulated.add_node(num_cpus=2, num_gpus=1)
    simulated.wait_for_nodes()
    yield simulated
    simulated.shutdown()


def mlflow_runs(project: Path) -> list:
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{project / 'mlflow.db'}")
    return [run for experiment in client.search_experiments() for run in client.search_runs([experiment.experiment_id])]


def planned_cells(project: Path, studies=STUDIES) -> list[str]:
    """``<study>@<cell>`` for every cell of ``studies``, from their plans."""
    from pipelines.plans import TrainPlan

    return sorted(f"{study}@{cell.key}" for study in studies for cell in TrainPlan.model_validate_json(
        (project / "data" / "00_plan" / study / "train.json").read_text()).cells)


def check_one_build_record(driver: Path, cells: list[str], studies=STUDIES) -> None:
    """Per study one parent run, FINISHED; under it one FINISHED child per cell; nothing left RUNNING."""
    runs = mlflow_runs(driver)
    parents = {run.info.run_id: run for run in runs if run.info.run_name.startswith("build ")}
    assert sorted(run.data.tags["study"] for run in parents.values()) == sorted(studies)
    assert {run.info.status for run in parents.values()} == {"FINISHED"}
    children = [run for run in runs if run.info.run_id not in parents]
    assert "RUNNING" not in {run.info.status for run in runs}
    finished = sorted((f"{run.data.tags['study']}@{run.info.run_name}", run.data.tags["mlflow.parentRunId"])
                      for run in children if run.info.status == "FINISHED")
    assert [cell for cell, _ in finished] == cells, [  # each cell one FINISHED run
        (run.info.run_name, run.info.status, run.data.tags.get("mlflow.parentRunId")) for run in runs]
    for cell, parent in finished:
        assert parents[parent].data.tags["study"] == cell.split("@")[0]


def work_folders() -> list[Path]:
    """The cells' work folders on this machine's nodes (`pipelines.ray_cluster.train_on_node`)."""
    import tempfile

    return sorted((Path(tempfile.gettempdir()) / f"layertune-ray-{os.getuid()}").glob(".cell.partial-*"))


def nothing_left_on_the_nodes() -> None:
    deadline = time.monotonic() + 60  # a cancelled cell's last writes may land after the build returned
    while work_folders() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not work_folders()


def training_on_nodes() -> list[int]:
    """The Ray workers running a cell now (their process names it)."""
    import psutil

    return [p.pid for p in psutil.process_iter(["cmdline"]) if "ray::train_on_node" in " ".join(p.info["cmdline"] or [])]


def test_a_cluster_build_gives_the_serial_build(origin, cluster, tmp_path):
    _, serial = origin
    driver = untrained_copy_of(serial, tmp_path / "driver", *STUDIES)  # what runs on the cluster is training
    started = time.monotonic()
    log = sh(driver, "layertune", "repro", "--ray", cluster.address, "--cpus-per-cell", "2", env=ENV)
    print(f"cluster build: {time.monotonic() - started:.1f} s\n{log}")
    cells = planned_cells(serial)
    assert f"on the Ray cluster at {cluster.address}" in log
    assert trained(log) == sorted(cell.split("@")[1] for cell in cells)  # each cell trained once, on a node
    assert reports(driver) == reports(serial) and len(reports(driver)) == len(STUDIES)
    for name in STUDIES:  # each cell's folder as a serial build writes it, file for file (timings aside)
        for folder in (serial / "data" / "04_models" / name).iterdir():
            for file in ("cell.json", "predictions.json", "model/config.json"):
                assert (driver / "data/04_models" / name / folder.name / file).read_bytes() == \
                    (folder / file).read_bytes(), (folder.name, file)
            records = [json.loads((place / "build.json").read_text()) for place in
                       (folder, driver / "data/04_models" / name / folder.name)]  # its files' digests: timings too
            assert [{**record, "files": sorted(record["files"])} for record in records] == \
                [{**records[0], "files": sorted(records[0]["files"])}] * 2
    assert sh(driver, "dvc", "status").split() == ["plan:", "always", "changed"]
    check_one_build_record(driver, cells)
    nothing_left_on_the_nodes()


def test_a_node_lost_mid_build_costs_no_cell(origin, cluster, tmp_path):
    """One worker node dies while it trains a cell: Ray runs that cell again on the other node; the report is the
    serial build's, each cell has one FINISHED run, nothing RUNNING. (The ablation study alone: its two cells keep
    both nodes busy.)"""
    _, serial = origin
    driver = untrained_copy_of(serial, tmp_path / "driver", "ablation")  # its cells alone left to build
    build = subprocess.Popen(["layertune", "repro", "--ray", cluster.address, "--cpus-per-cell", "2", "ablation"],
                             cwd=driver, env={**os.environ, **ENV, "TQDM_DISABLE": "1",
                                              "MLFLOW_TRACKING_URI": f"sqlite:///{driver / 'mlflow.db'}"},
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 300
    while len(training_on_nodes()) < 2:  # each node trains a cell
        assert build.poll() is None and time.monotonic() < deadline, build.stdout.read()
        time.sleep(0.5)
    time.sleep(3)  # the cells are training
    cluster.remove_node(cluster.worker_nodes.copy().pop(), allow_graceful=False)
    log, _ = build.communicate(timeout=600)
    print(log)
    cluster.add_node(num_cpus=2, num_gpus=1)  # for a test that may follow
    assert build.returncode == 0, log
    cells = planned_cells(serial, ["ablation"])
    assert len(cells) == 2 and reports(driver)["ablation.json"] == reports(serial)["ablation.json"]
    assert (driver / "reports" / "ablation" / "details.json").read_bytes() == (
        serial / "reports" / "ablation" / "details.json").read_bytes()
    check_one_build_record(driver, cells, studies=["ablation"])
    assert sh(driver, "dvc", "status", "--with-deps", "aggregate@ablation").split() == ["plan:", "always", "changed"]
    nothing_left_on_the_nodes()


def test_the_work_folders_of_killed_cells_are_removed_from_the_nodes(cluster):
    """A force-cancelled cell's worker is killed at once, its folder left; a cell whose cancel was lost (`ray.cancel`
    can lose the race with a task being handed to its worker) dies with the build's job, here without a word. Both
    folders are removed by the clean-up, from a job of its own once the build's has ended."""
    from pipelines.ray_cluster import _clean_nodes, connect, work_folder

    def a_long_cell():
        with work_folder("build1"):
            try:
                time.sleep(600)
            except BaseException:  # the job's end: exit as a SIGKILL would, leaving the folder
                os._exit(1)

    ray = connect(cluster.address)
    try:
        cancelled, lost = (ray.remote(a_long_cell).options(num_cpus=2).remote() for _ in range(2))  # a node each
        deadline = time.monotonic() + 120
        while len(work_folders()) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.2)
        ray.cancel(cancelled, force=True)
        address = ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()
    _clean_nodes(address, "build1")
    assert not work_folders()


@pytest.fixture(scope="module")
def slow_tokenized(tmp_path_factory):
    """A clone of a study with long cells built up to its tokenized data, which each test copies: what they check
    starts at training. Tiny models, long cells (4,000 epochs of the toy data: a cached head-only cell trains 400 in
    seconds, so a cell could end before the Ctrl-C meant to cancel it); the `diverges` setting's rate makes its loss
    NaN. Its cells come first in the plan, so that they fail at once, not after a long cell has taken their node for
    minutes."""
    params = {"download": {"mirror": "mirror"}, "studies": {"tuning": {
        **study("methods", ["sst2"], {"tiny": "models/tiny-a"}, None, [1, 2]), "tunable_layers": None,
        "methods": {"diverges": {"tunable_layers": "all", "learning_rate": 1.0e30}, "top_k-0": {"tunable_layers": 0}}}}}
    params["studies"]["tuning"]["training"]["epochs"] = 4000
    origin = make_dvc_project(tmp_path_factory.mktemp("slow"), params)
    tokenized = clone(origin, tmp_path_factory.mktemp("slow-tokenized") / "repo")
    sh(tokenized, "dvc", "repro", "tokenize@tuning", env=ENV)
    return tokenized


def start_build(driver: Path, address: str) -> subprocess.Popen:
    return subprocess.Popen(["layertune", "repro", "--ray", address], cwd=driver, text=True,
                            env={**os.environ, **ENV, "MLFLOW_TRACKING_URI": f"sqlite:///{driver / 'mlflow.db'}",
                                 "TQDM_DISABLE": "1"}, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def test_a_failed_cell_stops_the_build_naming_it_and_its_error(slow_tokenized, cluster, tmp_path):
    driver = copy_of(slow_tokenized, tmp_path / "driver")
    build = start_build(driver, cluster.address)
    out, err = build.communicate(timeout=600)
    assert build.returncode == 1, out + err
    assert "cell sst2-tiny-diverges-" in err and "FloatingPointError" in err  # the cell's own error
    runs = mlflow_runs(driver)
    diverged = {run.info.status for run in runs if "-diverges-" in run.info.run_name}
    assert diverged == {"FAILED"}
    assert [run.info.status for run in runs if run.info.run_name.startswith("build ")] == ["FAILED"]
    assert "RUNNING" not in {run.info.status for run in runs}
    deadline = time.monotonic() + 30
    while training_on_nodes() and time.monotonic() < deadline:  # the other cells were cancelled, not waited for
        time.sleep(0.2)
    assert not training_on_nodes()
    nothing_left_on_the_nodes()
    assert not (driver / "reports").exists()


def test_ctrl_c_stops_every_cell_on_the_nodes_within_seconds(slow_tokenized, cluster, tmp_path):
    driver = copy_of(slow_tokenized, tmp_path / "driver")
    (driver / "params.yaml").write_text((driver / "params.yaml").read_text().replace("1.0e+30", "0.001"))
    sh(driver, "git", "commit", "--quiet", "-am", "no diverging cell")
    before = set(training_on_nodes())  # a worker of an earlier test may still be ending (the signal must not come
    build = start_build(driver, cluster.address)  # before this build's own handler: exit -2, not 130)
    deadline = time.monotonic() + 300
    while len(set(training_on_nodes()) - before) < 2:
        assert build.poll() is None and time.monotonic() < deadline, build.communicate()
        time.sleep(0.5)
    build.send_signal(signal.SIGINT)
    interrupted = time.monotonic()
    out, err = build.communicate(timeout=120)
    assert build.returncode == 130, out + err
    while training_on_nodes() and time.monotonic() - interrupted < 30:
        time.sleep(0.2)
    assert time.monotonic() - interrupted < 30 and not training_on_nodes()  # stopped, not waited for
    assert {run.info.status for run in mlflow_runs(driver)} == {"KILLED"}  # the build's run; no cell finished
    nothing_left_on_the_nodes()


def test_a_build_while_the_tracking_server_is_down_loses_no_run(slow_tokenized, cluster, tmp_path):
    """The team's MLflow server is down for the whole build: the build still ends with its reports. Once the server
    is up, `python -m pipelines.tracking sync` logs each cell there from its folder: one FINISHED run per cell,
    with its stage, parameters and metrics."""
    from tests.team_server import free_port, mlflow_server

    driver = copy_of(slow_tokenized, tmp_path / "driver")
    params = (driver / "params.yaml").read_text()
    (driver / "params.yaml").write_text(params.replace("1.0e+30", "0.001").replace("epochs: 4000", "epochs: 2"))
    sh(driver, "git", "commit", "--quiet", "-am", "short cells, none diverging")
    port = free_port()
    url = f"http://127.0.0.1:{port}"  # nothing listens there yet
    env = {**os.environ, **ENV, "MLFLOW_TRACKING_URI": url, "TQDM_DISABLE": "1"}
    build = subprocess.run(["layertune", "repro", "--ray", cluster.address], cwd=driver, env=env, text=True,
                           capture_output=True, timeout=600)
    assert build.returncode == 0, build.stdout + build.stderr
    assert (driver / "reports" / "tuning.json").is_file()
    nothing_left_on_the_nodes()

    with mlflow_server(f"sqlite:///{tmp_path / 'server.db'}", tmp_path / "artifacts", port=port):
        synced = subprocess.run([sys.executable, "-m", "pipelines.tracking", "sync"], cwd=driver, env=env,
                                capture_output=True, text=True, timeout=300)
        assert synced.returncode == 0, synced.stdout + synced.stderr
        from mlflow import MlflowClient

        client = MlflowClient(url)
        runs = [run for experiment in client.search_experiments()
                for run in client.search_runs([experiment.experiment_id])]
    assert sorted(run.info.status for run in runs) == ["FINISHED"] * 4
    assert {run.data.tags["dvc_stage"] for run in runs} == {"train@tuning"}
    assert {run.data.params["epochs"] for run in runs} == {"2"} and all("best_eval_loss" in run.data.metrics
                                                                         for run in runs)
