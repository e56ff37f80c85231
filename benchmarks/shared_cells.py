"""What copying the cells two studies share saves a user's build (`dvc repro` in a fresh clone), side by side in one
run: two studies on SST-2 and all-MiniLM-L6-v2 shaped as the default ablation and methods studies (the methods
study's top-K settings are ablation settings), built from scratch at this commit, which copies a cell another study
has built (docs/pipeline.md, "Which cells train"), and at ``--before``, which trains it again.

    python benchmarks/shared_cells.py --json reports/benchmarks/shared_cells.json        # about 15 min on 2 cores

Per build: its wall time, the train stages' wall time and the training the library measured, and per study the
cells trained and copied; then whether the two builds' scores agree, setting by setting (the copied cells are the
cells the other build trained, so they must: float32, one machine).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from machine_speed import reference  # noqa: E402
from pipeline_speed import build, clone  # noqa: E402  (a fresh clone, and `dvc repro` of it, timed)

BEFORE = "e8be4d7"  # the last commit that trained every cell of every study

DATA = {"train_size": 1000, "validation_size": 200, "dev_size": 500, "seed": 42}
TRAINING = {"learning_rate": 5.0e-5, "head_learning_rate": 1.0e-3, "batch_size": 16, "eval_batch_size": 128,
            "epochs": 4, "early_stopping_patience": 1, "eval_strategy": "epoch", "weight_decay": 0.01,
            "warmup_ratio": 0.1, "group_by_length": True, "max_length": 128, "mixed_precision": "no"}
HEAD_ALONE = {0: {"head_learning_rate": 1.0e-2, "epochs": 20, "early_stopping_patience": 3, "warmup_ratio": 0.0,
                  "weight_decay": 0.0}}


def two_studies(params: dict) -> dict:
    """The default params with two studies in place of four: the methods study's three top-K settings are the
    ablation's; its LoRA setting is its own."""
    encoders = {"all-MiniLM-L6-v2": "sentence-transformers/all-MiniLM-L6-v2"}
    shared = {"tasks": ["sst2"], "encoders": encoders, "seeds": [1, 2], "data": DATA, "encoder": {"pooling": "mean"},
              "training": TRAINING, "per_tunable_layers": HEAD_ALONE}
    return {**params, "decided": {}, "studies": {
        "ablation": {"report": {"kind": "layers", "tolerance": 0.01}, "tunable_layers": [0, 2, "all"], **shared},
        "methods": {"report": {"kind": "methods", "tolerance": 0.01}, **shared, "methods": {
            "top_k-0": {"tunable_layers": 0}, "top_k-2": {"tunable_layers": 2},
            "top_k-all": {"tunable_layers": "all"},
            "lora-top2": {"method": {"name": "lora", "r": 8}, "tunable_layers": 2, "learning_rate": 1.0e-3}}}}}


def cells_of(copy: Path) -> dict[str, dict[str, int]]:
    """Per study, its cells trained and copied (a copied cell's build record names its source)."""
    found: dict[str, dict[str, int]] = {}
    for record_path in sorted((copy / "data" / "04_models").glob("*/*/build.json")):
        record = json.loads(record_path.read_text())
        counts = found.setdefault(record_path.parent.parent.name, {"trained": 0, "copied": 0})
        counts["copied" if record.get("copied_from") else "trained"] += 1
    return found


def scores_of(copy: Path) -> dict[str, list[dict]]:
    """Per study, each setting's dev score and interval, as its report's table has them."""
    import csv

    return {path.name.removesuffix(".scores.csv"): list(csv.DictReader(path.open()))
            for path in sorted((copy / "reports").glob("*.scores.csv"))}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", default=BEFORE, metavar="REV", help=f"the revision that trains every cell "
                                                                         f"(default {BEFORE})")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--keep", type=Path, help="build in this (new) folder and keep the clones")
    args = parser.parse_args(argv)
    report: dict = {"machine": reference(), "date": time.strftime("%Y-%m-%d"), "data": DATA, "training": TRAINING}
    with contextlib.ExitStack() as stack:
        if args.keep:
            args.keep.mkdir(parents=True)  # a new folder: never build over an earlier one
        work = args.keep or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="layertune-shared-")))
        scores = {}
        for label, revision in (("before", args.before), ("after", "HEAD")):
            copy = clone(work, label, revision, two_studies)
            measured = build(copy)
            report[label] = {"commit": revision, "wall_s": measured["wall_s"],
                             "train_stages_wall_s": measured["train_stages"]["wall_s"],
                             "training_s": measured["compute_s"].get("training"), "cells": cells_of(copy)}
            scores[label] = scores_of(copy)
            print(json.dumps({label: report[label]}), flush=True)
    report["saved"] = {key: round(1 - report["after"][key] / report["before"][key], 3)
                       for key in ("wall_s", "train_stages_wall_s", "training_s")}
    report["same_scores"] = scores["before"] == scores["after"]
    print(json.dumps({"saved": report["saved"], "same_scores": report["same_scores"]}), flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
