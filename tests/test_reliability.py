"""Interrupted, killed and concurrent builds leave nothing stale: no MLflow run RUNNING, no staging folder, no
half-written cell, no process training on; and the next build trains only the cells that did not finish."""

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import yaml

from layertune.io import write_json
from pipelines.scheduling import GRACE_S
from tests.projects import make_project, project_env, run, study

ROOT = Path(__file__).resolve().parents[1]
# A stopped build's processes are gone within this, on a loaded machine too: the scheduler gives a stopped worker
# GRACE_S to end its cell before SIGKILL, so its own stage process may rightly live that long, plus time to exit.
STOP_BOUND_S = GRACE_S + 15


def test_four_builds_starting_at_once_on_a_new_mlflow_database_all_finish(tmp_path):
    """MLflow's creation of a new database is not safe for several processes at once; builds wait for one
    another."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    go = tmp_path / "go"
    script = textwrap.dedent(f"""
        import sys, time
        from pathlib import Path
        from pipelines.tracking import CellRun, Store
        while not Path({str(go)!r}).exists():
            time.sleep(0.005)
        run = CellRun.start(Store("layertune-race", {uri!r}), f"cell-{{sys.argv[1]}}", {{"seed": sys.argv[1]}})
        run.end("FINISHED")
    """)
    builds = [subprocess.Popen([sys.executable, "-c", script, str(i)], cwd=ROOT, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'src'}"})
              for i in range(4)]
    time.sleep(3)  # every process has imported MLflow and waits
    go.touch()
    errors = [build.communicate(timeout=120)[1] for build in builds]
    assert [build.returncode for build in builds] == [0, 0, 0, 0], errors
    from mlflow import MlflowClient

    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name("layertune-race").experiment_id])
    assert sorted((r.info.run_name, r.info.status) for r in runs) == [(f"cell-{i}", "FINISHED") for i in range(4)]


def slow_study(epochs: int, seeds=(1, 2), layers=(1,), **extra) -> dict:
    slow = study("layers", ["sst2"], {"tiny": "models/tiny-a"}, list(layers), list(seeds), **extra)
    slow["training"]["epochs"] = epochs  # seconds of training a cell: a stop lands while one trains
    return {"download": {"mirror": "mirror"}, "studies": {"slow": slow}}


@pytest.fixture
def slow_project(tmp_path):
    """Two cells, prepared up to the train stage: the head alone, trained in a few seconds, then one layer, five
    times as many epochs (many epochs of a tiny model), so that a stop sent once it started lands while it trains,
    however loaded the machine."""
    project = make_project(tmp_path, slow_study(epochs=60, seeds=(1,), layers=(0, 1),
                                                per_tunable_layers={1: {"epochs": 300}}))
    for stage, runtime in (("plan", {}), ("download", {}), ("prepare", {"study": "slow"}),
                           ("tokenize", {"study": "slow"})):
        run(project, stage, **runtime)
    return project


def cell_runs(project: Path) -> dict[str, list[str]]:
    """{run name: its runs' statuses} of the study; every build's parent run as "build"."""
    from pipelines.tracking import connect

    client = connect(f"sqlite:///{project / 'mlflow.db'}")  # waits while a build creates the database
    experiment = client.get_experiment_by_name("layertune-slow")
    found: dict[str, list[str]] = {}
    for found_run in client.search_runs([experiment.experiment_id]) if experiment else []:
        found.setdefault(found_run.info.run_name.split()[0], []).append(found_run.info.status)
    return {name: sorted(statuses) for name, statuses in found.items()}


def wait_for(condition, timeout_s: float = 120, what: str = "") -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"waited {timeout_s} s for {what}"
        time.sleep(0.2)


TRAIN = [sys.executable, "-m", "kedro", "run", "--pipelines", "train", "--params", "study=slow"]


@pytest.mark.slow
def test_ctrl_c_after_a_cell_finished_keeps_it_and_the_next_build_trains_only_the_rest(slow_project):
    """Ctrl-C (SIGINT to the process group, as a terminal sends it) a moment after the first cell saved its folder
    and its run ended FINISHED: that cell is kept, the second's run ends KILLED and it leaves no folder; a write
    killed half-way leaves a staging folder, which the next build removes; the next build trains the second cell
    alone (it was: retrained both, DVC not having recorded the stage)."""
    env = {**os.environ, **project_env(slow_project)}
    # SIGINT handled here while the build starts, so that it starts with SIGINT's default, as a terminal's foreground
    # job does: a test run started in the background (`cmd &` in a script) ignores SIGINT, and a process inherits an
    # ignored signal (the build then rightly trained on: exit 0).
    ignored = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        build = subprocess.Popen(TRAIN, cwd=slow_project, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                 text=True, process_group=0)
    finally:
        signal.signal(signal.SIGINT, ignored)
    wait_for(lambda: cell_runs(slow_project).get("sst2-tiny-1-1") == ["RUNNING"], what="the second cell's run")
    assert cell_runs(slow_project)["sst2-tiny-0-1"] == ["FINISHED"]
    os.killpg(build.pid, signal.SIGINT)
    started = time.monotonic()
    build.wait(timeout=STOP_BOUND_S)
    assert time.monotonic() - started < STOP_BOUND_S and build.returncode != 0
    assert cell_runs(slow_project) == {"build": ["KILLED"], "sst2-tiny-0-1": ["FINISHED"],
                                       "sst2-tiny-1-1": ["KILLED"]}
    models = slow_project / "data" / "04_models" / "slow"
    assert sorted(p.name for p in models.iterdir()) == ["sst2-tiny-0-1"]  # no half-written folder
    writer = subprocess.Popen([sys.executable, "-c", "import sys, time\nfrom layertune.io import atomic_directory\n"
                               "with atomic_directory(sys.argv[1]) as staging:\n"
                               "    (staging / 'half').write_text('x'); print('in', flush=True); time.sleep(60)",
                               str(models / "sst2-tiny-1-1")], env=env, stdout=subprocess.PIPE, text=True)
    assert writer.stdout.readline().strip() == "in"
    writer.kill()
    writer.wait()
    assert [p.name for p in models.iterdir() if ".partial-" in p.name]  # left behind by the kill

    done = subprocess.run(TRAIN, cwd=slow_project, env=env, capture_output=True, text=True, timeout=600)
    log = done.stdout + done.stderr
    assert done.returncode == 0, log[-3000:]
    assert "slow: 1 of 2 cell(s) to train" in log and "sst2-tiny-0-1 trained" not in log
    assert cell_runs(slow_project) == {"build": ["FINISHED", "KILLED"], "sst2-tiny-0-1": ["FINISHED"],
                                       "sst2-tiny-1-1": ["FINISHED", "KILLED"]}
    assert sorted(p.name for p in models.iterdir()) == ["sst2-tiny-0-1", "sst2-tiny-1-1"]


def test_json_outputs_never_hold_nan(tmp_path):
    with pytest.raises(ValueError, match="not JSON compliant"):
        write_json(tmp_path / "metrics.json", {"eval_loss": float("nan")})


def test_an_unwritable_cache_folder_is_one_line_before_any_work(slow_project, tmp_path):
    """A feature cache the stage cannot write: one `Error:` line naming the folder and where to point the cache
    instead, exit 2, before anything is tokenized (it was ~65 lines of Kedro's failure and traceback). Made
    read-only with chattr, which binds root too (a file mode does not)."""
    cache = slow_project / "data" / "cache"
    if shutil.which("chattr") is None or subprocess.run(["chattr", "+i", str(cache)]).returncode:
        pytest.skip("chattr +i is not available on this filesystem")
    try:
        done = subprocess.run([sys.executable, "-m", "kedro", "run", "--pipelines", "tokenize", "--params",
                               "study=slow"], cwd=slow_project, env={**os.environ, **project_env(slow_project)},
                              capture_output=True, text=True, timeout=300)
    finally:
        subprocess.run(["chattr", "-i", str(cache)], check=True)
    output = done.stdout + done.stderr
    assert done.returncode == 2 and "Traceback" not in output, output[-3000:]
    [error] = [line for line in output.splitlines() if "Error" in line]
    assert error.startswith(f"Error: Cannot write the layertune cache folder {cache} (")
    assert error.endswith("Point the catalog's feature_cache (conf/base/catalog.yml) at a folder you can write.")


def _holding(project: Path, *studies: str) -> subprocess.Popen:
    """A process that holds the locks of ``studies`` (as a stage of a build does) until killed."""
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import time
        from pathlib import Path
        from pipelines.processes import one_study_build
        with one_study_build(Path({str(project)!r}), {list(studies)!r}):
            print("held", flush=True)
            time.sleep(120)
    """)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    return holder


@pytest.mark.parametrize("stage, runtime", [("train", {"study": "slow"}), ("evaluate", {"study": "slow"}),
                                            ("plan", {})])
def test_a_stage_run_by_hand_beside_a_build_of_its_study_is_refused_naming_the_holder(slow_project, stage, runtime):
    """`kedro run` by hand while a build trains the study trained the same cells beside it and replaced the build's
    folders (issue 57): each stage that writes a study's folders holds the study's lock (the plan, every study's),
    and refuses at once in one line naming the process that holds it. Once it ends, the stage runs."""
    from pipelines.param_checks import StageStopped
    from pipelines.processes import one_study_build

    models = slow_project / "data" / "04_models" / "slow"
    holder = _holding(slow_project, "slow")
    try:
        with pytest.raises(StageStopped) as refused:
            run(slow_project, stage, **runtime)
    finally:
        holder.kill()
        holder.wait()
    said = refused.value.message
    assert refused.value.exit_code == 1 and "\n" not in said, said
    assert said.startswith(f"study slow is being built by another process (PID {holder.pid}: "
                           f"{Path(sys.executable).name} -c import time from pathlib import Path"), said
    assert said.endswith(f"; wait for it to end, or stop it: kill {holder.pid}"), said
    assert not models.exists()  # refused before any work
    if stage == "plan":
        run(slow_project, stage, **runtime)  # the holder gone, it runs; and it let the lock go as it ended
        with one_study_build(slow_project, ["slow"]):
            pass


@pytest.mark.slow
def test_kedro_run_by_hand_beside_layertune_repro_is_refused_and_the_report_is_a_clean_builds(tmp_path):
    """Issue 57: while `layertune repro slow` trained, `kedro run --pipelines train --params study=slow` by hand
    opened its own build run, trained the same cells beside it, replaced the build's folders, and a later `sync`
    ended the build's runs KILLED. Now it is refused in one line naming the build's train stage; the build goes on,
    its report is a clean build's, and every cell has one FINISHED run."""
    from tests.projects import make_dvc_project

    params = slow_study(epochs=400)  # two cells of seconds each: the hand run starts while the first trains
    project = make_dvc_project(tmp_path / "project", params)
    env = {**os.environ, **project_env(project)}
    build = subprocess.Popen(["layertune", "repro", "slow"], cwd=project, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    try:
        wait_for(lambda: "RUNNING" in cell_runs(project).get("sst2-tiny-1-1", []), what="the first cell's run")
        by_hand = subprocess.run(TRAIN, cwd=project, env=env, capture_output=True, text=True, timeout=300)
        assert build.poll() is None, "the build ended before the hand run was refused: give its cells more epochs"
    finally:
        log = build.communicate(timeout=600)[0]
    assert build.returncode == 0, log[-3000:]
    output = by_hand.stdout + by_hand.stderr
    assert by_hand.returncode == 1 and "Traceback" not in output and " trained" not in output, output[-3000:]
    [line] = [line for line in output.splitlines() if "Error" in line]
    assert re.fullmatch(r"Error: study slow is being built by another process \(PID (\d+): python -m kedro run "
                        r"--pipelines train --params study=slow\); wait for it to end, or stop it: kill \1", line), line
    assert cell_runs(project) == {"build": ["FINISHED"], "sst2-tiny-1-1": ["FINISHED"], "sst2-tiny-1-2": ["FINISHED"]}

    clean = make_dvc_project(tmp_path / "clean", params)
    done = subprocess.run(["dvc", "repro"], cwd=clean, env={**os.environ, **project_env(clean)},
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    for report in ("slow.json", "slow/details.json", "slow.scores.csv", "slow.losses.csv"):
        assert (project / "reports" / report).read_bytes() == (clean / "reports" / report).read_bytes(), report


def _project_processes(project: Path) -> list[str]:
    """Processes working in ``project`` (a stage's `kedro run`, its worker processes): after a build is stopped,
    none may be left."""
    import psutil

    found = []
    for process in psutil.process_iter(["pid", "cwd", "cmdline", "status"]):
        info = process.info
        if info["status"] != psutil.STATUS_ZOMBIE and info["cwd"] == str(project.resolve()):
            found.append(f"{info['pid']}: {' '.join(info['cmdline'] or [])}")
    return found


def _kill_dvc_repro_when(project: Path, env: dict, started) -> subprocess.Popen:
    """`dvc repro` killed with SIGKILL (only it, as `kill -9 <pid>` does) once ``started(process)`` holds for one of
    its descendants; its stderr, which its stage's command writes too, stays readable."""
    import psutil

    dvc = subprocess.Popen(["dvc", "repro"], cwd=project, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                           text=True)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and dvc.poll() is None:
        with contextlib.suppress(psutil.Error):
            if any(started(child) for child in psutil.Process(dvc.pid).children(recursive=True)):
                break
        time.sleep(0.05)
    assert dvc.poll() is None, f"dvc repro ended before the kill: {dvc.stderr.read()[-2000:]}"
    dvc.send_signal(signal.SIGKILL)
    dvc.wait()
    return dvc


def _left_alone(project: Path, timeout_s: float = STOP_BOUND_S) -> list[str]:
    deadline = time.monotonic() + timeout_s
    while (left := _project_processes(project)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


@pytest.mark.slow
@pytest.mark.parametrize("jobs", [1, 2])
def test_kill_9_of_dvc_repro_stops_its_stage_and_the_next_build_finishes_every_cell(tmp_path, jobs):
    """`kill -9` of `dvc repro` during tokenize, then during the cells' training (in the stage's process, or in
    its two worker processes): each time everything it ran ends with it within seconds (the runs KILLED), and the
    next build trains what is left: one FINISHED run per cell, none RUNNING, no process of the project left."""
    from tests.projects import make_dvc_project

    # Hours of training, so the kill lands while the cells train however loaded the machine is; the rerun trains 40.
    params = slow_study(epochs=20_000)
    project = make_dvc_project(tmp_path / "project", params)
    # DVC runs a stage's command with $SHELL -c: /bin/sh (dash, which forks the command rather than becoming it)
    # is the shell that leaves a stage running after `kill -9` unless the command is exec'd (CI has no $SHELL).
    env = {**os.environ, **project_env(project), "SHELL": "/bin/sh", "LAYERTUNE_JOBS": str(jobs)}

    def command_of(stage):
        return lambda process: f"--pipelines {stage}" in " ".join(process.cmdline())

    _kill_dvc_repro_when(project, env, command_of("tokenize"))
    assert _left_alone(project) == []
    training = {"sst2-tiny-1-1": ["RUNNING"], "sst2-tiny-1-2": ["RUNNING"]} if jobs == 2 else \
        {"sst2-tiny-1-1": ["RUNNING"]}
    killed = _kill_dvc_repro_when(project, env, lambda process: command_of("train")(process) and all(
        cell_runs(project).get(name) == status for name, status in training.items()))
    assert _left_alone(project) == []
    # ended by the SIGTERM its parent's death sent, not left RUNNING (the stage's log, whole once it has exited)
    assert set(cell_runs(project)) == {"build", *training} and \
        {status for statuses in cell_runs(project).values() for status in statuses} == {"KILLED"}, \
        killed.stderr.read()[-4000:]
    params["studies"]["slow"]["training"]["epochs"] = 40
    (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    done = subprocess.run(["dvc", "repro"], cwd=project, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    runs = cell_runs(project)
    assert [status for statuses in runs.values() for status in statuses].count("RUNNING") == 0
    assert runs["sst2-tiny-1-1"][0] == runs["sst2-tiny-1-2"][0] == "FINISHED"  # one each, sorted first
    assert runs["sst2-tiny-1-1"].count("FINISHED") == runs["sst2-tiny-1-2"].count("FINISHED") == 1
    assert (project / "reports" / "slow.md").is_file()
    assert json.loads((project / "data/04_models/slow/sst2-tiny-1-2/metrics.json").read_text())["best_epoch"] >= 1


def test_a_tied_command_ends_with_the_process_that_started_it_even_by_sigkill(tmp_path):
    """`layertune repro` starts its `dvc` tied to itself: killed with SIGKILL, it takes it with it."""
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


def test_a_tied_command_whose_parent_died_before_it_started_never_runs(tmp_path):
    """dvc.yaml's stage command starts with `tied $PPID`: a `dvc repro` killed between starting the stage's shell
    and the stage's first instruction (on a loaded machine, seconds) is noticed there, and the stage never runs."""
    gone = subprocess.Popen(["true"])
    gone.wait()  # its id names no process now: the parent that died
    marker = tmp_path / "ran"
    done = subprocess.run([sys.executable, "-m", "pipelines.processes", "tied", str(gone.pid), "--", sys.executable,
                           "-c", f"open({str(marker)!r}, 'w')"], cwd=ROOT, timeout=60, check=False)
    assert done.returncode == -signal.SIGTERM and not marker.exists()
