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


def test_finished_run_has_params_history_and_artifacts(uri, store):
    with tracking.track_run("study-a", "cell", {"task": "sst2", "tunable_layers": "all", "head_learning_rate": None},
                            tags={"dvc_stage": "train@x"}) as run:
        run.log_history([{"epoch": 1, "eval_accuracy": 0.5}, {"epoch": 2, "eval_accuracy": 0.75}])
        run.log_metrics(tracking.final_metrics({"eval_accuracy": 0.75, "train_time_s": 3.0, "seed": 1,
                                                "frozen_prefix_cache_used": True}))
        run.log_dict({"a": 1}, "metrics.json")
    client, found = only_run(uri, "study-a")
    assert found.info.status == "FINISHED"
    assert found.data.params == {"task": "sst2", "tunable_layers": "all", "head_learning_rate": "None"}
    assert found.data.tags["dvc_stage"] == "train@x"
    assert [(m.step, m.value) for m in client.get_metric_history(found.info.run_id, "eval_accuracy")] == [
        (1, 0.5), (2, 0.75)]
    assert found.data.metrics["best_eval_accuracy"] == 0.75 and "seed" not in found.data.metrics
    assert [a.path for a in client.list_artifacts(found.info.run_id)] == ["metrics.json"]
    assert (store / "mlartifacts" / "study-a").is_dir()  # artifacts beside the database, not in the cwd


def test_exception_ends_failed(uri):
    with pytest.raises(RuntimeError), tracking.track_run("study-b", "cell", {}):
        raise RuntimeError("boom")
    assert only_run(uri, "study-b")[1].info.status == "FAILED"


def test_keyboard_interrupt_ends_killed(uri):
    with pytest.raises(KeyboardInterrupt), tracking.track_run("study-c", "cell", {}):
        raise KeyboardInterrupt
    assert only_run(uri, "study-c")[1].info.status == "KILLED"


def test_sigterm_ends_killed_and_restores_the_handler(uri):
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(tracking.Terminated), tracking.track_run("study-d", "cell", {}):
        os.kill(os.getpid(), signal.SIGTERM)
        signal.sigtimedwait([], 1) if hasattr(signal, "sigtimedwait") else None
    assert only_run(uri, "study-d")[1].info.status == "KILLED"
    assert signal.getsignal(signal.SIGTERM) is before


def hook_run(hook, uri, experiment):
    from pipelines.hooks import MLFLOW_TAG

    hook.after_context_created(SimpleNamespace(params={"study": {"name": experiment}, "train": {"epochs": 2}}))
    node = SimpleNamespace(tags={MLFLOW_TAG})
    cell = {"task": "sst2", "model": "org/m", "tunable_layers": 2, "seed": 1}
    hook.before_node_run(node=node, inputs={"params:cell": cell})
    return node


def test_hook_finishes_only_after_the_whole_run(uri):
    from pipelines.hooks import MlflowCellHook

    hook = MlflowCellHook()
    node = hook_run(hook, uri, "e1")
    hook.after_node_run(node=node, outputs={
        "cell_metrics": {"eval_accuracy": 0.8, "train_time_s": 1.5}, "cell_history": [{"epoch": 1, "train_loss": 0.7}],
        "cell_drift": pd.DataFrame({"part": ["head"], "relative_l2": [0.1]})})
    client, found = only_run(uri, "layertune-e1")
    assert found.info.status == "RUNNING"  # outputs are not saved yet
    hook.after_pipeline_run()
    client, found = only_run(uri, "layertune-e1")
    assert found.info.status == "FINISHED"
    assert found.data.params["tunable_layers"] == "2" and found.data.params["epochs"] == "2"
    assert found.data.tags["dvc_stage"] == "train@sst2-org/m-2-1"
    assert sorted(a.path for a in client.list_artifacts(found.info.run_id)) == [
        "drift.csv", "history.json", "metrics.json"]


def test_hook_failed_on_node_error(uri):
    from pipelines.hooks import MlflowCellHook

    hook = MlflowCellHook()
    node = hook_run(hook, uri, "e2")
    hook.on_node_error(error=ValueError("bad"), node=node)
    hook.after_pipeline_run()  # already ended: stays FAILED
    assert only_run(uri, "layertune-e2")[1].info.status == "FAILED"


def test_hook_killed_when_interrupted_before_kedro_could_tell(uri):
    from pipelines.hooks import MlflowCellHook

    hook = MlflowCellHook()
    hook_run(hook, uri, "e3")
    hook.end_open_run()  # what atexit calls after Ctrl-C, which skips Kedro's error hooks
    assert only_run(uri, "layertune-e3")[1].info.status == "KILLED"


def test_sigterm_to_a_tracked_process_ends_its_run_killed(uri, tmp_path):
    """A real process: the hook starts a run, the 'cell' is killed with SIGTERM mid-work."""
    script = tmp_path / "cell.py"
    script.write_text(textwrap.dedent("""
        import sys, time
        from types import SimpleNamespace
        from pipelines.hooks import MLFLOW_TAG, MlflowCellHook
        hook = MlflowCellHook()
        hook.after_context_created(SimpleNamespace(params={"study": {"name": "e4"}}))
        hook.before_node_run(node=SimpleNamespace(tags={MLFLOW_TAG}),
                             inputs={"params:cell": {"task": "sst2", "model": "m", "tunable_layers": 0, "seed": 1}})
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
