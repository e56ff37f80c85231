"""Interrupted, killed and concurrent runs leave nothing stale: MLflow runs, staging folders, partial outputs."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from layertune.io import write_json
from tests.projects import make_project, project_env, run, study

ROOT = Path(__file__).resolve().parents[1]


def test_four_cells_starting_at_once_on_a_new_mlflow_database_all_finish(tmp_path):
    """MLflow's creation of a new database is not safe for several processes at once; cells wait for one another."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    go = tmp_path / "go"
    script = textwrap.dedent(f"""
        import sys, time
        from pathlib import Path
        from pipelines.tracking import CellRun
        while not Path({str(go)!r}).exists():
            time.sleep(0.005)
        run = CellRun.start("layertune-race", f"cell-{{sys.argv[1]}}", {{"seed": sys.argv[1]}}, uri={uri!r})
        run.end("FINISHED")
    """)
    cells = [subprocess.Popen([sys.executable, "-c", script, str(i)], env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
                              stderr=subprocess.PIPE, text=True) for i in range(4)]
    time.sleep(3)  # every process has imported MLflow and waits
    go.touch()
    errors = [cell.communicate(timeout=120)[1] for cell in cells]
    assert [cell.returncode for cell in cells] == [0, 0, 0, 0], errors
    from mlflow import MlflowClient

    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name("layertune-race").experiment_id])
    assert sorted((r.info.run_name, r.info.status) for r in runs) == [(f"cell-{i}", "FINISHED") for i in range(4)]


@pytest.fixture
def slow_project(tmp_path):
    """One cell whose training takes seconds (many epochs of a tiny model), prepared up to its train stage."""
    slow = study("layers", ["sst2"], {"tiny": "models/tiny-a"}, [1], [1])
    slow["training"]["epochs"] = 30  # seconds of training: the kill lands before it ends
    project = make_project(tmp_path, {"download": {"mirror": "mirror"}, "studies": {"slow": slow}})
    for stage, runtime in (("plan", {}), ("download", {}), ("prepare", {"study": "slow"}),
                           ("tokenize", {"study": "slow"})):
        run(project, stage, **runtime)
    return project


def cell_runs(project: Path) -> list[tuple[str, str]]:
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{project / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("layertune-slow")
    return sorted(r.info.status for r in client.search_runs([experiment.experiment_id])) if experiment else []


def test_a_killed_cell_leaves_no_run_running_and_no_partial_folder_after_its_rerun(slow_project):
    command = [sys.executable, "-m", "kedro", "run", "--pipelines", "train", "--params", "study=slow,cell=sst2-tiny-1-1"]
    env = {**os.environ, **project_env(slow_project)}
    cell = subprocess.Popen(command, cwd=slow_project, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while cell_runs(slow_project) != ["RUNNING"] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert cell_runs(slow_project) == ["RUNNING"]
    # A write killed half-way leaves a staging folder, as a killed cache build would.
    writer = subprocess.Popen([sys.executable, "-c", "import sys, time\nfrom layertune.io import atomic_directory\n"
                               "with atomic_directory(sys.argv[1]) as staging:\n"
                               "    (staging / 'half').write_text('x'); print('in', flush=True); time.sleep(60)",
                               str(slow_project / "data" / "04_models" / "slow" / "interrupted")],
                              env=env, stdout=subprocess.PIPE, text=True)
    assert writer.stdout.readline().strip() == "in"
    for process in (cell, writer):
        process.send_signal(signal.SIGKILL)
        process.wait()
    models = slow_project / "data" / "04_models" / "slow"
    assert [p.name for p in models.iterdir() if ".partial-" in p.name]  # left behind by the kill
    assert cell_runs(slow_project) == ["RUNNING"]  # nobody could end it

    done = subprocess.run(command, cwd=slow_project, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert cell_runs(slow_project) == ["FINISHED", "KILLED"]  # the abandoned run is ended, one run finished
    assert not [p for p in (slow_project / "data").rglob("*") if ".partial-" in p.name]
    assert json.loads((models / "sst2-tiny-1-1" / "metrics.json").read_text())["best_epoch"] >= 1


def test_a_sigterm_after_finished_does_not_fail_the_process():
    """Once its run is FINISHED (outputs saved), a cell finishes even if SIGTERM arrives before it exits; the next
    run counts SIGTERM again."""
    from types import SimpleNamespace

    from pipelines.hooks import MlflowCellHook

    hook = MlflowCellHook()
    hook.run = SimpleNamespace(end=lambda status: None, run_id="x")
    before = signal.getsignal(signal.SIGTERM)
    hook.after_pipeline_run()
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN
    hook.after_catalog_created(catalog=None)
    assert signal.getsignal(signal.SIGTERM) == before


def test_json_outputs_never_hold_nan(tmp_path):
    with pytest.raises(ValueError, match="not JSON compliant"):
        write_json(tmp_path / "metrics.json", {"eval_loss": float("nan")})
