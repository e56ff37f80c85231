"""`layertune repro --ray`: a study's cells as tasks on a Ray cluster, simulated on this machine with
`ray.cluster_utils.Cluster` (a head that trains nothing and two worker nodes, each declaring a GPU: a cell takes one),
a local-folder DVC remote and the embedded MLflow store. The studies are the `ci` profile's ablation and methods
studies (the real all-MiniLM-L6-v2 on SST-2 from the data mirror), compared with their serial `dvc repro`.

Slow (a serial build, two cluster builds: about 6 minutes in all); one xdist worker runs them all, in order."""

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from pipelines import ray_node
from tests.projects import ROOT, make_dvc_project, study
from tests.test_scale import clone, reports, sh

pytestmark = [pytest.mark.integration, pytest.mark.xdist_group("ray_cluster")]
STUDIES = ("ablation", "methods")


@pytest.fixture(scope="module")
def origin(tmp_path_factory, data_mirror, minilm_l3):
    """The team's repository with the ci profile's two studies, and their serial build (in a clone)."""
    from pipelines.profiles import apply_overrides, load_profile

    params = apply_overrides(yaml.safe_load((ROOT / "params.yaml").read_text()), load_profile("ci", ROOT))
    params["studies"] = {name: params["studies"][name] for name in STUDIES}
    params["download"] = {"mirror": str(data_mirror), "model_mirror": str(minilm_l3.parent)}
    folder = make_dvc_project(tmp_path_factory.mktemp("origin"), params)
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


def cell_stages(project: Path) -> list[str]:
    lock = yaml.safe_load((project / "dvc.lock").read_text())["stages"]
    return sorted(name for name in lock if name.startswith("train-"))


def mlflow_runs(project: Path) -> list:
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{project / 'mlflow.db'}")
    return [run for experiment in client.search_experiments() for run in client.search_runs([experiment.experiment_id])]


def check_one_build_record(driver: Path, cells: list[str], studies=STUDIES) -> None:
    """Per study one parent run, FINISHED; under it one FINISHED child per cell; nothing left RUNNING."""
    runs = mlflow_runs(driver)
    parents = {run.info.run_id: run for run in runs if run.info.run_name.startswith("build ")}
    assert sorted(run.data.tags["study"] for run in parents.values()) == sorted(studies)
    assert {run.info.status for run in parents.values()} == {"FINISHED"}
    children = [run for run in runs if run.info.run_id not in parents]
    assert "RUNNING" not in {run.info.status for run in runs}
    finished = sorted((run.data.tags["dvc_stage"], run.data.tags["mlflow.parentRunId"]) for run in children
                      if run.info.status == "FINISHED")
    assert [stage for stage, _ in finished] == cells, [  # each cell one FINISHED run
        (run.info.run_name, run.info.status, run.data.tags.get("mlflow.parentRunId")) for run in runs]
    for stage, parent in finished:
        assert parents[parent].data.tags["study"] == stage.split("@")[0].removeprefix("train-")


def cells_started(database: Path) -> int:
    """Runs with a parent, read without MLflow (whose client would migrate a database being created)."""
    import sqlite3

    try:
        with contextlib.closing(sqlite3.connect(f"file:{database}?mode=ro", uri=True)) as db:
            return db.execute("select count(*) from tags where key = 'mlflow.parentRunId'").fetchone()[0]
    except sqlite3.Error:
        return 0


def nothing_left_on_the_nodes() -> None:
    import tempfile

    root = Path(tempfile.gettempdir()) / f"layertune-ray-{os.getuid()}"
    deadline = time.monotonic() + 60  # a cancelled cell's last writes may land after the build returned
    while root.exists() and list(root.glob("*")) and time.monotonic() < deadline:
        time.sleep(0.5)
    left = sorted(root.rglob("*")) if root.exists() else []
    now = time.time()
    assert not left, [f"{path} ({now - path.lstat().st_mtime:.1f} s old)" for path in left[:40]]


def test_a_cluster_build_gives_the_serial_build(origin, cluster, tmp_path):
    repository, serial = origin
    driver = clone(repository, tmp_path / "driver", tmp_path / "remote")
    started = time.monotonic()
    log = sh(driver, "layertune", "repro", "--ray", cluster.address, "--cpus-per-cell", "2", env=ENV)
    print(f"cluster build: {time.monotonic() - started:.1f} s\n{log}")
    cells = cell_stages(serial)
    assert f"{len(cells)} cell(s) to train on the Ray cluster (3 nodes" in log
    trained = sorted(line.split()[3] for line in log.splitlines() if " trained on node " in line)
    assert trained == cells  # each cell trained once, on a node
    restored = {line.split("'")[1] for line in log.splitlines() if "is cached - skipping run" in line}
    assert restored >= set(cells) and "Running stage 'train-" not in log  # the driver trained none
    assert reports(driver) == reports(serial) and len(reports(driver)) == len(STUDIES)
    assert sh(driver, "dvc", "status").split() == ["plan:", "always", "changed"]
    check_one_build_record(driver, cells)
    nothing_left_on_the_nodes()


def test_a_node_lost_mid_build_costs_no_cell(origin, cluster, tmp_path):
    """One worker node dies while it trains a cell: Ray runs that cell again on the other node; the report is the
    serial build's, each cell has one FINISHED run, the lost attempt's run ended KILLED, nothing RUNNING. (The
    ablation study alone: its two cells keep both nodes busy.)"""
    repository, serial = origin
    driver = clone(repository, tmp_path / "driver", tmp_path / "remote")
    build = subprocess.Popen(["layertune", "repro", "--ray", cluster.address, "--cpus-per-cell", "2", "ablation"],
                             cwd=driver,
                             env={**os.environ, **ENV, "MLFLOW_TRACKING_URI": f"sqlite:///{driver / 'mlflow.db'}",
                                  "TQDM_DISABLE": "1"},
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 300
    while cells_started(driver / "mlflow.db") < 2:  # each node trains a cell
        assert build.poll() is None and time.monotonic() < deadline, build.stdout.read()
        time.sleep(0.5)
    time.sleep(3)  # the cells are training
    cluster.remove_node(cluster.worker_nodes.copy().pop(), allow_graceful=False)
    log, _ = build.communicate(timeout=600)
    print(log)
    cluster.add_node(num_cpus=2, num_gpus=1)  # for a test that may follow
    assert build.returncode == 0, log
    cells = [stage for stage in cell_stages(serial) if stage.startswith("train-ablation@")]
    assert len(cells) == 2 and reports(driver)["ablation.json"] == reports(serial)["ablation.json"]
    assert (driver / "reports" / "ablation" / "details.json").read_bytes() == (
        serial / "reports" / "ablation" / "details.json").read_bytes()
    check_one_build_record(driver, cells, studies=["ablation"])
    assert "will be retried" in log  # Ray's word for it
    assert "KILLED" in {run.info.status for run in mlflow_runs(driver)}  # the lost attempt
    assert sh(driver, "dvc", "status", "--with-deps", "aggregate@ablation").split() == ["plan:", "always", "changed"]
    nothing_runs_on(driver)
    nothing_left_on_the_nodes()


@pytest.fixture(scope="module")
def slow_origin(tmp_path_factory):
    """Tiny models, long cells (4,000 epochs of the toy data: a cached head-only cell trains 400 in seconds, so a
    cell could end before the Ctrl-C meant to cancel it); the `diverges` setting's rate makes its loss NaN."""
    params = {"download": {"mirror": "mirror"}, "studies": {"tuning": {
        **study("methods", ["sst2"], {"tiny": "models/tiny-a"}, None, [1, 2]), "tunable_layers": None,
        "methods": {"top_k-0": {"tunable_layers": 0}, "diverges": {"tunable_layers": "all", "learning_rate": 1.0e30}}}}}
    params["studies"]["tuning"]["training"]["epochs"] = 4000
    return make_dvc_project(tmp_path_factory.mktemp("slow"), params)


def start_build(driver: Path, address: str) -> subprocess.Popen:
    return subprocess.Popen(["layertune", "repro", "--ray", address], cwd=driver, text=True,
                            env={**os.environ, **ENV, "MLFLOW_TRACKING_URI": f"sqlite:///{driver / 'mlflow.db'}",
                                 "TQDM_DISABLE": "1"}, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def nothing_runs_on(driver: Path) -> None:
    """No run RUNNING, and no process of a cell's run alive: every cell was stopped, none trains on, orphaned."""
    runs = mlflow_runs(driver)
    assert "RUNNING" not in {run.info.status for run in runs}
    pids = [int(run.data.tags["layertune.pid"]) for run in runs if "mlflow.parentRunId" in run.data.tags]
    assert pids and not [(pid, state) for pid in pids if (state := process_state(pid)) not in (None, "Z")]


def process_state(pid: int) -> str | None:
    """R, S, Z (a zombie: ended, not yet reaped by whoever adopted it)..., or None when there is no such process."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def test_a_failed_cell_stops_the_build_with_its_log(slow_origin, cluster, tmp_path):
    driver = clone(slow_origin, tmp_path / "driver", tmp_path / "remote")
    build = start_build(driver, cluster.address)
    out, err = build.communicate(timeout=600)
    assert build.returncode == 1, out + err
    assert "train-tuning@sst2-tiny-diverges-" in err and "FloatingPointError" in err  # the cell's own log
    runs = mlflow_runs(driver)
    diverged = {run.info.status for run in runs if "-diverges-" in run.info.run_name}
    assert "FAILED" in diverged and diverged <= {"FAILED", "KILLED"}  # the other seed's: cancelled, if it started
    assert [run.info.status for run in runs if run.info.run_name.startswith("build ")] == ["FAILED"]
    # A cell may have finished before the failure (Ray starts tasks in no set order), none after the build stopped.
    parent_ended = next(run.info.end_time for run in runs if run.info.run_name.startswith("build "))
    assert not [run for run in runs if run.info.status == "FINISHED" and run.info.end_time >= parent_ended]
    nothing_runs_on(driver)
    nothing_left_on_the_nodes()
    assert not (driver / "reports").exists()


def test_ctrl_c_cancels_the_cells_and_cleans_the_nodes(slow_origin, cluster, tmp_path):
    driver = clone(slow_origin, tmp_path / "driver", tmp_path / "remote")
    (driver / "params.yaml").write_text((driver / "params.yaml").read_text().replace("1.0e+30", "0.001"))
    sh(driver, "git", "commit", "--quiet", "-am", "no diverging cell")
    build = start_build(driver, cluster.address)
    deadline = time.monotonic() + 300
    while cells_started(driver / "mlflow.db") < 2:
        assert build.poll() is None and time.monotonic() < deadline, build.communicate()
        time.sleep(0.5)
    build.send_signal(signal.SIGINT)
    interrupted = time.monotonic()
    out, err = build.communicate(timeout=120)
    assert build.returncode == 130, out + err
    assert time.monotonic() - interrupted < 30  # the cells were stopped, not waited for
    assert "cancelling" in err
    runs = mlflow_runs(driver)
    assert {run.info.status for run in runs} == {"KILLED"}
    nothing_runs_on(driver)
    nothing_left_on_the_nodes()


def test_a_build_while_the_tracking_server_is_down_loses_no_run(slow_origin, cluster, tmp_path):
    """The team's MLflow server is down for the whole build: the build still ends with its reports, and each cell's
    folder comes back as it does when the server is up. Once the server is up, `python -m pipelines.tracking sync`
    logs each cell there from its folder: one FINISHED run per cell, with its stage, parameters and metrics."""
    from tests.team_server import free_port, mlflow_server

    driver = clone(slow_origin, tmp_path / "driver", tmp_path / "remote")
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
    assert sorted(run.data.tags["dvc_stage"] for run in runs) == cell_stages(driver)
    assert {run.data.params["epochs"] for run in runs} == {"2"} and all("best_eval_loss" in run.data.metrics
                                                                         for run in runs)


def test_the_builds_gate_outlives_every_worker_node(cluster):
    """Ray retries a task whose node died, not an actor: the build's gate, which every cell calls, lives on the
    driver's node (here the head, without a CPU), so losing any worker node cannot take it down. (Last: it removes
    the worker nodes, then adds them again.)"""
    import ray

    from pipelines.ray_cluster import RayCluster, check_reachable

    check_reachable(f"127.0.0.1:{cluster.address.rsplit(':', 1)[1]}")  # Ray's head answers the address check
    ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False)
    try:
        def train_a_while() -> None:  # defined here: sent by value (a worker does not import the tests)
            time.sleep(60)

        cells = [ray.remote(num_cpus=2, num_gpus=1)(train_a_while).remote() for _ in cluster.worker_nodes]
        time.sleep(3)  # each worker node busy with a cell, as in a build (Ray then places most actors on them)
        driver = RayCluster(ray, {}, 1, True, "", "")
        gates = [driver._start_gate() for _ in range(5)]
        assert ray.get([gate.close.remote([]) for gate in gates], timeout=60) == [[]] * 5  # each one started
        for node in list(cluster.worker_nodes):
            cluster.remove_node(node, allow_graceful=False)
        where = ray_node.Place(node="-", host="-")
        assert ray.get([gate.enter.remote("train-s@a", "late", where) for gate in gates], timeout=60) == [False] * 5
        ray.cancel(cells[0])
    finally:
        ray.shutdown()
        for _ in range(2 - len(cluster.worker_nodes)):
            cluster.add_node(num_cpus=2, num_gpus=1)
        cluster.wait_for_nodes()
