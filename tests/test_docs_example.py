"""The worked example of docs/pipeline.md ("Adding a study") really runs: its params.yaml section, taken from the
docs, added to a fresh clone with the ci profile applied, built by `dvc repro` on the real model and data (no other
step: a study is a section of params.yaml)."""

import json
import os
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from pipelines.params import read_params, write_params
from pipelines.profiles import apply_overrides, load_profile

ROOT = Path(__file__).resolve().parents[1]


def example(marker: str) -> str:
    """The YAML block after ``<!-- example: <marker> -->`` in docs/pipeline.md."""
    text = (ROOT / "docs" / "pipeline.md").read_text()
    found = re.search(rf"<!-- example: {marker} -->\n```yaml\n(.*?)```", text, re.S)
    assert found, f"docs/pipeline.md has no example block {marker!r}"
    return found.group(1)


@pytest.mark.slow
@pytest.mark.integration
def test_the_pooling_study_of_the_docs_builds_with_dvc(data_mirror, tmp_path):
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "--quiet", str(ROOT), str(clone)], check=True)
    params = read_params(clone)  # params.yaml and the record of rounds, which the ci profile clears
    params["studies"].update(yaml.safe_load(example("params")))
    write_params(clone, apply_overrides(params, load_profile("ci", ROOT)))
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{clone / 'mlflow.db'}",
           "LAYERTUNE_MODEL_MIRROR": str(data_mirror.parent / "models")}
    built = subprocess.run(["dvc", "repro", "--quiet", "aggregate@pooling"], cwd=clone, env=env, capture_output=True,
                           text=True)
    assert built.returncode == 0, (built.stdout + built.stderr)[-3000:]
    metrics = json.loads((clone / "reports" / "pooling.json").read_text())
    assert set(metrics["sst2"]) == {"mean", "cls", "pooler"}
    assert all(set(entry["mean"]) == {"0", "2"} for entry in metrics["sst2"].values())
    report = (clone / "reports" / "pooling.md").read_text()
    assert "## SST-2 (accuracy), pooler" in report and "Recommended number of tunable layers" in report
    assert not (clone / "data" / "04_models" / "ablation").exists()  # only what the pooling report needs was built
