"""``layertune repro --decide [--budget MINUTES] [STUDY ...]``: build the studies decided in rounds, round after
round, until each question is answered, its looks are spent, or the next round would pass the budget.

A round is ordinary cells of the study. After each build the driver reads each question's claims and the round the
rule would run next from the report (``reports/<study>/details.json``, ``decided``: `layertune.reports.decided`),
records that round's cells in params.yaml (``studies.<study>.decide.rounds``, comments kept) and builds again: the
plan adds them to the study's cells, and only they train. A round that adds the evaluation
examples instead is recorded in ``decide.evaluation_rounds``: the evaluate stage scores the saved cells on them. The
record is what a rebuild replays: `dvc repro` of the same params.yaml trains the same cells and writes the same
reports, byte for byte.
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from layertune.study import cell_key
from pipelines.trained_cells import recorded_build_key

PROG = "layertune repro --decide"

PARAMS = Path("params.yaml")
MODELS = Path("data") / "04_models"  # the train stages' outputs, a folder per study (conf/base/catalog.yml)


def check_decided(studies: Sequence[str], params: dict) -> None:
    """Every study of ``studies`` has a ``decide`` section; a `ValueError` naming the key to add, before any work."""
    missing = [name for name in studies if not isinstance(params["studies"][name].get("decide"), dict)]
    if missing:
        raise ValueError(f"--decide: {', '.join(f'studies.{name}' for name in missing)} has no decide section; add "
                         "one to decide in rounds, e.g. decide: {looks: 4, seeds_per_round: 2} (see "
                         "docs/pipeline.md, \"Deciding in rounds\")")


def next_round(study: str, params: dict) -> tuple[dict[str, dict], dict[str, dict[str, int]]]:
    """The round the rule runs next for every question still open, from the study's report: the cells to train, by
    key, and the questions that get the evaluation examples instead (``{task: {encoder: round}}``)."""
    details = json.loads((Path("reports") / study / "details.json").read_text())
    axis = "tunable_layers" if params["studies"][study].get("methods") is None else "method"
    cells: dict[str, dict] = {}
    evaluation: dict[str, dict[str, int]] = {}
    for task, encoders in details.items():
        for encoder, entry in encoders.items():
            following = (entry.get("decided") or {}).get("next_round")
            if following is None:
                continue
            number = len(entry["decided"]["rounds"]) + 1
            if following.get("examples"):
                evaluation.setdefault(task, {})[encoder] = number
                continue
            for setting in following["settings"]:
                value = (setting if setting == "all" else int(setting)) if axis == "tunable_layers" else setting
                for seed in following["seeds"]:
                    cells[cell_key(task, encoder, value, seed)] = {"task": task, "encoder": encoder, axis: value,
                                                                  "seed": seed, "round": number}
    return cells, evaluation


def record(additions: dict[str, tuple[dict[str, dict], dict[str, dict[str, int]]]]) -> None:
    """``additions`` ({study: (cells by key, evaluation rounds)}) appended to params.yaml's ``decide.rounds`` and
    ``decide.evaluation_rounds``, with ``decide.decided_with`` (the values the rounds are decided with) where the
    record has none yet. Only each study's ``decide`` block is written anew: the rest of the file stays as its
    author wrote it, byte for byte."""
    from ruamel.yaml import YAML
    from ruamel.yaml.comments import CommentedMap

    yaml = YAML()
    yaml.preserve_quotes = True
    yaml.width = 4096  # a round's cell on one line, however long its key (a wrapped flow mapping ends in a space)
    text = PARAMS.read_text()
    params = yaml.load(text)
    for study, (cells, evaluation) in additions.items():
        decide = params["studies"][study]["decide"]
        decide.fa.set_block_style()  # `decide: {looks: 4}` grows a block of rounds
        first = not decide.get("rounds") and not decide.get("evaluation_rounds")  # (a cleared record's too)
        if first or decide.get("decided_with") is None:  # (or a record from before the values were kept)
            values = CommentedMap(decided_with(params["studies"][study]))
            values.fa.set_flow_style()
            decide.pop("decided_with", None)
            decide.insert(list(decide).index("rounds") if "rounds" in decide else len(decide), "decided_with", values)
        if cells and not decide.get("rounds"):  # none, or `rounds: {}` (flow style: it would stay on one line)
            decide["rounds"] = CommentedMap()
        for key, cell in cells.items():
            entry = CommentedMap(cell)
            entry.fa.set_flow_style()
            decide["rounds"][key] = entry
        if evaluation and not decide.get("evaluation_rounds"):
            decide["evaluation_rounds"] = CommentedMap()
        for task, encoders in evaluation.items():
            if decide["evaluation_rounds"].get(task) is None:
                decide["evaluation_rounds"][task] = CommentedMap()
                decide["evaluation_rounds"][task].fa.set_flow_style()
            decide["evaluation_rounds"][task].update(encoders)
    staging = PARAMS.with_name(f".{PARAMS.name}.decide")
    staging.write_text(with_decide_blocks(text, params, list(additions), yaml))
    staging.replace(PARAMS)  # whole or not at all


def decided_with(study: dict) -> dict:
    """The values a study of params.yaml (as read) decides its rounds with, defaults filled in
    (`layertune.study.DecidedWith`)."""
    from layertune.study import DecidedWith, DecideSpec, ReportSpec

    plain = json.loads(json.dumps(study))  # ruamel's mappings as plain ones
    return DecidedWith.of(ReportSpec.model_validate(plain["report"]),
                          DecideSpec.model_validate(plain["decide"])).model_dump()


def with_decide_blocks(text: str, params, studies: Sequence[str], yaml) -> str:
    """``text`` (params.yaml as read into ``params``, which ruamel has since changed) with the ``decide`` block of
    each of ``studies`` as ruamel writes it, and every other line as it was: a round trip of the whole file would
    also rewrite what nobody changed (a flow mapping over two lines joined into one). Where the result would not
    read back as ruamel's whole file does, ruamel's whole file."""
    import io

    from ruamel.yaml import YAML

    out = io.StringIO()
    yaml.dump(params, out)
    dumped = out.getvalue()
    lines, dumped_lines = text.splitlines(keepends=True), dumped.splitlines(keepends=True)
    rewritten = yaml.load(dumped)
    blocks = {study: _decide_block(params, study, len(lines)) for study in studies}
    for study in sorted(studies, key=lambda name: -blocks[name][0]):  # bottom up: the lines above keep their numbers
        start, end, column = blocks[study]
        new_start, new_end, new_column = _decide_block(rewritten, study, len(dumped_lines))
        lines[start:end] = [_shifted(line, column - new_column) for line in dumped_lines[new_start:new_end]]
    spliced = "".join(lines)
    safe = YAML(typ="safe", pure=True)
    return spliced if safe.load(spliced) == safe.load(dumped) else dumped


def _decide_block(params, study: str, total: int) -> tuple[int, int, int]:
    """Where ``studies.<study>.decide`` lies in the text ``params`` was read from: its first line, the line after
    its last (the next key's, of the study, of the studies or of the file), and its key's column."""
    studies = params["studies"]
    entry = studies[study]
    line, column = entry.lc.key("decide")
    after = [entry.lc.key(key)[0] for key in entry if entry.lc.key(key)[0] > line]
    after += [studies.lc.key(key)[0] for key in studies if studies.lc.key(key)[0] > line]
    after += [params.lc.key(key)[0] for key in params if params.lc.key(key)[0] > line]
    return line, min(after, default=total), column


def _shifted(line: str, shift: int) -> str:
    """``line`` moved ``shift`` columns right (left where negative, never past its first character); a blank line as
    it is."""
    if not line.strip() or shift >= 0:
        return " " * shift + line if line.strip() else line
    return line[min(-shift, len(line) - len(line.lstrip(" "))):]


def decide(studies: Sequence[str], budget_minutes: float | None, build: Callable[[], None], jobs: int = 1) -> int:
    """Rounds of ``build`` (a whole build of ``studies``, ``jobs`` cells at a time; it raises if it fails) until no
    study has a next round, or the next one would end past ``budget_minutes`` of this call (None: the studies' own
    ``decide.budget_minutes``, else none)."""
    import yaml

    params = yaml.safe_load(PARAMS.read_text())
    check_decided(studies, params)
    budgets = [params["studies"][s]["decide"].get("budget_minutes") for s in studies]
    budget = budget_minutes if budget_minutes is not None else min((b for b in budgets if b), default=None)
    started = time.monotonic()
    cell_seconds = None  # what one cell's stage took in the last build that trained any (wall time, not CPU)
    proposed: dict = {}  # the round last recorded, by study
    while True:
        before, round_started = built_cells(studies), time.monotonic()
        build()
        after = built_cells(studies)
        cells = sum(after[key] != before.get(key) for key in after)  # the cells this build trained
        if cells:  # `jobs` at a time: a cell took that share of the wall time, times the cells side by side
            cell_seconds = (time.monotonic() - round_started) * min(jobs, cells) / cells
        params = yaml.safe_load(PARAMS.read_text())
        additions = {study: found for study in studies if any(found := next_round(study, params))}
        spent = time.monotonic() - started
        if not additions:
            print(f"{PROG}: every question of {', '.join(studies)} is decided or has spent its rounds, in "
                  f"{spent / 60:.1f} min: see reports/<study>.md, \"Rounds\"", flush=True)
            return 0
        if stale := [study for study, found in additions.items() if proposed.get(study) == found]:
            # recorded, built, and its report still asks for it: it did not move on
            print(f"{PROG}: the reports of {', '.join(stale)} ask again for the round just recorded; rebuild them "
                  f"(dvc repro --force {' '.join(f'aggregate@{study}' for study in stale)}) and run this again",
                  file=sys.stderr, flush=True)
            return 1
        count = sum(len(cells) for cells, _ in additions.values())
        # Scoring the evaluation examples costs little beside training. Before any cell trained in this call (a
        # resumed build), the cells' own training times recorded in the reports stand in: the stages' start-up
        # is not in them.
        each = cell_seconds if cell_seconds is not None else recorded_training_seconds(additions)
        cost = each * math.ceil(count / jobs)
        if budget is not None and spent + cost > 60 * budget:
            print(f"{PROG}: the next round ({count} cell(s), about {cost / 60:.1f} min at {each:.0f} s a cell"
                  f"{'' if jobs == 1 else f', {jobs} at a time'}) would end past the budget of {budget:g} min "
                  f"({spent / 60:.1f} min spent): stopped; the reports say what each open question would need",
                  flush=True)
            return 0
        print(f"{PROG}: next round, {count} cell(s): " + "; ".join(
            f"{study}: {', '.join([*cells, *_evaluation_text(evaluation)])}" for study, (cells, evaluation)
            in additions.items()), flush=True)
        record(additions)
        proposed = additions


def built_cells(studies: Sequence[str]) -> dict[str, str | None]:
    """``{<study>/<cell>: its build key}`` for every cell folder of ``studies``."""
    return {f"{study}/{folder.name}": recorded_build_key(folder) for study in studies
            for folder in sorted((MODELS / study).glob("*/")) if not folder.name.startswith(".")}


def recorded_training_seconds(additions: dict[str, tuple[dict[str, dict], dict]]) -> float:
    """The mean training time of the cells already trained of the settings a round trains (each study's
    ``reports/<study>/cells.csv``); 0 where none is recorded."""
    import pandas as pd

    times = []
    for study, (cells, _) in additions.items():
        table = Path("reports") / study / "cells.csv"
        if not cells or not table.is_file():
            continue
        recorded = pd.read_csv(table)
        axis = "method" if "method" in recorded.columns else "tunable_layers"
        for cell in cells.values():
            same = recorded[(recorded["task"] == cell["task"]) & (recorded["encoder"] == cell["encoder"])
                            & (recorded[axis].astype(str) == str(cell[axis]))]
            times += same["train_time_s"].dropna().tolist()
    return sum(times) / len(times) if times else 0.0


def _evaluation_text(evaluation: dict[str, dict[str, int]]) -> list[str]:
    return [f"evaluation examples for {task} {encoder}" for task, encoders in evaluation.items()
            for encoder in encoders]


if __name__ == "__main__":
    sys.exit("run it as: layertune repro --decide [--budget MINUTES] [STUDY ...]")
