"""MLflow: a run per cell that ends FINISHED only on success; FAILED on an error, KILLED on Ctrl-C or SIGTERM. A
tracking store that does not answer costs a cell seconds, never its outputs; what it kept reaches MLflow later."""

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import pandas as pd
import pytest

from pipelines import tracking
from layertune.specs import CellSpec, CorpusSpec, EncoderSpec
from layertune.study import StudyCell
from layertune.trainer import TrainingResult

CELL = StudyCell(study="e", task="sst2", encoder="m", tunable_layers=2, seed=1,
                 spec=CellSpec(corpus=CorpusSpec(task="sst2", train_size=10), encoders=[
                     EncoderSpec(model="org/m", tunable_layers=2, pooling="mean")]))


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """One database for the module (creating MLflow's tables takes seconds); each test uses its own experiment."""
    return tmp_path_factory.mktemp("mlflow")


@pytest.fixture
def uri(store, monkeypatch):
    uri = f"sqlite:///{store / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    return uri


def only_run(uri, experiment):
    from mlflow import MlflowClient

    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    assert len(runs) == 1
    return client, runs[0]


def cell(study: str) -> StudyCell:
    return CELL.model_copy(update={"study": study})


def result() -> TrainingResult:
    return TrainingResult(
        history=[{"epoch": 1, "train_loss": 0.7, "eval_accuracy": 0.5}, {"epoch": 2, "train_loss": 0.5,
                                                                       "eval_accuracy": 0.75}],
        best_epoch=2, best_metrics={"eval_accuracy": 0.75}, main_metric="accuracy", train_time_s=1.5,
        samples_per_s=10.0, peak_memory_mb=1.0, trainable_parameters=3, total_parameters=9,
        frozen_prefix_cache={"used": True, "reason": "cached, by estimate: …", "estimate": {"pass_s": 1.5}},
        predictions={}, test_metrics={"test_accuracy": 0.7},
        drift=pd.DataFrame())


def test_run_params_are_flat_and_name_the_cell():
    params = tracking.cell_params(CELL)
    assert {params[k] for k in ("study", "task", "encoder", "tunable_layers", "seed")} == {"e", "sst2", "m", 2, 1}
    assert params["models"] == "org/m" and params["pooling"] == "mean" and params["train_size"] == 10
    assert params["learning_rate"] == 5e-5 and "seed" not in {k for k in params if k.startswith("training")}


def test_end_status_of_errors_and_interruptions():
    assert tracking.end_status(None) == "FINISHED"
    assert tracking.end_status(RuntimeError()) == "FAILED"
    assert tracking.end_status(KeyboardInterrupt()) == tracking.end_status(tracking.Terminated()) == "KILLED"


def test_sigterm_raises_within_the_block_and_restores_the_handler():
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(tracking.Terminated), tracking.sigterm_raises():
        os.kill(os.getpid(), signal.SIGTERM)
        signal.sigtimedwait([], 1)
    assert signal.getsignal(signal.SIGTERM) is before


def run_hook(uri, study: str):
    from pipelines.hooks import MLFLOW_TAG, MlflowCellHook

    hook, node = MlflowCellHook(), SimpleNamespace(tags={MLFLOW_TAG})
    hook.before_node_run(node=node, inputs={"cell_plan": cell(study)})
    return hook, node


def test_hook_finishes_only_after_the_whole_run_with_history_metrics_and_artifacts(uri, store):
    hook, node = run_hook(uri, "e1")
    hook.after_node_run(node=node, outputs={"trained_cell": SimpleNamespace(result=result())})
    client, found = only_run(uri, "layertune-e1")
    assert found.info.status == "RUNNING"  # outputs are not saved yet
    hook.after_pipeline_run()
    client, found = only_run(uri, "layertune-e1")
    assert found.info.status == "FINISHED" and found.info.run_name == "sst2-m-2-1"
    assert found.data.params["tunable_layers"] == "2" and found.data.params["head_learning_rate"] == "0.003"
    assert found.data.tags["dvc_stage"] == "train-e1@sst2-m-2-1" and found.data.tags["study"] == "e1"
    assert [(m.step, m.value) for m in client.get_metric_history(found.info.run_id, "eval_accuracy")] == [
        (1, 0.5), (2, 0.75)]
    assert found.data.metrics["best_eval_accuracy"] == 0.75 and found.data.metrics["test_accuracy"] == 0.7
    assert sorted(a.path for a in client.list_artifacts(found.info.run_id)) == ["history.json", "metrics.json",
                                                                                "run_info.json"]
    # what the frozen-prefix cache decided, and why, is on the run
    assert found.data.tags["frozen_prefix_cache.used"] == "True"
    assert found.data.tags["frozen_prefix_cache.reason"].startswith("cached, by estimate")
    assert (store / "mlartifacts" / "layertune-e1").is_dir()  # artifacts beside the database, not in the cwd


def test_hook_failed_on_node_error(uri):
    hook, node = run_hook(uri, "e2")
    hook.on_node_error(error=ValueError("bad"), node=node)
    hook.after_pipeline_run()  # already ended: stays FAILED
    assert only_run(uri, "layertune-e2")[1].info.status == "FAILED"


def test_hook_killed_when_interrupted_before_kedro_could_tell(uri):
    hook, _ = run_hook(uri, "e3")
    hook.end_open_run()  # what atexit calls after Ctrl-C, which skips Kedro's error hooks
    assert only_run(uri, "layertune-e3")[1].info.status == "KILLED"


def test_sigterm_to_a_tracked_process_ends_its_run_killed(uri, tmp_path):
    """A real process: the hook starts a run, the 'cell' is killed with SIGTERM mid-work."""
    script = tmp_path / "cell.py"
    script.write_text(textwrap.dedent("""
        import time
        from types import SimpleNamespace
        from pipelines.hooks import MLFLOW_TAG, MlflowCellHook
        from tests.test_tracking import cell
        MlflowCellHook().before_node_run(node=SimpleNamespace(tags={MLFLOW_TAG}), inputs={"cell_plan": cell("e4")})
        print("started", flush=True)
        time.sleep(60)
    """))
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    process = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, cwd=root,
                               env={**os.environ, "PYTHONPATH": root})
    assert process.stdout.readline().strip() == "started"
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=60) != 0
    assert only_run(uri, "layertune-e4")[1].info.status == "KILLED"


# ------------------------------------------------------------------ a tracking store that does not answer

RETRY_VARIABLES = ("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR",
                   "MLFLOW_HTTP_REQUEST_BACKOFF_JITTER", "MLFLOW_HTTP_REQUEST_TIMEOUT")


def catalog(**paths):
    """What the hook reads of Kedro's catalog: where datasets live."""
    return SimpleNamespace(get=lambda name: SimpleNamespace(path=paths[name])
                           if name in paths else None)


def train_cell_hook(study: str, seed: int = 1, **paths):
    """The hook through a whole cell: started, trained, outputs saved."""
    from pipelines.hooks import MLFLOW_TAG, MlflowCellHook

    hook, node = MlflowCellHook(), SimpleNamespace(tags={MLFLOW_TAG})
    hook.catalog = catalog(**paths) if paths else None
    hook.before_node_run(node=node, inputs={"cell_plan": cell(study).model_copy(update={"seed": seed})})
    hook.after_node_run(node=node, outputs={"trained_cell": SimpleNamespace(result=result())})
    hook.after_pipeline_run()
    return hook


def test_an_unreachable_server_costs_seconds_and_one_warning_and_the_run_is_kept(tmp_path, monkeypatch, caplog):
    from tests.team_server import free_port

    for name in RETRY_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "7")  # the user's own setting is kept
    uri = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.chdir(tmp_path)
    started = time.monotonic()
    train_cell_hook("down")
    elapsed = time.monotonic() - started
    assert elapsed < 30, elapsed  # MLflow's own retries took 256 s per call
    assert os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] == "2" and os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] == "7"
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and not warnings[0].exc_info, [r.getMessage() for r in warnings]
    assert uri in warnings[0].getMessage() and "Connection refused" in warnings[0].getMessage()
    assert "\n" not in warnings[0].getMessage()
    kept = tracking.PendingRun.model_validate_json(
        (tmp_path / "data" / "09_tracking" / "layertune-down" / "sst2-m-2-1.json").read_text())
    assert kept.run_id is None and kept.status == "FINISHED" and kept.uri == uri
    assert kept.operations[0].params["tunable_layers"] == "2"
    assert {m.key for m in kept.operations[1].metrics} >= {"best_eval_accuracy", "train_loss", "test_accuracy"}


def test_kept_runs_reach_mlflow_when_the_next_cell_of_the_study_starts(uri, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setitem(tracking._failed, uri, time.monotonic())  # the store failed a moment ago, in this process
    train_cell_hook("back", seed=1)
    journal = tmp_path / "data" / "09_tracking" / "layertune-back" / "sst2-m-2-1.json"
    assert journal.is_file()
    del tracking._failed[uri]  # the store answers again
    train_cell_hook("back", seed=2)
    from mlflow import MlflowClient

    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name("layertune-back").experiment_id])
    assert sorted((r.info.run_name, r.info.status) for r in runs) == [("sst2-m-2-1", "FINISHED"),
                                                                     ("sst2-m-2-2", "FINISHED")]
    kept = next(r for r in runs if r.info.run_name == "sst2-m-2-1")
    assert kept.data.params["seed"] == "1" and kept.data.metrics["best_eval_accuracy"] == 0.75
    assert [(m.step, m.value) for m in client.get_metric_history(kept.info.run_id, "eval_accuracy")] == [
        (1, 0.5), (2, 0.75)]
    assert sorted(a.path for a in client.list_artifacts(kept.info.run_id)) == ["history.json", "metrics.json",
                                                                               "run_info.json"]
    assert not journal.exists()


@pytest.mark.parametrize("parent_first", [True, False])
def test_kept_runs_of_a_ray_build_are_nested_under_its_parent_in_either_order(uri, tmp_path, parent_first):
    """A build whose parent run was kept (the server was down when it opened): its cells' runs, kept or logged,
    end up as the parent's children once it is replayed, whichever of them reaches MLflow first."""
    from mlflow import MlflowClient

    experiment, build = f"layertune-nest-{parent_first}", f"b-{parent_first}"

    def kept(name: str, tags: dict) -> tuple[Path, tracking.PendingRun]:
        pending = tracking.PendingRun(uri=uri, experiment=experiment, run_name=name, start_time=1,
                                      tags={tracking.BUILD_TAG: build, **tags}, status="FINISHED", end_time=2)
        path = tmp_path / f"{name}.json"
        tracking.write_pending(path, pending)
        return path, pending

    client = MlflowClient(uri)
    parent = kept(f"build {build}", {"study": "nest"})
    cells = [kept(f"cell-{seed}", {"dvc_stage": f"train-nest@cell-{seed}"}) for seed in (1, 2)]
    other_build = kept("cell-other", {"dvc_stage": "train-nest@cell-3", tracking.BUILD_TAG: "another"})
    for path, pending in ([parent, *cells, other_build] if parent_first else [*cells, other_build, parent]):
        tracking.replay(client, path, pending)
    runs = {run.info.run_name: run for run in client.search_runs([client.get_experiment_by_name(experiment)
                                                                  .experiment_id])}
    parent_id = runs[f"build {build}"].info.run_id
    assert [runs[f"cell-{seed}"].data.tags.get(tracking.PARENT_TAG) for seed in (1, 2)] == [parent_id] * 2
    assert tracking.PARENT_TAG not in runs["cell-other"].data.tags  # another build's cell stays out
    assert tracking.PARENT_TAG not in runs[f"build {build}"].data.tags


def test_runs_left_running_by_killed_cells_are_settled_by_the_evaluate_stage(uri, tmp_path):
    """Cells killed with SIGKILL whose training did not run again (DVC restored their outputs from its run-cache):
    FINISHED with the folder's metrics if it holds the run's outputs, KILLED if not; a live owner's run is left."""
    from mlflow import MlflowClient

    from pipelines.hooks import MlflowCellHook

    dead = subprocess.Popen(["true"])
    dead.wait()
    client = MlflowClient(uri)
    experiment = client.create_experiment("layertune-settle")
    owner = {tracking.HOST_TAG: socket.gethostname(), tracking.SPEC_TAG: tracking.spec_digest(CELL.spec)}
    runs = {name: client.create_run(experiment, run_name=name, tags={**owner, tracking.PID_TAG: str(pid)}).info
            for name, pid in (("restored", dead.pid), ("older", dead.pid), ("other-spec", dead.pid),
                              ("alive", os.getpid()))}
    cells = tmp_path / "04_models" / "settle"
    for name in ("restored", "older", "other-spec"):
        folder = cells / name
        folder.mkdir(parents=True)
        spec = CELL.spec.model_copy(update={"training": CELL.spec.training.model_copy(update={"seed": 9})}) \
            if name == "other-spec" else CELL.spec
        (folder / "cell.json").write_text(spec.model_dump_json(indent=2) + "\n")
        (folder / "metrics.json").write_text(json.dumps(result().summary()))
        (folder / "history.json").write_text(json.dumps(result().history))
    old = runs["older"].start_time / 1000 - 3600  # written an hour before that run began: not its outputs
    for path in (cells / "older", cells / "older" / "metrics.json"):
        os.utime(path, (old, old))

    hook = MlflowCellHook()
    hook.catalog = catalog(study_cells=cells)
    hook.before_node_run(node=SimpleNamespace(tags=set()),
                         inputs={"study_plan": SimpleNamespace(name="settle"), "study_cells": {}})
    status = {name: client.get_run(info.run_id).info.status for name, info in runs.items()}
    assert status == {"restored": "FINISHED", "older": "KILLED", "other-spec": "KILLED", "alive": "RUNNING"}
    restored = client.get_run(runs["restored"].run_id)
    assert restored.data.metrics["best_eval_accuracy"] == 0.75 and restored.data.metrics["test_accuracy"] == 0.7
    assert [m.step for m in client.get_metric_history(restored.info.run_id, "train_loss")] == [1, 2]
    client.set_terminated(runs["alive"].run_id)


def test_each_cell_logs_its_train_and_dev_data_as_dataset_inputs(uri, tmp_path):
    import mlflow.data

    prepared = tmp_path / "02_prepared"
    (prepared / "sst2").mkdir(parents=True)
    frames = {"train": pd.DataFrame({"sentence": ["a good film", "a bad film"], "label": [1, 0]}),
              "dev": pd.DataFrame({"sentence": ["great"], "label": [1]})}
    for split, frame in frames.items():
        frame.to_parquet(prepared / "sst2" / f"{split}.parquet")
    train_cell_hook("data", prepared_corpora=prepared)
    client, found = only_run(uri, "layertune-data")
    inputs = {d.dataset.name: d for d in found.inputs.dataset_inputs}
    assert sorted(inputs) == ["sst2-dev", "sst2-train"]
    for split, context in (("train", "training"), ("dev", "eval")):
        logged = inputs[f"sst2-{split}"]
        assert logged.dataset.digest == mlflow.data.from_pandas(frames[split]).digest
        assert str(prepared / "sst2" / f"{split}.parquet") in logged.dataset.source
        assert [(t.key, t.value) for t in logged.tags] == [("mlflow.data.context", context)]
        assert json.loads(logged.dataset.profile)["num_rows"] == len(frames[split])


# ------------------------------------------------------------- a real server killed while a cell trains


def cell_command(key: str) -> list[str]:
    return [sys.executable, "-m", "kedro", "run", "--pipelines", "train", "--params", f"study=slow,cell={key}"]


def server_runs(url: str) -> list:
    from mlflow import MlflowClient

    client = MlflowClient(url)
    experiment = client.get_experiment_by_name("layertune-slow")
    return client.search_runs([experiment.experiment_id]) if experiment else []


def warning_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if "WARNING" in line or "Traceback" in line]


def test_a_tracking_server_killed_mid_cell_loses_no_cell(tmp_path, monkeypatch):
    """A real `mlflow server` killed while a cell trains: the stage succeeds with the cell's folder and one warning
    line; once the server is back, `python -m pipelines.tracking sync` makes the cell's run FINISHED there, with its
    parameters, metrics and dataset inputs."""
    from tests.projects import make_project, project_env, run, study
    from tests.team_server import free_port, mlflow_server

    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")  # `mlflow`
    slow = study("layers", ["sst2"], {"tiny": "models/tiny-a"}, [1], [1])
    slow["training"]["epochs"] = 100  # seconds of training: the server is killed before it ends
    project = make_project(tmp_path / "project", {"download": {"mirror": "mirror"}, "studies": {"slow": slow}})
    for stage, runtime in (("plan", {}), ("download", {}), ("prepare", {"study": "slow"}),
                           ("tokenize", {"study": "slow"})):
        run(project, stage, **runtime)
    port, store = free_port(), f"sqlite:///{tmp_path / 'server.db'}"
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, **project_env(project), "MLFLOW_TRACKING_URI": url}
    folder, log = project / "data" / "04_models" / "slow" / "sst2-tiny-1-1", tmp_path / "cell.log"

    with mlflow_server(store, tmp_path / "artifacts", port=port), open(log, "w") as output:
        cell = subprocess.Popen(cell_command("sst2-tiny-1-1"), cwd=project, env=env, stdout=output,
                                stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while not server_runs(url) and cell.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert [r.info.status for r in server_runs(url)] == ["RUNNING"]
    assert cell.wait(timeout=300) == 0, log.read_text()[-3000:]  # the server was gone before training ended
    assert (folder / "metrics.json").is_file()
    assert len(warning_lines(log.read_text())) == 1 and url in warning_lines(log.read_text())[0], log.read_text()
    journal = project / "data" / "09_tracking" / "layertune-slow" / "sst2-tiny-1-1.json"
    assert tracking.PendingRun.model_validate_json(journal.read_text()).status == "FINISHED"

    with mlflow_server(store, tmp_path / "artifacts", port=port):
        synced = subprocess.run([sys.executable, "-m", "pipelines.tracking", "sync"], cwd=project, env=env,
                                capture_output=True, text=True, timeout=300)
        assert synced.returncode == 0, synced.stdout + synced.stderr
        assert "1 kept run(s) sent" in synced.stdout
        [found] = server_runs(url)
    assert found.info.status == "FINISHED" and found.data.params["epochs"] == "100"
    saved = json.loads((folder / "metrics.json").read_text())
    assert found.data.metrics["best_eval_accuracy"] == saved["eval_accuracy"]
    assert sorted(d.dataset.name for d in found.inputs.dataset_inputs) == ["sst2-dev", "sst2-train"]
    assert not journal.exists()


def test_a_cell_trained_again_leaves_one_finished_run_of_its_spec(uri):
    """`kill -9` of `dvc repro` after a cell's run ended FINISHED but before DVC recorded the stage: the rerun trains
    the cell again (DVC deleted its outputs first). Its FINISHED run supersedes the earlier one of the same spec (its
    process gone): one FINISHED run per cell. Another spec's run, and a live process's, stay FINISHED."""
    from mlflow import MlflowClient

    dead = subprocess.Popen(["true"])
    dead.wait()
    client = MlflowClient(uri)
    experiment = client.create_experiment("layertune-again")
    spec = tracking.spec_digest(CELL.spec)
    earlier = {}
    for name, digest, pid in (("before", spec, dead.pid), ("other-spec", "0" * 16, dead.pid),
                              ("alive", spec, os.getpid())):
        tags = {tracking.HOST_TAG: socket.gethostname(), tracking.PID_TAG: str(pid), tracking.SPEC_TAG: digest}
        earlier[name] = client.create_run(experiment, run_name="sst2-m-2-1", tags=tags).info.run_id
        client.set_terminated(earlier[name], status="FINISHED")
    run = tracking.CellRun.start("layertune-again", "sst2-m-2-1", {}, tags={tracking.SPEC_TAG: spec}, uri=uri)
    run.end("FINISHED")
    status = {name: client.get_run(run_id).info.status for name, run_id in earlier.items()}
    assert status == {"before": "KILLED", "other-spec": "FINISHED", "alive": "FINISHED"}
    assert client.get_run(earlier["before"]).data.tags[tracking.SUPERSEDED_TAG] == run.run_id
    assert client.get_run(run.run_id).info.status == "FINISHED"


def test_a_read_only_store_is_one_warning_line_and_the_cell_is_kept(tmp_path, capfd, caplog):
    """A read-only mlflow.db printed ~70 lines of SQLAlchemy (MLflow's SQL store logs each database error with its
    traceback). Made read-only with chattr, which binds root too (a file mode does not)."""
    import logging
    import shutil
    import subprocess

    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    MlflowClient(uri).search_experiments(max_results=1)  # the store exists, with its tables
    if shutil.which("chattr") is None or subprocess.run(["chattr", "+i", str(tmp_path / "mlflow.db")]).returncode:
        pytest.skip("chattr +i is not available on this filesystem")
    try:
        capfd.readouterr()
        with caplog.at_level(logging.WARNING):
            run = tracking.CellRun.start("layertune-ro", "cell-1", {"seed": 1}, uri=uri, journal_root=tmp_path / "j")
            run.end("FINISHED")
        out, err = capfd.readouterr()
        warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        # SQLite says "attempt to write a readonly database" or "disk I/O error", by journal mode
        assert len(warnings) == 1 and "failed (OperationalError: " in warnings[0], warnings
        assert "Traceback" not in out + err and "INSERT INTO" not in out + err + caplog.text
        assert (tmp_path / "j" / "layertune-ro" / "cell-1.json").is_file()  # kept, sent once the store is writable
    finally:
        subprocess.run(["chattr", "-i", str(tmp_path / "mlflow.db")], check=True)
