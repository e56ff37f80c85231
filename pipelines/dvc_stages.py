"""dvc.yaml's train stages, one matrix block per study, written from params.yaml.

A study is a section of params.yaml; most stages iterate over the studies (``matrix: study: ${studies}``), but the
train stage must iterate over each study's own grid (its tasks × encoders × tunable layers × seeds), and DVC's
templating cannot nest a matrix inside an iteration over studies. So those blocks are the same lines with the study's
name, written here between two marker lines of dvc.yaml rather than by hand:

    python -m pipelines.dvc_stages           # rewrite the blocks (after adding or removing a study)
    python -m pipelines.dvc_stages --check   # exit 1 if dvc.yaml is not what params.yaml asks for

`make study` runs the first before `dvc repro`, and a test runs the second. A study's grid is not written here: the
matrix reads it from params.yaml (``${studies.<name>.seeds}``, ...), so a new seed, task, encoder, tunable-layers
value or method needs no step. A new study does; if it is forgotten, the plan stage stops the build before any other
work (`stale_train_stages`, called by `pipelines.param_checks`), naming the command.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Iterable, Sequence
from pathlib import Path

import yaml

BEGIN = "  # >>> train stages: written by `python -m pipelines.dvc_stages` from params.yaml's studies; do not edit"
END = "  # <<< end of the train stages"
# What trains one cell, whichever block names it; {item}: `tunable_layers` or (a study of tuning methods) `method`.
CELL_STAGE = """\
cmd: ${{run}} train --params study={study},cell=${{key}}
deps:
  - data/00_plan/{study}/cells/${{key}}.json
  - data/00_plan/code/train.json
  - data/02_prepared/{study}/${{item.task}}
  - data/03_features/{study}/${{item.task}}-${{item.encoder}}-${{item.{item}}}.json
outs:
  - data/04_models/{study}/${{key}}
"""
# {axis}: the grid's third axis, `tunable_layers` or `methods` (`StudySpec.grid_axis`).
BLOCK = """\
  train-{study}:
    matrix:
      task: ${{studies.{study}.tasks}}
      encoder: ${{studies.{study}.encoders}}
      {item}: ${{studies.{study}.{axis}}}
      seed: ${{studies.{study}.seeds}}
""" + textwrap.indent(CELL_STAGE, " " * 4)
# A decided study's later rounds (``decide.rounds``, written by `layertune repro --decide`): the same stage for each
# recorded cell, iterated with ``foreach`` (a round's cells are not a full grid).
ROUNDS_BLOCK = """\
  rounds-{study}:
    foreach: ${{studies.{study}.decide.rounds}}
    do:
""" + textwrap.indent(CELL_STAGE, " " * 6)
CELL_STAGES = ("train-", "rounds-")  # the prefixes of the stages that train a cell


def cell_stage_study(stage: str) -> str | None:
    """The study whose cell DVC stage ``stage`` trains (``train-<study>@<key>``, ``rounds-<study>@<key>``), or
    None for another stage."""
    name = stage.split("@")[0]
    return next((name.removeprefix(prefix) for prefix in CELL_STAGES if name.startswith(prefix)), None)


def train_blocks(studies: dict[str, str], decided: Iterable[str] = ()) -> str:
    """One block per study, ``studies``: {name: its grid axis}; a second for those ``decided`` in rounds."""
    return "\n".join(template.format(study=study, axis=axis, item={"methods": "method"}.get(axis, axis))
                      for study, axis in studies.items()
                      for template in (BLOCK, *([ROUNDS_BLOCK] if study in decided else [])))


def grid_axes(params: dict) -> dict[str, str]:
    """Each study's grid axis as params.yaml writes it: ``methods`` where a study has them, else tunable_layers."""
    return {name: "methods" if isinstance(study, dict) and study.get("methods") is not None else "tunable_layers"
            for name, study in (params.get("studies") or {}).items()}


def decided_studies(params: dict) -> list[str]:
    """The studies whose ``decide`` section holds a record of rounds (``rounds``, empty or not)."""
    return [name for name, study in (params.get("studies") or {}).items()
            if isinstance(study, dict) and isinstance(study.get("decide"), dict) and "rounds" in study["decide"]]


def written(dvc_yaml: str, studies: dict[str, str], decided: Iterable[str] = ()) -> str:
    """``dvc_yaml`` with the text between the markers replaced by the train blocks of ``studies`` (`train_blocks`)."""
    try:
        start, end = dvc_yaml.index(BEGIN + "\n") + len(BEGIN) + 1, dvc_yaml.index(END)
    except ValueError:
        raise ValueError(f"dvc.yaml lacks the marker lines of the generated train stages:\n{BEGIN}\n{END}") from None
    return dvc_yaml[:start] + train_blocks(studies, decided) + dvc_yaml[end:]


def stale_train_stages(dvc_yaml: str, studies: dict[str, str], decided: Iterable[str] = ()) -> str | None:
    """Why dvc.yaml's train stages are not those ``studies`` ({name: grid axis}, ``decided``: `decided_studies`)
    need, naming the command that writes them; None when they are."""
    try:
        wanted = written(dvc_yaml, studies, decided)
    except ValueError as error:
        return str(error).replace("\n", " ")
    if wanted == dvc_yaml:
        return None
    present = set(re.findall(r"^  train-([\w-]+):$", dvc_yaml, flags=re.MULTILINE))
    missing = [name for name in studies if name not in present]
    problem = (f"dvc.yaml has no train stage for {'study' if len(missing) == 1 else 'studies'} "
               f"{', '.join(map(repr, missing))} of params.yaml" if missing else
               f"dvc.yaml's train stages are not those of params.yaml's studies ({', '.join(studies)})")
    return (f"{problem}: run python -m pipelines.dvc_stages (it writes dvc.yaml's train stages from params.yaml), "
            "then dvc repro or dvc exp run again")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipelines.dvc_stages", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="only check that dvc.yaml is up to date")
    parser.add_argument("--project", type=Path, default=Path("."), help="the project folder (default: here)")
    args = parser.parse_args(argv)
    params = yaml.safe_load((args.project / "params.yaml").read_text()) or {}
    studies, decided = grid_axes(params), decided_studies(params)
    path = args.project / "dvc.yaml"
    current = path.read_text()
    wanted = written(current, studies, decided)
    if wanted == current:
        return 0
    if args.check:
        print(stale_train_stages(current, studies, decided), file=sys.stderr)
        return 1
    from layertune.io import atomic_file

    path = path.resolve()  # a dvc.yaml that links elsewhere: the file it links to is written
    with atomic_file(path) as staging:  # whole or not at all: a stopped write leaves dvc.yaml as it was
        staging.write_text(wanted)
        shutil.copymode(path, staging)
    print(f"{path}: train stages written for {', '.join(studies)}")
    return 0


def changed_cells(targets: Sequence[str]) -> list[str]:
    """The train stages `dvc status` reports changed upstream of ``targets``."""
    status = subprocess.run(["dvc", "status", "--json", "--with-deps", *targets], capture_output=True, text=True,
                            check=True)
    return sorted(name for name in json.loads(status.stdout or "{}") if cell_stage_study(name) is not None)


if __name__ == "__main__":
    sys.exit(main())
