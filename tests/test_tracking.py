"""MLflow: one process owns a study build's runs, a parent run and one child per cell, which ends FINISHED only once
the cell's folder is saved; FAILED on an error, KILLED on Ctrl-C or SIGTERM, and KILLED by the next build when the
build was killed with SIGKILL. The cell folder is the record: a tracking store that does not answer costs a build
seconds, never a cell, and the folder is logged once it answers."""

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

import pandas as pd
import pytest

from layertune.io import file_digests
from layertune.specs import CellSpec, CorpusSpec, EncoderSpec
from layertune.study import StudyCell
from layertune.trainer import TrainingResult
from pipelines import tracking
from pipelines.processes import Terminated, terminated_as_interrupt
from pipelines.trained_cells import BUILD_FILE, TrainedCells, spec_digest

ROOT = Path(__file__).resolve().parents[1]
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


def runs_of(uri: str, study: str) -> list:
    from mlflow import MlflowClient

    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name(f"layertune-{study}")
    return client.search_runs([experiment.experiment_id]) if experiment else []


def statuses(uri: str, study: str) -> list[tuple[str, str]]:
    return sorted((run.info.run_name, run.info.status) for run in runs_of(uri, study))


def cell(study: str, seed: int = 1) -> StudyCell:
    return CELL.model_copy(update={"study": study, "seed": seed})


def result() -> TrainingResult:
    return TrainingResult(
        history=[{"epoch": 1, "train_loss": 0.7, "eval_accuracy": 0.5}, {"epoch": 2, "train_loss": 0.5,
                                                                       "eval_accuracy": 0.75}],
        best_epoch=2, best_metrics={"eval_accuracy": 0.75}, main_metric="accuracy", train_time_s=1.5,
        samples_per_s=10.0, peak_memory_mb=1.0, trainable_parameters=3, total_parameters=9,
        frozen_prefix_cache={"used": True, "reason": "cached, by estimate: …", "estimate": {"pass_s": 1.5}},
        predictions={}, test_metrics={"test_accuracy": 0.7},
        drift=pd.DataFrame())


def save_folder(folder: Path, spec: CellSpec = CELL.spec, build_key: str = "k1") -> Path:
    """What the train stage saves for a cell (`TrainedCells.write`), less the model."""
    folder.mkdir(parents=True)
    (folder / "cell.json").write_text(spec.model_dump_json(indent=2) + "\n")
    (folder / "metrics.json").write_text(json.dumps(result().summary()))
    (folder / "history.json").write_text(json.dumps(result().history))
    (folder / "run_info.json").write_text(json.dumps({"frozen_prefix_cache": result().frozen_prefix_cache}))
    record = {"key": build_key, "spec": spec_digest(spec), "files": file_digests(folder)}  # last: it proves the rest
    (folder / BUILD_FILE).write_text(json.dumps(record))
    return folder


def study_runs(study: str, root: Path, planned: list[StudyCell] = (), prepared=None, **kwargs):
    cells = TrainedCells(root / study, root / ".retired" / study)
    return cells, tracking.StudyRuns(study, cells, {c.key: c for c in planned}, prepared or {}, **kwargs)


def test_run_params_are_flat_and_name_the_cell():
    params = tracking.cell_params(CELL)
    assert {params[k] for k in ("study", "task", "encoder", "tunable_layers", "seed")} == {"e", "sst2", "m", 2, 1}
    assert params["models"] == "org/m" and params["pooling"] == "mean" and params["train_size"] == 10
    assert params["learning_rate"] == 5e-5 and "seed" not in {k for k in params if k.startswith("training")}


def test_end_status_of_errors_and_interruptions():
    assert tracking.end_status(None) == "FINISHED"
    assert tracking.end_status(RuntimeError()) == "FAILED"
    assert tracking.end_status(KeyboardInterrupt()) == tracking.end_status(Terminated()) == "KILLED"


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_a_stop_signal_raises_within_the_block_and_restores_the_handler(signum):
    before = signal.getsignal(signum)
    with pytest.raises(Terminated), terminated_as_interrupt():
        os.kill(os.getpid(), signum)
        signal.sigtimedwait([], 1)
    assert signal.getsignal(signum) is before


def test_a_build_is_a_parent_run_and_each_cell_a_child_finished_once_its_folder_is_saved(uri, store, tmp_path):
    planned = [cell("b1", 1), cell("b1", 2)]
    cells, runs = study_runs("b1", tmp_path, planned)
    with runs:
        runs.open_build({"cells": 2, "where": "in this process"})
        for each in planned:
            runs.started(each.key)
            assert ("sst2-m-2-%d" % each.seed, "RUNNING") in statuses(uri, "b1")  # the UI shows what trains
            save_folder(cells.path / each.key, each.spec, build_key=f"key-{each.seed}")
            runs.finished(each.key)
    found = {run.info.run_name: run for run in runs_of(uri, "b1")}
    parent = next(run for name, run in found.items() if name.startswith("build "))
    assert sorted((name, run.info.status) for name, run in found.items()) == [
        (parent.info.run_name, "FINISHED"), ("sst2-m-2-1", "FINISHED"), ("sst2-m-2-2", "FINISHED")]
    assert parent.data.params["cells"] == "2" and parent.data.params["where"] == "in this process"
    run = found["sst2-m-2-1"]
    assert run.data.tags[tracking.PARENT_TAG] == parent.info.run_id
    assert run.data.tags[tracking.BUILD_TAG] == parent.data.tags[tracking.BUILD_TAG]
    assert run.data.params["tunable_layers"] == "2" and run.data.params["head_learning_rate"] == "0.003"
    assert run.data.tags["dvc_stage"] == "train@b1" and run.data.tags["study"] == "b1"
    assert run.data.tags[tracking.BUILD_KEY_TAG] == "key-1"
    from mlflow import MlflowClient

    client = MlflowClient(uri)
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "eval_accuracy")] == [
        (1, 0.5), (2, 0.75)]
    assert run.data.metrics["best_eval_accuracy"] == 0.75 and run.data.metrics["test_accuracy"] == 0.7
    assert sorted(a.path for a in client.list_artifacts(run.info.run_id)) == ["history.json", "metrics.json",
                                                                              "run_info.json"]
    assert run.data.tags["frozen_prefix_cache.used"] == "True"  # what the cache decided, and why
    assert run.data.tags["frozen_prefix_cache.reason"].startswith("cached, by estimate")
    assert (store / "mlartifacts" / "layertune-b1").is_dir()  # artifacts beside the database, not in the cwd
    assert run.data.tags["model_path"] == str((cells.path / "sst2-m-2-1").resolve() / "model")
    assert tracking.Store("layertune-b1").call(tracking.sync, cells, {}, {}) == {}  # every folder has its run


def test_logging_a_folder_again_changes_nothing_however_it_is_named(uri, tmp_path, monkeypatch):
    from mlflow import MlflowClient

    client = MlflowClient(uri)
    run = client.create_run(client.create_experiment("layertune-twice"))
    folder = save_folder(tmp_path / "data" / "04_models" / "twice" / "sst2-m-2-1")
    tracking.log_cell(client, run, tracking.SavedCell.read(folder))
    first = client.get_run(run.info.run_id).data
    monkeypatch.chdir(tmp_path)
    tracking.log_cell(client, run, tracking.SavedCell.read(Path("data/04_models/twice/sst2-m-2-1")))
    again = client.get_run(run.info.run_id).data
    assert (again.metrics, again.params, again.tags) == (first.metrics, first.params, first.tags)
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "eval_accuracy")] == [
        (1, 0.5), (2, 0.75)]


def test_a_failed_cell_ends_failed_the_others_killed_and_the_build_failed(uri, tmp_path):
    from pipelines.scheduling import CellFailed

    planned = [cell("b2", 1), cell("b2", 2)]
    _, runs = study_runs("b2", tmp_path, planned)
    with pytest.raises(CellFailed), runs:
        runs.open_build({})
        runs.started("sst2-m-2-1")
        runs.started("sst2-m-2-2")
        raise CellFailed("sst2-m-2-2", "FloatingPointError: the loss is NaN")
    found = {name: status for name, status in statuses(uri, "b2")}
    assert found["sst2-m-2-1"] == "KILLED" and found["sst2-m-2-2"] == "FAILED"
    assert [status for name, status in found.items() if name.startswith("build ")] == ["FAILED"]


def test_an_interrupted_build_ends_every_open_run_killed(uri, tmp_path):
    _, runs = study_runs("b3", tmp_path, [cell("b3")])
    with pytest.raises(KeyboardInterrupt), runs:
        runs.open_build({})
        runs.started("sst2-m-2-1")
        raise KeyboardInterrupt
    assert {status for _, status in statuses(uri, "b3")} == {"KILLED"} and len(statuses(uri, "b3")) == 2


BUILD_SCRIPT = """
import os, signal, sys, time
from pathlib import Path
from pipelines.processes import terminated_as_interrupt
from tests.test_tracking import cell, study_runs
_, runs = study_runs({study!r}, Path({root!r}), [cell({study!r})])
with terminated_as_interrupt(), runs:
    runs.open_build({{}})
    runs.started("sst2-m-2-1")
    print("started", flush=True)
    time.sleep(120)
"""


def start_build(study: str, tmp_path: Path) -> subprocess.Popen:
    process = subprocess.Popen([sys.executable, "-c", BUILD_SCRIPT.format(study=study, root=str(tmp_path))],
                               stdout=subprocess.PIPE, text=True, cwd=ROOT,
                               env={**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'src'}"})
    assert process.stdout.readline().strip() == "started"
    return process


def test_sigterm_to_a_build_ends_its_runs_killed(uri, tmp_path):
    build = start_build("b4", tmp_path)
    build.send_signal(signal.SIGTERM)
    assert build.wait(timeout=60) != 0
    assert {status for _, status in statuses(uri, "b4")} == {"KILLED"} and len(statuses(uri, "b4")) == 2


@pytest.mark.parametrize("when", ["create", "log"])
def test_a_sigterm_while_a_run_opens_ends_it_killed(uri, tmp_path, when):
    """SIGTERM in the middle of a run's creation (between its creation and its owner knowing it, or while its
    parameters are logged) left it RUNNING, and MLflow's session broken for the build's own run (CI: `kill -9` of
    `dvc repro` as a cell started). The signal now waits for the call, then stops the build."""
    study = f"opening-{when}"
    script = BUILD_SCRIPT.replace("_, runs = study_runs", textwrap.dedent(f"""
        from mlflow import MlflowClient
        patched = getattr(MlflowClient, {"create_run" if when == "create" else "log_batch"!r})
        def then_terminated(self, *args, **kwargs):
            found = patched(self, *args, **kwargs)
            if kwargs.get("run_name") != "build" and not str(kwargs.get("run_name", "")).startswith("build"):
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(0.5)
            return found
        setattr(MlflowClient, {"create_run" if when == "create" else "log_batch"!r}, then_terminated)
        _, runs = study_runs"""), 1)
    build = subprocess.run([sys.executable, "-c", script.format(study=study, root=str(tmp_path))], cwd=ROOT,
                           capture_output=True, text=True, timeout=120,
                           env={**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'src'}"})
    assert build.returncode != 0 and "Terminated" in build.stderr, build.stderr[-2000:]
    assert {status for _, status in statuses(uri, study)} == {"KILLED"} and len(statuses(uri, study)) >= 1


def test_runs_a_build_killed_with_sigkill_left_running_are_ended_by_the_next_build(uri, tmp_path):
    """Nothing can end a run when its process is killed with SIGKILL; the next build of the study ends it KILLED, and
    the build's parent run with it. A run whose owner lives, or whose owner is another machine's (which cannot be
    checked from here), is left to it."""
    from mlflow import MlflowClient

    build = start_build("b5", tmp_path)
    build.kill()
    build.wait()
    assert {status for _, status in statuses(uri, "b5")} == {"RUNNING"}
    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name("layertune-b5").experiment_id
    alive = client.create_run(experiment, run_name="alive", tags={
        tracking.HOST_TAG: socket.gethostname(), tracking.PID_TAG: str(os.getpid())})
    far = client.create_run(experiment, run_name="far", tags={tracking.HOST_TAG: "another-machine",
                                                              tracking.PID_TAG: "1"})
    _, runs = study_runs("b5", tmp_path)
    with runs:
        pass
    found = dict(statuses(uri, "b5"))
    assert found.pop("alive") == found.pop("far") == "RUNNING" and set(found.values()) == {"KILLED"}
    for run in (alive, far):
        client.set_terminated(run.info.run_id)


# ------------------------------------------------------------------ a tracking store that does not answer

RETRY_VARIABLES = ("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR",
                   "MLFLOW_HTTP_REQUEST_BACKOFF_JITTER", "MLFLOW_HTTP_REQUEST_TIMEOUT")


def test_an_unreachable_server_costs_seconds_and_one_warning_and_keeps_only_the_folders(tmp_path, monkeypatch,
                                                                                        caplog):
    from tests.team_server import free_port

    for name in RETRY_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "7")  # the user's own setting is kept
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    monkeypatch.setenv("MLFLOW_TRACKING_URI", url)
    started = time.monotonic()
    planned = [cell("down", seed) for seed in (1, 2, 3)]
    cells, runs = study_runs("down", tmp_path, planned)
    with runs:
        runs.open_build({})
        for each in planned:
            runs.started(each.key)
            save_folder(cells.path / each.key, each.spec)
            runs.finished(each.key)
    elapsed = time.monotonic() - started
    assert elapsed < 30, elapsed  # MLflow's own retries took 256 s per call
    assert os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] == "2" and os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] == "7"
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and not warnings[0].exc_info, [r.getMessage() for r in warnings]
    assert url in warnings[0].getMessage() and "Connection refused" in warnings[0].getMessage()
    assert "\n" not in warnings[0].getMessage()
    # no record of its own beside the cells' folders: they are what is logged later
    assert {p.parent.name for p in tmp_path.rglob("*") if p.is_file()} == {each.key for each in planned}


def test_folders_saved_while_mlflow_was_down_are_logged_when_the_build_ends(uri, tmp_path, monkeypatch):
    import mlflow.data

    prepared = tmp_path / "02_prepared" / "sst2"
    prepared.mkdir(parents=True)
    frames = {"train": pd.DataFrame({"sentence": ["a good film", "a bad film"], "label": [1, 0]}),
              "dev": pd.DataFrame({"sentence": ["great"], "label": [1]})}
    for split, frame in frames.items():
        frame.to_parquet(prepared / f"{split}.parquet")
    planned = [cell("back", 1), cell("back", 2)]
    cells, runs = study_runs("back", tmp_path, planned, prepared={"sst2": prepared})
    with runs:
        runs.open_build({})
        monkeypatch.setitem(tracking._failed, uri, time.monotonic())  # the store fails as the first cell trains
        runs.started("sst2-m-2-1")
        save_folder(cells.path / "sst2-m-2-1")
        runs.finished("sst2-m-2-1")
        del tracking._failed[uri]  # and answers again
        runs.started("sst2-m-2-2")
        save_folder(cells.path / "sst2-m-2-2", planned[1].spec)
        runs.finished("sst2-m-2-2")
    found = {run.info.run_name: run for run in runs_of(uri, "back")}
    assert sorted((name, run.info.status) for name, run in found.items() if not name.startswith("build")) == [
        ("sst2-m-2-1", "FINISHED"), ("sst2-m-2-2", "FINISHED")]
    kept = found["sst2-m-2-1"]
    assert tracking.LOGGED_FROM_TAG in kept.data.tags and tracking.LOGGED_FROM_TAG not in found["sst2-m-2-2"].data.tags
    assert kept.data.params["seed"] == "1" and kept.data.metrics["best_eval_accuracy"] == 0.75
    assert kept.data.tags["dvc_stage"] == "train@back" and kept.data.tags[tracking.BUILD_KEY_TAG] == "k1"
    from mlflow import MlflowClient

    client = MlflowClient(uri)
    assert [(m.step, m.value) for m in client.get_metric_history(kept.info.run_id, "eval_accuracy")] == [
        (1, 0.5), (2, 0.75)]
    # each cell's train and dev data are its run's dataset inputs, whether it logged itself or was logged later
    for run in found.values():
        if run.info.run_name.startswith("build"):
            continue
        inputs = {d.dataset.name: d for d in run.inputs.dataset_inputs}
        assert sorted(inputs) == ["sst2-dev", "sst2-train"]
        for split, context in (("train", "training"), ("dev", "eval")):
            logged = inputs[f"sst2-{split}"]
            assert logged.dataset.digest == mlflow.data.from_pandas(frames[split]).digest
            assert str(prepared / f"{split}.parquet") in logged.dataset.source
            assert [(t.key, t.value) for t in logged.tags] == [("mlflow.data.context", context)]


def test_a_cell_trained_again_supersedes_its_earlier_run(uri, tmp_path):
    """A cell whose build key changed (its trainer was edited, say) is trained again into the same folder: the run
    of its earlier build ends KILLED, tagged with the run that replaced it, so each folder has one FINISHED run.
    Another cell's run stays FINISHED."""
    planned = [cell("again", 1), cell("again", 2)]
    cells, runs = study_runs("again", tmp_path, planned)
    with runs:
        for each in planned:
            runs.started(each.key)
            save_folder(cells.path / each.key, each.spec)
            runs.finished(each.key)
    import shutil

    shutil.rmtree(cells.path / "sst2-m-2-1")
    _, runs = study_runs("again", tmp_path, planned)
    with runs:
        runs.started("sst2-m-2-1")
        save_folder(cells.path / "sst2-m-2-1", build_key="k2")
        runs.finished("sst2-m-2-1")
    found = sorted(((run.info.run_name, run.data.tags.get(tracking.BUILD_KEY_TAG), run.info.status)
                    for run in runs_of(uri, "again")))
    assert found == [("sst2-m-2-1", "k1", "KILLED"), ("sst2-m-2-1", "k2", "FINISHED"),
                     ("sst2-m-2-2", "k1", "FINISHED")]
    superseded = next(run for run in runs_of(uri, "again") if run.info.status == "KILLED")
    replacing = next(run for run in runs_of(uri, "again") if run.data.tags.get(tracking.BUILD_KEY_TAG) == "k2")
    assert superseded.data.tags[tracking.SUPERSEDED_TAG] == replacing.info.run_id


def test_a_cell_trained_again_for_the_same_build_keeps_one_finished_run(uri, tmp_path):
    """A folder lost (deleted, or set aside as unproven) and its cell trained again for the same build key: the new
    run stands for the folder, the earlier one ends KILLED, tagged with it. Two FINISHED runs of one build that an
    earlier version left are settled the same way by `sync`."""
    import shutil

    from mlflow import MlflowClient

    planned = [cell("same-build", 1)]
    for _ in range(2):
        cells, runs = study_runs("same-build", tmp_path, planned)
        shutil.rmtree(cells.path / planned[0].key, ignore_errors=True)
        with runs:
            runs.started(planned[0].key)
            save_folder(cells.path / planned[0].key, planned[0].spec)
            runs.finished(planned[0].key)
    found = sorted(runs_of(uri, "same-build"), key=lambda run: run.info.start_time)
    assert [run.info.status for run in found] == ["KILLED", "FINISHED"]
    assert found[0].data.tags[tracking.SUPERSEDED_TAG] == found[1].info.run_id

    client = MlflowClient(uri)
    client.set_terminated(found[0].info.run_id, status="FINISHED")  # as a build before this rule left it
    settled = tracking.Store("layertune-same-build").call(tracking.sync, cells, {}, {})
    assert settled == {found[0].info.run_id: "KILLED"}
    assert sorted(run.info.status for run in runs_of(uri, "same-build")) == ["FINISHED", "KILLED"]


def test_sync_names_a_folder_it_cannot_read_and_logs_the_others(uri, tmp_path, monkeypatch):
    """`python -m pipelines.tracking sync`, in a project: a cell folder whose metrics.json is not the one its build
    wrote (here: cut short, not JSON) is named with the file and what is wrong (it was `StopIteration: 12`); the
    good folder is logged."""
    import shutil

    shutil.copytree(ROOT / "conf", tmp_path / "conf")  # a project's: the catalog says where its cells are
    models = tmp_path / "data" / "04_models" / "odd"
    save_folder(models / "sst2-m-2-1")
    broken = save_folder(models / "sst2-m-2-2")
    (broken / "metrics.json").write_text('{"eval_accuracy": 0.7,')
    done = subprocess.run([sys.executable, "-m", "pipelines.tracking", "sync"], cwd=tmp_path, capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'src'}"})
    assert done.returncode == 0, done.stderr
    assert "1 cell folder(s) logged" in done.stdout
    [warning] = [line for line in done.stderr.splitlines() if line.startswith("WARNING")]
    assert "data/04_models/odd/sst2-m-2-2 is not logged to MLflow: it does not prove its build (metrics.json is not " \
           "the file its build wrote" in warning, warning
    assert statuses(uri, "odd") == [("sst2-m-2-1", "FINISHED")]


# ------------------------------------------------------------- a real server killed while a cell trains


def server_runs(url: str) -> list:
    from mlflow import MlflowClient

    client = MlflowClient(url)
    experiment = client.get_experiment_by_name("layertune-slow")
    return client.search_runs([experiment.experiment_id]) if experiment else []


@pytest.mark.slow
def test_a_tracking_server_killed_mid_cell_loses_no_cell(tmp_path, monkeypatch):
    """A real `mlflow server` killed while a study's cell trains: the stage succeeds with the cell's folder and one
    warning line; once the server is back, `python -m pipelines.tracking sync` logs the cell there from its folder:
    FINISHED, with its parameters, metrics and dataset inputs."""
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
    command = [sys.executable, "-m", "kedro", "run", "--pipelines", "train", "--params", "study=slow"]

    with mlflow_server(store, tmp_path / "artifacts", port=port), open(log, "w") as output:
        stage = subprocess.Popen(command, cwd=project, env=env, stdout=output, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while len(server_runs(url)) < 2 and stage.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert [r.info.status for r in server_runs(url)] == ["RUNNING", "RUNNING"]  # the build and its cell
    assert stage.wait(timeout=300) == 0, log.read_text()[-3000:]  # the server was gone before training ended
    assert (folder / "metrics.json").is_file()
    warnings = [line for line in log.read_text().splitlines() if "WARNING" in line or "Traceback" in line]
    assert len(warnings) == 1 and url in warnings[0], log.read_text()

    with mlflow_server(store, tmp_path / "artifacts", port=port):
        synced = subprocess.run([sys.executable, "-m", "pipelines.tracking", "sync"], cwd=project, env=env,
                                capture_output=True, text=True, timeout=300)
        assert synced.returncode == 0, synced.stdout + synced.stderr
        found = server_runs(url)
    assert sorted((run.info.run_name.split()[0], run.info.status) for run in found) == [
        ("build", "KILLED"), ("sst2-tiny-1-1", "FINISHED")]  # nothing could end the build's own run
    logged = next(run for run in found if run.info.run_name == "sst2-tiny-1-1")
    assert tracking.LOGGED_FROM_TAG not in logged.data.tags  # the cell's own run, completed from its folder
    assert logged.data.params["epochs"] == "100"
    saved = json.loads((folder / "metrics.json").read_text())
    assert logged.data.metrics["best_eval_accuracy"] == saved["eval_accuracy"]
    assert sorted(d.dataset.name for d in logged.inputs.dataset_inputs) == ["sst2-dev", "sst2-train"]


def test_a_read_only_store_is_one_warning_line_and_the_build_goes_on(tmp_path, capfd, caplog):
    """A read-only mlflow.db printed ~70 lines of SQLAlchemy (MLflow's SQL store logs each database error with its
    traceback). Made read-only with chattr, which binds root too (a file mode does not)."""
    import shutil

    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    MlflowClient(uri).search_experiments(max_results=1)  # the store exists, with its tables
    if shutil.which("chattr") is None or subprocess.run(["chattr", "+i", str(tmp_path / "mlflow.db")]).returncode:
        pytest.skip("chattr +i is not available on this filesystem")
    try:
        capfd.readouterr()
        with caplog.at_level(logging.WARNING):
            _, runs = study_runs("ro", tmp_path, [cell("ro")], uri=uri)
            with runs:
                runs.open_build({})
                runs.started("sst2-m-2-1")
        out, err = capfd.readouterr()
        warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        # SQLite says "attempt to write a readonly database" or "disk I/O error", by journal mode
        assert len(warnings) == 1 and "failed (OperationalError: " in warnings[0], warnings
        assert "Traceback" not in out + err and "INSERT INTO" not in out + err + caplog.text
    finally:
        subprocess.run(["chattr", "-i", str(tmp_path / "mlflow.db")], check=True)
