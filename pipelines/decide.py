"""``layertune repro --decide``: build the studies decided in rounds, round after round, each recorded whole in the
record of rounds (`pipelines.params.RECORD_FILE`), which a rebuild replays (docs/pipeline.md, "Deciding in rounds")."""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from layertune.study import cell_key
from pipelines.params import RECORD_FILE, RECORD_KEY, RECORDED, read_params

PROG = "layertune repro --decide"


def next_round(study: str, params: dict) -> tuple[dict[str, dict], dict[str, dict[str, int]]]:
    """The next round of every question still open, from the study's report: the cells to train, by key, and the
    questions that get the evaluation examples instead (``{task: {encoder: round}}``)."""
    from pipelines.catalog import catalog_path

    details = json.loads(catalog_path("report_details", study).read_text())
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
    """``additions`` ({study: `next_round`}) added to each study's record of rounds, with ``decided_with`` where the
    record has none yet; the file written whole in one atomic step."""
    import yaml

    from layertune.io import atomic_file

    params = read_params()
    decided = {name: dict(entry or {}) for name, entry in (params.get(RECORD_KEY) or {}).items()}
    for study, (cells, evaluation) in additions.items():
        entry = decided.setdefault(study, {})
        if entry.get("decided_with") is None or not (entry.get("rounds") or entry.get("evaluation_rounds")):
            entry["decided_with"] = decided_with(params["studies"][study])  # the first round (a cleared record's)
        entry["rounds"] = {**(entry.get("rounds") or {}), **cells}
        if evaluation:
            recorded = {task: dict(encoders) for task, encoders in (entry.get("evaluation_rounds") or {}).items()}
            for task, encoders in evaluation.items():
                recorded.setdefault(task, {}).update(encoders)
            entry["evaluation_rounds"] = recorded
    header = "".join(line for line in Path(RECORD_FILE).read_text().splitlines(keepends=True)
                     if line.startswith("#")) if Path(RECORD_FILE).is_file() else ""
    with atomic_file(RECORD_FILE) as staging:  # whole or not at all
        staging.write_text(header + yaml.safe_dump({RECORD_KEY: decided}, sort_keys=False, width=120))


def decided_with(study: dict) -> dict:
    """The values a study of params.yaml (as read) decides its rounds with, defaults filled in, and today's rule
    (`layertune.study.DecidedWith`)."""
    from layertune.study import DecidedWith, DecideSpec, ReportSpec

    return DecidedWith.of(ReportSpec.model_validate(study["report"]),
                          DecideSpec.model_validate({key: value for key, value in study["decide"].items()
                                                     if key not in RECORDED})
                          ).model_dump()


def decide(studies: Sequence[str], budget_minutes: float | None, build: Callable[[], None], jobs: int = 1) -> int:
    """Rounds of ``build`` (a whole build of ``studies``, ``jobs`` cells at a time; it raises if it fails) until no
    study has a next round, or the next would end past ``budget_minutes`` (None: the studies' ``decide.budget_minutes``,
    else none); the exit status. Every study has a decide section (`pipelines.repro.study_names` checks it)."""
    params = read_params()
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
        params = read_params()
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
    """``{<study>/<cell>: its build key}`` for every cell folder of ``studies`` that a build trained (a cell copied
    from another study's folder cost no training: `TrainedCells.copy_built`)."""
    from pipelines.catalog import catalog_path
    from pipelines.trained_cells import TrainedCells, read_record

    found = {}
    for study in studies:
        cells = TrainedCells(catalog_path("study_cells", study), catalog_path("study_cells", study, key="retired"))
        records = {key: read_record(cells[key].path) or {} for key in cells}
        found |= {f"{study}/{key}": record.get("key") for key, record in records.items()
                  if not record.get("copied_from")}
    return found


def recorded_training_seconds(additions: dict[str, tuple[dict[str, dict], dict]]) -> float:
    """The mean training time recorded in the reports' cell tables for the settings a round trains; 0 if none."""
    import pandas as pd

    from pipelines.catalog import catalog_path

    times = []
    for study, (cells, _) in additions.items():
        table = catalog_path("report_tables", study) / "cells.csv"
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
