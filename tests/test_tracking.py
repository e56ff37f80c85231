"""MLflow: a run per cell that ends FINISHED only on success; FAILED on an error, KILLED on Ctrl-C or SIGTERM."""

import os
import signal
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pandas as pd
import pytest

from layertune import tracking
from layertune.cell import CellSpec, CorpusSpec, EncoderSpec
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
        frozen_prefix_cache={"used": True}, predictions={}, test_metrics={"test_accuracy": 0.7},
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
    assert found.data.params["tunable_layers"] == "2" and found.data.params["head_learning_rate"] == "None"
    assert found.data.tags["dvc_stage"] == "train-e1@sst2-m-2-1" and found.data.tags["study"] == "e1"
    assert [(m.step, m.value) for m in client.get_metric_history(found.info.run_id, "eval_accuracy")] == [
        (1, 0.5), (2, 0.75)]
    assert found.data.metrics["best_eval_accuracy"] == 0.75 and found.data.metrics["test_accuracy"] == 0.7
    assert sorted(a.path for a in client.list_artifacts(found.info.run_id)) == ["history.json", "metrics.json"]
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
