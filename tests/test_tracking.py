"""MLflow: a run per cell that ends FINISHED only on success; FAILED on an error, KILLED on Ctrl-C or SIGTERM. The
cell folder is the record: a tracking store that does not answer costs a cell seconds, never its outputs, and the
folder is logged once it answers."""

import contextlib
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


def save_folder(folder: Path, spec: CellSpec = CELL.spec) -> Path:
    """What the train node saves for a cell (`layertune.cell.TrainedCell.save`), less the model."""
    folder.mkdir(parents=True)
    (folder / "cell.json").write_text(spec.model_dump_json(indent=2) + "\n")
    (folder / "metrics.json").write_text(json.dumps(result().summary()))
    (folder / "history.json").write_text(json.dumps(result().history))
    (folder / "run_info.json").write_text(json.dumps({"frozen_prefix_cache": result().frozen_prefix_cache}))
    return folder


def run_hook(uri, study: str, folder: Path | None = None):
    from pipelines.hooks import MLFLOW_TAG, MlflowCellHook

    hook, node = MlflowCellHook(), SimpleNamespace(tags={MLFLOW_TAG})
    hook.catalog = catalog(trained_cell=folder) if folder else None
    hook.before_node_run(node=node, inputs={"cell_plan": cell(study)})
    return hook, node


def test_hook_finishes_only_after_the_whole_run_with_history_metrics_and_artifacts(uri, store, tmp_path):
    folder = tmp_path / "04_models" / "e1" / "sst2-m-2-1"
    hook, node = run_hook(uri, "e1", folder)
    save_folder(folder)  # the node's output, saved by Kedro after the node ran
    client, found = only_run(uri, "layertune-e1")
    assert found.info.status == "RUNNING"  # the run is not over yet
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
    assert found.data.tags["model_path"] == str(folder.resolve() / "model")
    tracking.sync("layertune-e1", folder.parent)  # the folder has its FINISHED run: nothing to do
    assert len(client.search_runs([found.info.experiment_id])) == 1


def test_a_folder_saved_in_an_earlier_form_of_the_spec_keeps_its_run(uri, tmp_path):
    """A cell saved before the spec lost a field (encoders' own `learning_rate`, now the cell's training rate) was
    tagged with the digest of the spec as written then: its run still matches, and a sync logs nothing twice."""
    from mlflow import MlflowClient

    folder = save_folder(tmp_path / "04_models" / "earlier" / "sst2-m-2-1")
    written = json.loads((folder / "cell.json").read_text())
    written["encoders"][0] = {**written["encoders"][0], "learning_rate": None}  # the form 25c9497 wrote
    (folder / "cell.json").write_text(json.dumps(written, indent=2))
    then = tracking._json_digest(written)
    assert then != tracking.spec_digest(CellSpec.model_validate(written))  # the spec read back has moved on
    client = MlflowClient(uri)
    experiment = client.create_experiment("layertune-earlier")
    run = client.create_run(experiment, run_name=folder.name, tags={tracking.SPEC_TAG: then})
    client.set_terminated(run.info.run_id)
    assert tracking.sync("layertune-earlier", folder.parent) == {}
    assert [r.info.run_id for r in client.search_runs([experiment])] == [run.info.run_id]


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


def test_a_sigterm_while_the_run_opens_ends_it_killed(uri, tmp_path):
    """SIGTERM arriving just after the run was created, before its handler was installed, ended the process and
    left the run RUNNING (CI saw it: `kill -9` of `dvc repro` as the cell's run appeared). It now waits for the
    handler."""
    script = tmp_path / "cell.py"
    script.write_text(textwrap.dedent("""
        import os, signal, time
        from types import SimpleNamespace
        from pipelines import tracking
        from pipelines.hooks import MLFLOW_TAG, MlflowCellHook
        from tests.test_tracking import cell

        start = tracking.CellRun.start
        def start_then_terminated(*args, **kwargs):
            run = start(*args, **kwargs)
            os.kill(os.getpid(), signal.SIGTERM)  # the run exists; its handler is not installed yet
            time.sleep(0.5)
            return run
        tracking.CellRun.start = start_then_terminated
        MlflowCellHook().before_node_run(node=SimpleNamespace(tags={MLFLOW_TAG}), inputs={"cell_plan": cell("e5")})
        time.sleep(60)
    """))
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    process = subprocess.run([sys.executable, str(script)], cwd=tmp_path, timeout=120, capture_output=True,
                             text=True, env={**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{root}/src"})
    assert process.returncode != 0 and "Terminated" in process.stderr, process.stderr[-2000:]
    assert only_run(uri, "layertune-e5")[1].info.status == "KILLED"


def test_a_second_sigterm_while_the_run_ends_does_not_leave_it_running(uri, tmp_path):
    """The first SIGTERM ends the run KILLED; a second one arriving as the run ends met the default handler (the
    cell's was gone by then) and killed the process with its run RUNNING (CI saw it after `kill -9` of `dvc repro`
    under load). The ending now runs whole."""
    script = tmp_path / "cell.py"
    script.write_text(textwrap.dedent("""
        import os, signal, time
        from types import SimpleNamespace
        from pipelines import tracking
        from pipelines.hooks import MLFLOW_TAG, MlflowCellHook
        from tests.test_tracking import cell

        end = tracking.CellRun.end
        def end_after_another_sigterm(self, status):
            os.kill(os.getpid(), signal.SIGTERM)  # the second signal, as the run ends
            time.sleep(0.5)
            end(self, status)
        tracking.CellRun.end = end_after_another_sigterm
        hook = MlflowCellHook()
        hook.before_node_run(node=SimpleNamespace(tags={MLFLOW_TAG}), inputs={"cell_plan": cell("e6")})
        try:
            os.kill(os.getpid(), signal.SIGTERM)  # the first
            time.sleep(60)
        except KeyboardInterrupt as error:
            hook.on_node_error(error, None)
            raise
    """))
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    process = subprocess.run([sys.executable, str(script)], cwd=tmp_path, timeout=120, capture_output=True,
                             text=True, env={**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{root}/src"})
    assert process.returncode != 0 and "Terminated" in process.stderr, process.stderr[-2000:]
    assert only_run(uri, "layertune-e6")[1].info.status == "KILLED"


# ------------------------------------------------------------------ a tracking store that does not answer

RETRY_VARIABLES = ("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR",
                   "MLFLOW_HTTP_REQUEST_BACKOFF_JITTER", "MLFLOW_HTTP_REQUEST_TIMEOUT")


def catalog(**paths):
    """What the hook reads of Kedro's catalog: where datasets live."""
    return SimpleNamespace(get=lambda name: SimpleNamespace(path=paths[name])
                           if name in paths else None)


def train_cell_hook(study: str, project: Path, seed: int = 1, **paths) -> Path:
    """The hook through a whole cell of ``project`` (its plan, then its folder saved), run in the project's folder
    as stages are; returns the cell's folder."""
    from pipelines.hooks import MLFLOW_TAG, MlflowCellHook

    planned = cell(study).model_copy(update={"seed": seed})
    plan = project / "data" / "00_plan" / study / "cells" / f"{planned.key}.json"
    plan.parent.mkdir(parents=True, exist_ok=True)
    plan.write_text(planned.model_dump_json())
    folder = project / "data" / "04_models" / study / planned.key
    hook, node = MlflowCellHook(), SimpleNamespace(tags={MLFLOW_TAG})
    hook.catalog = catalog(trained_cell=folder, **paths)
    with contextlib.chdir(project):
        hook.before_node_run(node=node, inputs={"cell_plan": planned})
        save_folder(folder, planned.spec)
        hook.after_pipeline_run()
    return folder


def test_an_unreachable_server_costs_seconds_and_one_warning_and_keeps_only_the_folder(tmp_path, monkeypatch, caplog):
    from tests.team_server import free_port

    for name in RETRY_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "7")  # the user's own setting is kept
    uri = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    started = time.monotonic()
    folder = train_cell_hook("down", tmp_path)
    elapsed = time.monotonic() - started
    assert elapsed < 30, elapsed  # MLflow's own retries took 256 s per call
    assert os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] == "2" and os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] == "7"
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and not warnings[0].exc_info, [r.getMessage() for r in warnings]
    assert uri in warnings[0].getMessage() and "Connection refused" in warnings[0].getMessage()
    assert "\n" not in warnings[0].getMessage()
    # no record of its own beside the cell's folder: that folder is what is logged later
    written = {str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file() and ".locks" not in p.parts}
    assert written == {f"data/00_plan/down/cells/{folder.name}.json",
                       *(str(p.relative_to(tmp_path)) for p in folder.iterdir())}


def test_a_folder_saved_while_mlflow_was_down_is_logged_when_the_next_cell_of_the_study_starts(uri, tmp_path,
                                                                                             monkeypatch):
    monkeypatch.setitem(tracking._failed, uri, time.monotonic())  # the store failed a moment ago, in this process
    train_cell_hook("back", tmp_path, seed=1)
    del tracking._failed[uri]  # the store answers again
    train_cell_hook("back", tmp_path, seed=2)
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
    assert kept.data.tags["dvc_stage"] == "train-back@sst2-m-2-1" and tracking.LOGGED_FROM_TAG in kept.data.tags


def test_runs_left_running_by_killed_cells_are_settled_by_the_evaluate_stage(uri, tmp_path):
    """Cells killed with SIGKILL whose training did not run again: a run whose process saved the folder before it
    died is completed from it; one whose folder is older (DVC restored it from its run-cache) or of another spec
    ends KILLED, and the folder gets a FINISHED run of its own, in the place of the run of its spec it replaces under
    a build's parent run; a live owner's run is left."""
    from mlflow import MlflowClient

    from pipelines.hooks import MlflowCellHook

    dead = subprocess.Popen(["true"])
    dead.wait()
    client = MlflowClient(uri)
    experiment = client.create_experiment("layertune-settle")
    owner = {tracking.HOST_TAG: socket.gethostname(), tracking.SPEC_TAG: tracking.spec_digest(CELL.spec)}
    runs = {name: client.create_run(experiment, run_name=name, tags={**owner, tracking.PID_TAG: str(pid), **(
                {tracking.PARENT_TAG: "p-1"} if pid == dead.pid else {})}).info  # under a build's parent run
            for name, pid in (("restored", dead.pid), ("older", dead.pid), ("other-spec", dead.pid),
                              ("failed", dead.pid), ("alive", os.getpid()))}
    client.set_terminated(runs["failed"].run_id, status="FAILED")  # ended without logging its folder
    cells = tmp_path / "04_models" / "settle"
    for name in ("restored", "older", "other-spec", "failed"):
        spec = CELL.spec.model_copy(update={"training": CELL.spec.training.model_copy(update={"seed": 9})}) \
            if name == "other-spec" else CELL.spec
        save_folder(cells / name, spec)
    old = runs["older"].start_time / 1000 - 3600  # written an hour before that run began: not its outputs
    for path in (cells / "older", cells / "older" / "metrics.json"):
        os.utime(path, (old, old))

    hook = MlflowCellHook()
    hook.catalog = catalog(study_cells=cells)
    hook.before_node_run(node=SimpleNamespace(tags=set()),
                         inputs={"study_plan": SimpleNamespace(name="settle"), "study_cells": {}})
    status = {name: client.get_run(info.run_id).info.status for name, info in runs.items()}
    assert status == {"restored": "FINISHED", "older": "KILLED", "other-spec": "KILLED", "failed": "FAILED",
                      "alive": "RUNNING"}
    restored = client.get_run(runs["restored"].run_id)
    assert restored.data.metrics["best_eval_accuracy"] == 0.75 and restored.data.metrics["test_accuracy"] == 0.7
    assert [m.step for m in client.get_metric_history(restored.info.run_id, "train_loss")] == [1, 2]
    every = client.search_runs([experiment])
    assert sorted((r.info.run_name, r.info.status) for r in every) == [
        ("alive", "RUNNING"), ("failed", "FAILED"), ("failed", "FINISHED"), ("older", "FINISHED"),
        ("older", "KILLED"), ("other-spec", "FINISHED"),
        ("other-spec", "KILLED"), ("restored", "FINISHED")]
    assert all(tracking.LOGGED_FROM_TAG in r.data.tags for r in every if r.info.run_id not in
               {info.run_id for info in runs.values()})
    assert "test_accuracy" not in client.get_run(runs["older"].run_id).data.metrics  # not credited with the folder
    # a folder's new run keeps the place of the run of its spec it replaces under a build's parent run
    for name in ("older", "failed"):
        assert {r.data.tags.get(tracking.PARENT_TAG) for r in every if r.info.run_name == name} == {"p-1"}
    client.set_terminated(runs["alive"].run_id)


def test_each_cell_logs_its_train_and_dev_data_as_dataset_inputs(uri, tmp_path):
    import mlflow.data

    prepared = tmp_path / "02_prepared"
    (prepared / "sst2").mkdir(parents=True)
    frames = {"train": pd.DataFrame({"sentence": ["a good film", "a bad film"], "label": [1, 0]}),
              "dev": pd.DataFrame({"sentence": ["great"], "label": [1]})}
    for split, frame in frames.items():
        frame.to_parquet(prepared / "sst2" / f"{split}.parquet")
    train_cell_hook("data", tmp_path, prepared_corpora=prepared)
    client, found = only_run(uri, "layertune-data")
    inputs = {d.dataset.name: d for d in found.inputs.dataset_inputs}
    assert sorted(inputs) == ["sst2-dev", "sst2-train"]
    for split, context in (("train", "training"), ("dev", "eval")):
        logged = inputs[f"sst2-{split}"]
        assert logged.dataset.digest == mlflow.data.from_pandas(frames[split]).digest
        assert str(prepared / "sst2" / f"{split}.parquet") in logged.dataset.source
        assert [(t.key, t.value) for t in logged.tags] == [("mlflow.data.context", context)]
        assert json.loads(logged.dataset.profile)["num_rows"] == len(frames[split])


def dead_pid() -> int:
    dead = subprocess.Popen(["true"])
    dead.wait()
    return dead.pid


def test_a_run_its_process_finished_while_a_sync_ran_stays_finished(uri, tmp_path):
    """A sync that read the runs while a cell's run was still RUNNING, and reaches it after the cell ended it
    FINISHED and exited, neither kills it nor logs its folder a second time."""
    from mlflow import MlflowClient

    client = MlflowClient(uri)
    experiment = client.create_experiment("layertune-race")
    tags = {tracking.HOST_TAG: socket.gethostname(), tracking.PID_TAG: str(dead_pid()),
            tracking.SPEC_TAG: tracking.spec_digest(CELL.spec)}
    run = client.create_run(experiment, run_name="sst2-m-2-1", tags=tags)
    cells = tmp_path / "04_models" / "race"
    save_folder(cells / "sst2-m-2-1")
    stale = client.search_runs([experiment])  # what the sync read: RUNNING
    client.set_terminated(run.info.run_id, status="FINISHED")  # then the cell ended its run, and exited

    class Stale:
        def __getattr__(self, name):
            return getattr(client, name)

        def search_runs(self, *args, **kwargs):
            return stale

    assert tracking._sync_runs(Stale(), experiment, tracking.saved_cells(cells)) == {}
    assert [(r.info.run_id, r.info.status) for r in client.search_runs([experiment])] == [
        (run.info.run_id, "FINISHED")]


def test_a_folder_that_cannot_be_read_is_skipped_and_the_others_are_logged(uri, tmp_path, caplog):
    from mlflow import MlflowClient

    cells = tmp_path / "04_models" / "odd"
    save_folder(cells / "sst2-m-2-1")
    broken = cells / "sst2-m-2-2"
    broken.mkdir()
    (broken / "cell.json").write_text("{not json")
    (broken / "metrics.json").write_text("{}")
    with caplog.at_level(logging.WARNING):
        ended = tracking.sync("layertune-odd", cells)
    assert list(ended.values()) == ["FINISHED"]
    assert tracking._reachable(uri)  # a bad folder is not a store that failed
    [warning] = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert warning.startswith(f"{broken} is not logged to MLflow: ValidationError")
    client = MlflowClient(uri)
    [run] = client.search_runs([client.get_experiment_by_name("layertune-odd").experiment_id])
    assert run.info.run_name == "sst2-m-2-1" and run.info.status == "FINISHED"


def test_a_rerun_ends_its_abandoned_run_while_another_process_syncs(uri, tmp_path, monkeypatch):
    from filelock import FileLock
    from mlflow import MlflowClient

    monkeypatch.chdir(tmp_path)
    client = MlflowClient(uri)
    experiment = client.create_experiment("layertune-busy")
    old = client.create_run(experiment, run_name="sst2-m-2-1", tags={
        tracking.HOST_TAG: socket.gethostname(), tracking.PID_TAG: str(dead_pid())})
    tracking.SYNC_LOCKS.mkdir(parents=True)
    with FileLock(tracking.SYNC_LOCKS / "tracking-sync-layertune-busy.lock"):  # another process's sync
        assert tracking.sync("layertune-busy", tmp_path / "04_models" / "busy") == {}
        run = tracking.CellRun.start("layertune-busy", "sst2-m-2-1", {}, uri=uri)
    assert client.get_run(old.info.run_id).info.status == "KILLED"
    run.end("FINISHED")


@pytest.mark.parametrize("build_over", [True, False, "collected"])
def test_a_ray_cells_run_left_running_on_another_machine_ends_with_its_build(uri, tmp_path, build_over):
    """A run whose process ran on another machine cannot be checked: it counts as abandoned once its build's parent
    run has ended (its node was lost, or the server was down when the build closed), or is gone from the store
    (deleted, and collected by `mlflow gc`)."""
    from mlflow import MlflowClient

    client = MlflowClient(uri)
    experiment = client.create_experiment(f"layertune-far-{build_over}")
    parent = client.create_run(experiment, run_name="build b").info.run_id
    if build_over is True:
        client.set_terminated(parent, status="FINISHED")
    if build_over == "collected":
        parent = "0" * 32
    far = client.create_run(experiment, run_name="sst2-m-2-1", tags={
        tracking.HOST_TAG: "another-machine", tracking.PID_TAG: "1", tracking.PARENT_TAG: parent})
    tracking.sync(f"layertune-far-{build_over}", tmp_path / "none")
    build_over = bool(build_over)
    assert client.get_run(far.info.run_id).info.status == ("KILLED" if build_over else "RUNNING")
    # the same rule when the cell trains again here: its start ends the far run it replaces, once the build is over
    again = client.create_run(experiment, run_name="sst2-m-2-1", tags=far.data.tags)
    ended = tracking.end_abandoned_runs(client, experiment, "sst2-m-2-1")
    assert ended == ([again.info.run_id] if build_over else [])
    for run in (far, again):
        client.set_terminated(run.info.run_id)


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
    line; once the server is back, `python -m pipelines.tracking sync` completes the cell's run there from its folder:
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

    with mlflow_server(store, tmp_path / "artifacts", port=port):
        synced = subprocess.run([sys.executable, "-m", "pipelines.tracking", "sync"], cwd=project, env=env,
                                capture_output=True, text=True, timeout=300)
        assert synced.returncode == 0, synced.stdout + synced.stderr
        assert "1 cell folder(s) logged" in synced.stdout
        [found] = server_runs(url)
    assert found.info.status == "FINISHED" and found.data.params["epochs"] == "100"
    saved = json.loads((folder / "metrics.json").read_text())
    assert found.data.metrics["best_eval_accuracy"] == saved["eval_accuracy"]
    assert sorted(d.dataset.name for d in found.inputs.dataset_inputs) == ["sst2-dev", "sst2-train"]
    assert tracking.LOGGED_FROM_TAG not in found.data.tags  # the cell's own run, completed


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
            run = tracking.CellRun.start("layertune-ro", "cell-1", {"seed": 1}, uri=uri)
            run.end("FINISHED")
        out, err = capfd.readouterr()
        warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        # SQLite says "attempt to write a readonly database" or "disk I/O error", by journal mode
        assert len(warnings) == 1 and "failed (OperationalError: " in warnings[0], warnings
        assert "Traceback" not in out + err and "INSERT INTO" not in out + err + caplog.text
    finally:
        subprocess.run(["chattr", "-i", str(tmp_path / "mlflow.db")], check=True)
