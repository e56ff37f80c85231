"""`layertune repro --decide` on a tiny project: the rounds it runs are recorded in params.yaml, only the settings
still in question train in them, the report lists them, and a rebuild replays them (nothing trains, the same
report byte for byte)."""

import os
import subprocess

import pytest
import yaml

from tests.projects import make_dvc_project, project_env, study


@pytest.mark.slow
def test_decide_runs_rounds_until_its_looks_are_spent_and_a_rebuild_replays_them(tmp_path):
    decided = study("layers", ["sst2"], {"tiny": "models/tiny-a"}, [0, 1], [1, 2],
                    decide={"looks": 2, "seeds_per_round": 1})
    project = make_dvc_project(tmp_path / "project", {"download": {"mirror": "mirror"}, "studies": {"s": decided}})
    env = {**os.environ, **project_env(project)}

    built = subprocess.run(["layertune", "repro", "--decide"], cwd=project, env=env, capture_output=True, text=True,
                           timeout=600)
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    assert "next round, " in built.stdout and "decided or has spent its rounds" in built.stdout

    details = (project / "reports" / "s" / "details.json").read_bytes()
    record = yaml.safe_load((project / "params.yaml").read_text())["studies"]["s"]["decide"]["rounds"]
    rounds = yaml.safe_load(details)["sst2"]["tiny"]["decided"]["rounds"]
    assert len(rounds) == 2 and rounds[1]["seeds"] == [3]  # round 1: the grid; round 2: one new seed
    open_after_1 = [k for k in ("0", "1") if rounds[0]["claims"][k] != "no"]
    assert rounds[1]["settings"] == open_after_1
    assert sorted(record) == sorted(f"sst2-tiny-{k}-3" for k in open_after_1)
    assert all(cell["round"] == 2 for cell in record.values())
    assert "rounds-s:" in (project / "dvc.yaml").read_text()
    trained = sorted(p.name for p in (project / "data" / "04_models" / "s").iterdir())
    assert trained == sorted([f"sst2-tiny-{k}-{seed}" for k in (0, 1) for seed in (1, 2)]
                             + [f"sst2-tiny-{k}-3" for k in open_after_1])
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
    """The report's next round for one question is the evaluation examples, for another new seeds: params.yaml
    records both, its comments kept, and dvc.yaml gets train stages for the cells only."""
    import json

    from pipelines import decide

    decided = study("layers", ["sst2"], {"tiny": "models/tiny-a", "other": "models/tiny-b"}, [0, 1], [1, 2],
                    decide={"looks": 3, "evaluation_size": 50, "rounds": {}})
    project = make_dvc_project(tmp_path / "project", {"download": {"mirror": "mirror"}, "studies": {"s": decided}})
    params = (project / "params.yaml").read_text().replace("studies:\n", "studies:  # the user's comment\n", 1)
    (project / "params.yaml").write_text(params)
    (project / "reports" / "s").mkdir(parents=True)
    (project / "reports" / "s" / "details.json").write_text(json.dumps({"sst2": {
        "tiny": {"decided": {"rounds": [{}], "next_round": {"seeds": [], "settings": ["0", "1"], "examples": 50}}},
        "other": {"decided": {"rounds": [{}], "next_round": {"seeds": [3], "settings": ["1"]}}}}}))
    monkeypatch.chdir(project)
    found = decide.next_round("s", yaml.safe_load(params))
    assert found == ({"sst2-other-1-3": {"task": "sst2", "encoder": "other", "tunable_layers": 1, "seed": 3,
                                         "round": 2}}, {"sst2": {"tiny": 2}})
    decide.record({"s": found})
    written = (project / "params.yaml").read_text()
    assert "# the user's comment" in written
    recorded = yaml.safe_load(written)["studies"]["s"]["decide"]
    assert recorded["evaluation_rounds"] == {"sst2": {"tiny": 2}} and list(recorded["rounds"]) == ["sst2-other-1-3"]
    assert "rounds-s:" in (project / "dvc.yaml").read_text()
