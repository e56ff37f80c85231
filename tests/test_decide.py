"""`layertune repro --decide` on a tiny project: the rounds it runs are recorded in the record of rounds (rounds.yaml;
params.yaml is left as written), only the settings the rule chooses train in them, the report lists them, and a
rebuild replays them (nothing trains, the same report byte for byte)."""

import argparse
import os
import re
import subprocess
from pathlib import Path

import pandas as pd
import pytest
import yaml

from tests.projects import make_dvc_project, project_env, study


@pytest.mark.slow
def test_decide_runs_rounds_until_its_looks_are_spent_and_a_rebuild_replays_them(tmp_path):
    decided = study("layers", ["sst2"], {"tiny": "models/tiny-a"}, [0, 1], [1, 2],
                    decide={"looks": 3, "seeds_per_round": 2})  # two rounds left: each comparison could settle
    project = make_dvc_project(tmp_path / "project", {"download": {"mirror": "mirror"}, "studies": {"s": decided}})
    env = {**os.environ, **project_env(project)}

    built = subprocess.run(["layertune", "repro", "--decide"], cwd=project, env=env, capture_output=True, text=True,
                           timeout=600)
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    assert "next round, " in built.stdout and "decided or has spent its rounds" in built.stdout

    details = (project / "reports" / "s" / "details.json").read_bytes()
    record = yaml.safe_load((project / "rounds.yaml").read_text())["decided"]["s"]["rounds"]
    rounds = yaml.safe_load(details)["sst2"]["tiny"]["decided"]["rounds"]
    # round 1: the grid; then two seeds a round to what the rule chose, until the looks are spent
    assert [r["seeds"] for r in rounds] == [[1, 2], [3, 4], [5, 6]]
    assert all(r["follows_rule"] for r in rounds[1:]) and rounds[1]["settings"] == ["0", "1"]
    assert sorted(record) == sorted(f"sst2-tiny-{k}-{seed}" for r in rounds[1:] for k in r["settings"]
                                    for seed in r["seeds"])
    assert {cell["round"] for cell in record.values()} == {2, 3}
    trained = sorted(p.name for p in (project / "data" / "04_models" / "s").iterdir())
    assert trained == sorted([f"sst2-tiny-{k}-{seed}" for k in (0, 1) for seed in (1, 2)] + list(record))
    assert "### Rounds" in (project / "reports" / "s.md").read_text()

    # The record is what a rebuild reads: nothing left to train, and the same report.
    status = subprocess.run(["dvc", "status", "--json"], cwd=project, env=env, capture_output=True, text=True)
    assert yaml.safe_load(status.stdout) == {"plan": ["always changed"]}, status.stdout
    again = subprocess.run(["dvc", "repro", "--force", "aggregate@s", "--single-item"], cwd=project, env=env,
                           capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert (project / "reports" / "s" / "details.json").read_bytes() == details


def test_decide_without_a_decide_section_is_refused_before_any_work(tmp_path):
    project = make_dvc_project(tmp_path / "project", {"download": {"mirror": "mirror"}, "studies": {
        "s": study("layers", ["sst2"], {"tiny": "models/tiny-a"}, [0], [1])}})
    env = {**os.environ, **project_env(project)}
    for arguments, message in ((["--decide"], "no study of params.yaml has a decide section"),
                               (["--decide", "s"], "studies.s has no decide section; add one"),
                               (["--budget", "5"], "--budget is an option of --decide")):
        refused = subprocess.run(["layertune", "repro", *arguments], cwd=project, env=env, capture_output=True,
                                 text=True, timeout=60)
        assert refused.returncode == 2 and message in refused.stderr, refused.stderr
    assert not (project / "data" / "00_plan").exists()


def test_a_round_of_evaluation_examples_is_recorded_beside_the_rounds_of_cells(tmp_path, monkeypatch):
    """The report's next round for one question is the evaluation examples, for another new seeds: the record of
    rounds holds both; params.yaml is left byte for byte as written."""
    import json

    from pipelines import decide
    from pipelines.params import read_params

    decided = study("layers", ["sst2"], {"tiny": "models/tiny-a", "other": "models/tiny-b"}, [0, 1], [1, 2],
                    decide={"looks": 3, "evaluation_size": 50})
    project = make_dvc_project(tmp_path / "project", {"download": {"mirror": "mirror"}, "studies": {"s": decided}})
    written = (project / "params.yaml").read_bytes()
    (project / "reports" / "s").mkdir(parents=True)
    (project / "reports" / "s" / "details.json").write_text(json.dumps({"sst2": {
        "tiny": {"decided": {"rounds": [{}], "next_round": {"seeds": [], "settings": ["0", "1"], "examples": 50}}},
        "other": {"decided": {"rounds": [{}], "next_round": {"seeds": [3], "settings": ["1"]}}}}}))
    monkeypatch.chdir(project)
    found = decide.next_round("s", read_params())
    assert found == ({"sst2-other-1-3": {"task": "sst2", "encoder": "other", "tunable_layers": 1, "seed": 3,
                                         "round": 2}}, {"sst2": {"tiny": 2}})
    decide.record({"s": found})
    assert (project / "params.yaml").read_bytes() == written
    recorded = yaml.safe_load((project / "rounds.yaml").read_text())["decided"]["s"]
    assert recorded["evaluation_rounds"] == {"sst2": {"tiny": 2}} and list(recorded["rounds"]) == ["sst2-other-1-3"]


PARAMS_AS_WRITTEN = """\
download: {mirror: mirror}   # the user's layout, kept

studies:
  plain:                     # no decide section
    report: {kind: layers}
    tasks: [sst2]
    encoders: {tiny: models/tiny-a}
    tunable_layers: [0, 1]
    seeds: [1, 2]
    training: {epochs: 1,
      learning_rate: 1.0e-3}
  s:
    report: {kind: layers, tolerance: 0.02}
    tasks: [sst2]
    encoders: {tiny: models/tiny-a}
    tunable_layers: [0, 1]
    seeds: [1, 2]
    decide: {looks: 3}       # decided in rounds
    training: {epochs: 1,
      learning_rate: 1.0e-3}
"""


def test_recording_rounds_writes_the_record_whole_and_never_params_yaml(tmp_path, monkeypatch):
    """The record of rounds (rounds.yaml) is written whole, its header kept; params.yaml stays byte for byte as its
    author wrote it (a splice of it once re-wrapped another study's flow mapping). The first round records what the
    rounds are decided with, today's rule among them, and a later round keeps it; a cleared entry starts anew."""
    from layertune.rounds import RULE
    from pipelines import decide

    (tmp_path / "params.yaml").write_text(PARAMS_AS_WRITTEN)
    (tmp_path / "rounds.yaml").write_text("# the record's header\ndecided: {}\n")
    monkeypatch.chdir(tmp_path)
    decide.record({"s": ({"sst2-tiny-1-3": {"task": "sst2", "encoder": "tiny", "tunable_layers": 1, "seed": 3,
                                            "round": 2}}, {})})
    assert (tmp_path / "params.yaml").read_text() == PARAMS_AS_WRITTEN
    written = (tmp_path / "rounds.yaml").read_text()
    assert written.startswith("# the record's header\ndecided:\n")
    assert yaml.safe_load(written) == {"decided": {"s": {
        "decided_with": {"tolerance": 0.02, "confidence": 0.95, "looks": 3, "spending": "obrien-fleming",
                         "seeds_per_round": 2, "evaluation_size": None, "rule": RULE},
        "rounds": {"sst2-tiny-1-3": {"task": "sst2", "encoder": "tiny", "tunable_layers": 1, "seed": 3, "round": 2}}}}}

    # A later round (after an edit the plan would refuse, say) adds its cells and keeps the values recorded first.
    (tmp_path / "params.yaml").write_text(PARAMS_AS_WRITTEN.replace("tolerance: 0.02}", "tolerance: 0.05}"))
    decide.record({"s": ({"sst2-tiny-1-4": {"task": "sst2", "encoder": "tiny", "tunable_layers": 1, "seed": 4,
                                            "round": 3}}, {})})
    recorded = yaml.safe_load((tmp_path / "rounds.yaml").read_text())["decided"]["s"]
    assert recorded["decided_with"]["tolerance"] == 0.02 and list(recorded["rounds"]) == ["sst2-tiny-1-3",
                                                                                         "sst2-tiny-1-4"]
    # Its entry removed to decide again under the new tolerance: the first round records the new one.
    (tmp_path / "rounds.yaml").write_text("decided: {}\n")
    decide.record({"s": ({}, {"sst2": {"tiny": 2}})})
    recorded = yaml.safe_load((tmp_path / "rounds.yaml").read_text())["decided"]["s"]
    assert recorded["decided_with"]["tolerance"] == 0.05 and recorded["evaluation_rounds"] == {"sst2": {"tiny": 2}}


@pytest.mark.parametrize("params, record, message", [
    ({"decide": {"looks": 3, "rounds": {"sst2-tiny-1-3": {}}}}, {}, "studies.s.decide.rounds: rounds are recorded in "
     "rounds.yaml (decided.s), which layertune repro --decide writes; remove rounds from params.yaml"),
    ({}, {"s": {"rounds": {}}}, "rounds.yaml is invalid:\n  decided.s: a record of rounds, but params.yaml has no "
     "study 's' with a decide section"),
    ({"decide": {"looks": 3}}, {"s": {"seeds": [3]}}, "rounds.yaml is invalid:\n  decided.s.seeds: not part of a "
     "record of rounds"),
])
def test_the_record_of_rounds_has_one_place(params, record, message):
    """Rounds in params.yaml beside the record file would be two records of one study; an entry for a study with
    no decide section, or with a key no record has, is named too."""
    from layertune.study import ParamsError
    from pipelines.params import validate_params

    decided = {**study("layers", ["sst2"], {"tiny": "org/tiny"}, [0, 1], [1, 2]), **params}
    with pytest.raises(ParamsError, match=re.escape(message)):
        validate_params({"download": {"mirror": None}, "studies": {"s": decided}, "decided": record})


RECORDED_WITH = {"tolerance": 0.01, "confidence": 0.95, "looks": 3, "spending": "obrien-fleming",
                 "seeds_per_round": 2, "evaluation_size": None}


@pytest.mark.parametrize("change, line", [
    (lambda cell, with_: cell.update(tunable_layers=3),
     "decided.s.rounds.sst2-tiny-3-3: tunable layer 3 is not on the study's grid"),
    (lambda cell, with_: cell.update(seed="3"), "decided.s.rounds.sst2-tiny-1-3.seed: Input should be a valid integer"),
    (lambda cell, with_: with_.update(rule="renamed"),
     "decided.s.decided_with.rule: the recorded rounds were chosen by rule 'renamed', and today's is"),
], ids=["a setting off the grid", "a seed typed as text", "a rule renamed"])
def test_an_error_in_the_record_of_rounds_names_rounds_yaml_and_its_key_there(tmp_path, change, line):
    """The plan said 'params.yaml is invalid: studies.s.decide.rounds…', a key that is nowhere: the record is
    rounds.yaml's, and its key there is decided.<study>.…"""
    from layertune.rounds import RULE
    from pipelines.param_checks import InvalidParams
    from tests.projects import make_project, run

    project = make_project(tmp_path, {"download": {"mirror": "mirror"}, "studies": {"s": study(
        "layers", ["sst2"], {"tiny": "models/tiny-a"}, [0, 1], [1, 2], decide={"looks": 3})}})
    cells = {f"sst2-tiny-{k}-3": {"task": "sst2", "encoder": "tiny", "tunable_layers": k, "seed": 3, "round": 2}
             for k in (0, 1)}
    decided_with = {**RECORDED_WITH, "rule": RULE}
    run(project, "plan")  # as recorded: accepted
    change(cells["sst2-tiny-1-3"], decided_with)
    (project / "rounds.yaml").write_text(yaml.safe_dump({"decided": {"s": {
        "rounds": {f"sst2-tiny-{cell['tunable_layers']}-{cell['seed']}": cell for cell in cells.values()},
        "decided_with": decided_with}}}))
    with pytest.raises(InvalidParams) as refused:
        run(project, "plan")
    header, said = refused.value.message.split("\n  ")
    assert header == "rounds.yaml is invalid:" and said.startswith(line), refused.value.message
    assert "params.yaml" not in refused.value.message and "decide.rounds" not in said


def test_dvc_exp_run_of_a_value_the_rounds_were_decided_with_is_refused_saying_what_dvc_wrote(tmp_path):
    """Decided (issue 57): DVC applies -S to params.yaml before the plan can refuse it, and leaves it there, as it does
    for any experiment a stage fails. The refusal says so, and how to see and undo it; nothing else is touched."""
    from layertune.rounds import RULE

    project = make_dvc_project(tmp_path / "project", {"download": {"mirror": "mirror"}, "studies": {"s": study(
        "layers", ["sst2"], {"tiny": "models/tiny-a"}, [0, 1], [1, 2], decide={"looks": 3})}})
    cells = {f"sst2-tiny-{k}-3": {"task": "sst2", "encoder": "tiny", "tunable_layers": k, "seed": 3, "round": 2}
             for k in (0, 1)}
    (project / "rounds.yaml").write_text(yaml.safe_dump({"decided": {"s": {
        "rounds": cells, "decided_with": {**RECORDED_WITH, "tolerance": 0.01, "rule": RULE}}}}))
    env = {**os.environ, **project_env(project)}
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@example.com", "commit", "--quiet", "-am",
                    "a round"], cwd=project, check=True)
    done = subprocess.run(["dvc", "exp", "run", "-S", "++studies.s.report.tolerance=0.05"], cwd=project, env=env,
                          capture_output=True, text=True, timeout=300)
    output = done.stdout + done.stderr
    assert done.returncode != 0 and "Traceback" not in output, output[-3000:]
    assert "studies.s: report.tolerance: 0.05, but the recorded rounds were decided with 0.01" in output
    assert re.search(r"\(dvc exp run [\w-]+: DVC wrote any -S values into params.yaml and rounds.yaml before this "
                     r"check, and leaves them there: git diff params.yaml rounds.yaml shows them; undo them, or git "
                     r"checkout the two files if they held no edits of yours\)", output), output[-3000:]
    assert yaml.safe_load((project / "params.yaml").read_text())["studies"]["s"]["report"]["tolerance"] == 0.05
    assert not (project / "data" / "00_plan").exists()


class Clock:
    """A build that takes ``build_s`` seconds of a clock of its own."""

    def __init__(self, build_s: float) -> None:
        self.now, self.build_s, self.builds = 0.0, build_s, 0

    def monotonic(self) -> float:
        return self.now

    def build(self) -> None:
        self.now += self.build_s
        self.builds += 1
        assert self.builds < 10, "the rounds did not stop"


ROUND = {"sst2-m-1-3": {"task": "sst2", "encoder": "m", "tunable_layers": 1, "seed": 3, "round": 2},
         "sst2-m-2-3": {"task": "sst2", "encoder": "m", "tunable_layers": 2, "seed": 3, "round": 2}}


@pytest.fixture
def driver(tmp_path, monkeypatch):
    """`pipelines.decide` in a folder of one decided study, with the builds, the reports and the record stood in
    for."""
    from pipelines import decide

    import shutil

    from tests.projects import ROOT

    (tmp_path / "params.yaml").write_text(yaml.safe_dump({"studies": {"s": {"decide": {"looks": 3}}}}))
    (tmp_path / "rounds.yaml").write_text("decided: {}\n")
    shutil.copytree(ROOT / "conf", tmp_path / "conf")  # where the catalog puts the reports
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(decide, "next_round", lambda study, params: (ROUND, {}))
    recorded = []
    monkeypatch.setattr(decide, "record", recorded.append)
    return decide, recorded


def cells_built(monkeypatch, decide, *snapshots: dict) -> None:
    """`decide.built_cells` answers ``snapshots`` in turn (each {cell: build key}), then the last for ever."""
    answers = iter(snapshots)
    last = {}

    def built(studies):
        nonlocal last
        last = next(answers, last)
        return last

    monkeypatch.setattr(decide, "built_cells", built)


def test_the_next_round_is_costed_at_a_cells_own_time_however_many_run_at_once(driver, monkeypatch, capsys):
    """Four cells, four at a time, took 100 s: a cell takes 100 s, and the next round's two cells 100 s more, which
    a budget of 3 minutes (100 s spent) cannot take."""
    decide, recorded = driver
    clock = Clock(build_s=100.0)
    monkeypatch.setattr(decide.time, "monotonic", clock.monotonic)
    cells_built(monkeypatch, decide, {}, {f"s/c{i}": "k" for i in range(4)})  # before the build, after it
    assert decide.decide(["s"], 3.0, clock.build, jobs=4) == 0
    assert recorded == [] and clock.builds == 1
    assert "next round (2 cell(s), about 1.7 min at 100 s a cell, 4 at a time) would end past the budget of 3 min" \
        in capsys.readouterr().out


def test_a_resumed_call_costs_the_round_by_the_cells_recorded_training_times(driver, monkeypatch, capsys):
    """A call whose first build trains nothing (the grid was built before) has measured no cell: the training times
    the report recorded for the round's settings stand in, and a round of 2 × 10 minutes does not start in 15."""
    decide, recorded = driver
    (Path("reports") / "s").mkdir(parents=True)
    pd.DataFrame({"key": ["sst2-m-1-1", "sst2-m-2-1", "sst2-m-0-1", "sst2-m-1-2"], "task": "sst2", "encoder": "m",
                  "tunable_layers": [1, 2, 0, 1], "train_time_s": [500.0, 700.0, 1.0, None]}).to_csv(
        Path("reports") / "s" / "cells.csv", index=False)
    clock = Clock(build_s=5.0)
    monkeypatch.setattr(decide.time, "monotonic", clock.monotonic)
    cells_built(monkeypatch, decide, {"s/sst2-m-1-1": "k"})  # built before the call: nothing trains in it
    assert decide.decide(["s"], 15.0, clock.build) == 0
    assert recorded == [] and "about 20.0 min at 600 s a cell" in capsys.readouterr().out


def test_a_round_the_reports_ask_for_again_once_built_stops_the_loop(driver, monkeypatch, capsys):
    decide, recorded = driver
    clock = Clock(build_s=1.0)
    monkeypatch.setattr(decide.time, "monotonic", clock.monotonic)
    cells_built(monkeypatch, decide, {})
    assert decide.decide(["s"], None, clock.build) == 1
    assert recorded == [{"s": (ROUND, {})}] and clock.builds == 2
    assert "the reports of s ask again for the round just recorded; rebuild them (dvc repro --force aggregate@s)" \
        in capsys.readouterr().err


@pytest.mark.parametrize("budget", ["0", "-5", "nan", "inf"])
def test_a_budget_that_is_not_a_positive_number_of_minutes_is_refused(tmp_path, monkeypatch, capsys, budget):
    from pipelines.repro import configure

    (tmp_path / "dvc.yaml").write_text("stages: {}\n")
    monkeypatch.chdir(tmp_path)
    parser = argparse.ArgumentParser()
    assert configure(parser)(parser.parse_args(["--decide", "--budget", budget])) == 2
    assert f"--budget is minutes, a positive number; got {float(budget):g}" in capsys.readouterr().err


def test_the_cells_a_build_trained_leave_out_those_copied_from_another_study(tmp_path, monkeypatch):
    """The budget costs a round by the wall time of the cells the last build trained: a cell copied from another
    study's folder (`TrainedCells.copy_built`, under a second) is not one of them."""
    from pipelines import decide
    from pipelines.trained_cells import TrainedCells
    from tests.test_trained_cells import cell, write

    (tmp_path / "conf").symlink_to(Path(__file__).resolve().parents[1] / "conf")
    monkeypatch.chdir(tmp_path)
    models = tmp_path / "data" / "04_models"
    ablation, methods = (TrainedCells(models / name, models / ".retired" / name) for name in ("ablation", "methods"))
    trained, build = write(ablation, 1)
    assert methods.copy_built("sst2-tiny-top_k-0-1", build, ablation.path / trained)
    own, own_build = write(methods, 2)
    assert decide.built_cells(["ablation", "methods"]) == {f"ablation/{trained}": build["key"],
                                                           f"methods/{own}": own_build["key"]}
