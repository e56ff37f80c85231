"""`layertune repro`: its checks before any work, one build of a project at a time, and a failed build said in one
line (the builds themselves: test_scale.py, test_ray_cluster.py)."""

import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import yaml

from pipelines.repro import main as repro
from tests.projects import make_dvc_project, project_env, study

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    return make_dvc_project(tmp_path_factory.mktemp("project"), {"download": {"mirror": "mirror"}, "studies": {
        "ablation": study("layers", ["sst2"], {"tiny": "models/tiny-a"}, [0], [1])}})


def test_layertune_repro_is_the_pipelines_command_under_the_library_cli():
    shown = subprocess.run(["layertune", "repro", "--help"], capture_output=True, text=True, check=True).stdout
    assert "--ray [ADDRESS]" in shown and "--jobs" in shown


@pytest.mark.parametrize("arguments, message", [
    (["--cpus-per-cell", "2"], "--cpus-per-cell is an option of --ray"),
    (["--jobs", "0"], "--jobs must be at least 1; got 0"),
    (["--ray", "--cpus-per-cell", "0"], "--cpus-per-cell must be at least 1; got 0"),
    (["nope"], "no study 'nope' in params.yaml; its studies: ablation"),
    (["--ray", "127.0.0.1:1"], "--ray 127.0.0.1:1: no Ray cluster reachable at 127.0.0.1:1 (connection refused)"),
    (["--ray", "head"], "--ray head: a Ray address is HOST:PORT"),
])
def test_bad_options_are_refused_before_any_work(project, monkeypatch, capsys, arguments, message):
    monkeypatch.chdir(project)
    started = time.monotonic()
    assert repro(arguments) == 2
    assert time.monotonic() - started < 15  # Ray's own connect would retry for minutes
    [line] = capsys.readouterr().err.splitlines()
    assert message in line
    assert not (project / "data").exists()


LAUGHS = "".join(f"{name}: &{name} [{', '.join([f'*{previous}'] * 9)}]\n"
                 for previous, name in zip("abcdefgh", "bcdefghi"))  # nine nested aliases: 9^8 values


@pytest.mark.parametrize("params, environment, message", [
    (None, {"LAYERTUNE_JOBS": "abc"}, "$LAYERTUNE_JOBS='abc': a whole number of at least 1 is expected"),
    ({"../evil": "ablation"}, {}, "studies.../evil: '../evil' is not a valid name"),
    ({"a" * 300: "ablation"}, {}, "'aaaaaaaaaaaaaaaaaaaa'… is not a valid name: 300 characters, at most 48"),
    ("a: &a [1, 2, 3, 4, 5, 6, 7, 8, 9]\n" + LAUGHS, {},
     "params.yaml: its aliases (*name) expand it to more than 100,000 values"),
    (("# " + "x" * 98 + "\n") * 11_000, {}, "params.yaml: 1,111,000 bytes (1.1 MiB), more than the 1,048,576 bytes "
     "(1.0 MiB) a parameter file may hold: DVC, Kedro and every stage read it at each build"),
], ids=["bad-jobs", "path-as-name", "long-name", "alias-bomb", "over-1-MiB"])  # short: pytest puts the id in
# $PYTEST_CURRENT_TEST, and a 1.1 MiB one made every process the fixtures start fail ("Argument list too long")
def test_bad_params_or_environment_are_one_line_before_dvc_starts(project, tmp_path, monkeypatch, capsys, params,
                                                                   environment, message):
    """What DVC would trip on (a path for a study name: its own output-overlap error; a name longer than a file name;
    nested YAML aliases: a hang) or ignore, named by `layertune repro` in one line, exit status 2, within seconds."""
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(project, copy)
    if isinstance(params, str):
        (copy / "params.yaml").write_text(params)
    elif params:
        written = yaml.safe_load((copy / "params.yaml").read_text())
        for name, like in params.items():
            written["studies"][name] = written["studies"][like]
        (copy / "params.yaml").write_text(yaml.safe_dump(written))
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    monkeypatch.chdir(copy)
    started = time.monotonic()
    assert repro([]) == 2
    assert time.monotonic() - started < 15
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith("layertune repro: ") and message in line
    assert not (copy / "data").exists()


def test_a_missing_record_of_rounds_is_one_line_with_the_fix_before_dvc_and_in_the_stages(project, tmp_path,
                                                                                          monkeypatch, capsys):
    """It was DVC's "dependency 'rounds.yaml' does not exist", naming no fix; a stage run by hand read the decided
    studies without their rounds."""
    import shutil

    from pipelines.param_checks import InvalidParams
    from tests.projects import run

    copy = tmp_path / "copy"
    shutil.copytree(project, copy)
    (copy / "rounds.yaml").unlink()
    monkeypatch.chdir(copy)
    assert repro([]) == 2
    [line] = capsys.readouterr().err.splitlines()
    fix = ("rounds.yaml is missing: it is the record of the decided studies' rounds (layertune repro --decide writes "
           "it, dvc.yaml's plan stage reads it). Restore it (git checkout rounds.yaml), or write an empty record, "
           "'decided: {}', to decide every study again from its grid")
    assert line == f"layertune repro: {fix}"
    with pytest.raises(InvalidParams, match=re.escape(fix)):
        run(copy, "plan")
    assert not (copy / "data").exists()


def test_a_parameter_file_of_megabytes_is_refused_by_the_stages_too(project, tmp_path):
    """A 50 MB params.yaml of comments made a build that trains nothing take 219 s instead of 5, with no word: DVC,
    Kedro and each stage's check read it at every build. Refused, as by `layertune repro` before DVC (above)."""
    import shutil

    from pipelines.param_checks import InvalidParams
    from tests.projects import run

    copy = tmp_path / "copy"
    shutil.copytree(project, copy)
    with open(copy / "params.yaml", "a") as params:
        params.write(("# " + "x" * 98 + "\n") * 11_000)
    started = time.monotonic()
    with pytest.raises(InvalidParams, match="params.yaml: [0-9,]+ bytes .* more than the 1,048,576 bytes"):
        run(copy, "plan")
    assert time.monotonic() - started < 30 and not (copy / "data").exists()


def test_a_second_build_of_the_project_is_one_line_naming_the_first(project):
    """It was DVC's lock error, then `Command '[… pipelines.processes tied …]' returned non-zero exit status 255`."""
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import time
        from pathlib import Path
        from pipelines.processes import one_build
        with one_build(Path({str(project)!r})):
            print("held", flush=True)
            time.sleep(60)
    """)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        done = subprocess.run(["layertune", "repro"], cwd=project, capture_output=True, text=True,
                              env={**os.environ, **project_env(project)})
    finally:
        holder.kill()
        holder.wait()
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr == (f"layertune repro: another build of this project is running (PID {holder.pid}); wait for "
                           f"it to end, or stop it: kill {holder.pid}\n")


def test_a_failed_build_is_one_line_after_dvcs_own_output(project, tmp_path):
    """The plan refuses a bad parameter (its `Error:` line is in DVC's output); `layertune repro` adds one line."""
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(project, broken)
    params = yaml.safe_load((broken / "params.yaml").read_text())
    params["studies"]["ablation"]["seeds"] = [-1]
    (broken / "params.yaml").write_text(yaml.safe_dump(params))
    done = subprocess.run(["layertune", "repro"], cwd=broken, capture_output=True, text=True,
                          env={**os.environ, **project_env(broken)})
    assert done.returncode == 1
    assert "studies.ablation.seeds[0]: Input should be greater than or equal to 0" in done.stdout + done.stderr
    assert done.stderr.splitlines()[-1] == ("layertune repro: dvc repro plan download failed (exit status 255); its "
                                            "output above says why")
    # (DVC's own line names the stage's command; this line, the build's, names no wrapper of ours)
    assert "Traceback" not in done.stderr and "pipelines.processes" not in done.stderr.splitlines()[-1]


def test_the_slurm_example_is_valid_bash():
    subprocess.run(["bash", "-n", str(ROOT / "examples" / "slurm" / "layertune-ray.sbatch")], check=True)
