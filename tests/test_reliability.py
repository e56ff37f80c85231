"""Interrupted, killed and concurrent runs leave nothing stale: MLflow runs, staging folders, partial outputs."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import yaml

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
    from pipelines.tracking import connect

    client = connect(f"sqlite:///{project / 'mlflow.db'}")  # waits while a cell creates the database
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


def _project_processes(project: Path, server: set[int]) -> list[str]:
    """Processes working in ``project`` (a stage's `kedro run`, a warm client or a fork of the warm server), but the
    warm server itself: after a build ends, none may be left."""
    import psutil

    found = []
    for process in psutil.process_iter(["pid", "cwd", "cmdline", "status"]):
        info = process.info
        if info["pid"] in server or info["status"] == psutil.STATUS_ZOMBIE or info["cwd"] != str(project.resolve()):
            continue
        found.append(f"{info['pid']}: {' '.join(info['cmdline'] or [])}")
    return found


def _warm_servers(project: Path) -> set[int]:
    """The warm servers of ``project`` (`pipelines.warm`), which outlive a build by design."""
    import psutil

    return {p.pid for p in psutil.process_iter(["cmdline", "cwd"])
            if "--serve" in (p.info["cmdline"] or []) and p.info["cwd"] == str(project.resolve())}


def _kill_dvc_repro_when(project: Path, env: dict, started) -> subprocess.Popen:
    """`dvc repro` killed with SIGKILL (only it, as `kill -9 <pid>` does) once ``started(process)`` holds for one of
    its descendants; its stderr, which its stage's command writes too, stays readable."""
    import psutil

    dvc = subprocess.Popen(["dvc", "repro"], cwd=project, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                           text=True)
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline and dvc.poll() is None:
        with contextlib.suppress(psutil.Error):
            if any(started(child) for child in psutil.Process(dvc.pid).children(recursive=True)):
                break
        time.sleep(0.05)
    assert dvc.poll() is None, f"dvc repro ended before the kill: {dvc.stderr.read()[-2000:]}"
    dvc.send_signal(signal.SIGKILL)
    dvc.wait()
    return dvc


def _left_alone(project: Path, server: set[int], timeout_s: float = 30.0) -> list[str]:
    deadline = time.monotonic() + timeout_s
    while (left := _project_processes(project, server)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


@pytest.mark.slow
def test_kill_9_of_dvc_repro_stops_its_stage_and_a_rerun_at_once_gives_one_finished_run_per_cell(tmp_path):
    """`kill -9` of `dvc repro` during tokenize, then (rerun at once) during the cell's training: each time its stage
    command ends with it (the cell's run KILLED), and the last rerun builds everything: one FINISHED run for the
    cell, none RUNNING, no process of the project left."""
    import psutil

    from tests.projects import make_dvc_project

    slow = study("layers", ["sst2"], {"tiny": "models/tiny-a"}, [1], [1])
    # Hours of training, so the kill lands while the cell trains however loaded the machine is (with 300 epochs, CI
    # once saw the run FINISHED first); the rerun trains 40.
    slow["training"]["epochs"] = 20_000
    params = {"download": {"mirror": "mirror"}, "studies": {"slow": slow}}
    project = make_dvc_project(tmp_path / "project", params)
    # DVC runs a stage's command with $SHELL -c: /bin/sh (dash, which forks the command rather than becoming it)
    # is the shell that leaves a stage running after `kill -9` unless the command is exec'd (CI has no $SHELL).
    env = {**os.environ, **project_env(project), "LAYERTUNE_WARM_IDLE": "60", "SHELL": "/bin/sh"}

    def command_of(stage):
        return lambda process: f"--pipelines {stage}" in " ".join(process.cmdline())

    try:
        _kill_dvc_repro_when(project, env, command_of("tokenize"))
        assert _left_alone(project, _warm_servers(project)) == []
        killed = _kill_dvc_repro_when(
            project, env, lambda process: command_of("train")(process) and cell_runs(project) == ["RUNNING"])
        assert _left_alone(project, _warm_servers(project)) == []
        # ended by the SIGTERM its parent's death sent, not left RUNNING (the stage's log, whole once it has exited)
        assert cell_runs(project) == ["KILLED"], killed.stderr.read()[-4000:]
        slow["training"]["epochs"] = 40
        (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
        done = subprocess.run(["dvc", "repro"], cwd=project, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        assert cell_runs(project) == ["FINISHED", "KILLED"]
        assert (project / "reports" / "slow.md").is_file()
    finally:
        for pid in _warm_servers(project):
            with contextlib.suppress(psutil.Error):
                psutil.Process(pid).kill()


def test_a_tied_command_ends_with_the_process_that_started_it_even_by_sigkill(tmp_path):
    """`layertune repro` starts each `dvc` tied to itself: killed with SIGKILL, it takes them with it."""
    import psutil

    from pipelines.processes import tied

    starter = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import subprocess, sys
        from pipelines.processes import tied
        child = subprocess.Popen(tied([sys.executable, "-c", "import time; time.sleep(120)"]))
        print(child.pid, flush=True)
        child.wait()
    """)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    child = psutil.Process(int(starter.stdout.readline()))
    time.sleep(0.5)  # the wrapper has executed the command
    assert "time.sleep(120)" in " ".join(child.cmdline())
    starter.send_signal(signal.SIGKILL)
    starter.wait()
    child.wait(timeout=10)  # raises if it still runs then
    assert tied(["dvc", "repro"])[-3:] == ["--", "dvc", "repro"]


def test_a_second_run_of_a_stage_waits_for_the_first_and_names_its_process(tmp_path, caplog):
    from pipelines.processes import StageBusy, acquire_stage_lock, stage_lock_path

    path = stage_lock_path(tmp_path, ["train"], {"study": "s", "cell": "c"})
    assert path != stage_lock_path(tmp_path, ["train"], {"study": "s", "cell": "d"})
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import time
        from pathlib import Path
        from pipelines.processes import acquire_stage_lock
        held = acquire_stage_lock(Path({str(path)!r}), "first")
        print("held", flush=True)
        time.sleep(float(input()))
    """)], cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(StageBusy, match=rf"train c runs already, in process {holder.pid} .*kill {holder.pid}"):
            acquire_stage_lock(path, "train c", wait_s=0.5)
        assert f"runs already in process {holder.pid}: waiting" in caplog.text
        holder.stdin.write("1\n")  # it holds the lock a second more, then exits: the kernel releases it
        holder.stdin.flush()
        acquire_stage_lock(path, "train c", wait_s=30).release()
    finally:
        holder.kill()
        holder.wait()
