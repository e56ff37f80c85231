"""Where a study's wall time goes, built from scratch the way a user builds it (`dvc repro` in a fresh clone), and the
same grid trained the common way (one `transformers.Trainer` process per cell), side by side.

    python benchmarks/pipeline_speed.py --json reports/benchmark_pipeline.json           # the default studies
    python benchmarks/pipeline_speed.py --profile ci --no-common --json out.json         # quick

Per DVC stage: its wall time (from DVC starting it to DVC starting the next: its process and DVC's own work for it),
its compute (training, scoring, caching frozen states, tokenizing, as the library measures it; see
`layertune.timing`) and the rest, its fixed cost. For the study: the share of wall time spent in compute, and a
no-op `dvc repro`. End to end: one study's grid (``--common-study``, with BERT's own pooler head on both sides so
that both train the same architecture) built by `dvc repro` from scratch and by `benchmarks/common_cell.py` once
per cell; wall times and dev scores per cell.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from pipelines.profiles import apply_overrides, load_profile  # noqa: E402
from pipelines.plans import plan_studies  # noqa: E402

RUNNING = re.compile(r"^Running stage '([^']+)':")


def clone(workdir: Path, name: str, overrides: dict) -> Path:
    """A fresh clone of HEAD (empty caches, no MLflow database) with ``overrides`` applied to params.yaml."""
    copy = workdir / name
    subprocess.run(["git", "clone", "--quiet", str(ROOT), str(copy)], check=True)
    params = apply_overrides(yaml.safe_load((copy / "params.yaml").read_text()), overrides)
    (copy / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    return copy


def environment(copy: Path) -> dict:
    return {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{copy / 'mlflow.db'}", "PYTHONPATH": str(copy / "src"),
            "LAYERTUNE_TIMINGS": str(copy / "timings.jsonl"), "LAYERTUNE_WARM_DIR": str(copy / ".warm")}


def repro(copy: Path, targets: list[str]) -> tuple[float, dict[str, float]]:
    """Wall time of `dvc repro`, and per stage from DVC starting it to DVC starting the next (or finishing)."""
    started = time.monotonic()
    process = subprocess.Popen(["dvc", "repro", *targets], cwd=copy, env=environment(copy), text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    marks, log = [], []
    for line in process.stdout:
        log.append(line)
        if found := RUNNING.match(line):
            marks.append((time.monotonic(), found.group(1)))
    if process.wait():
        sys.stderr.write("".join(log[-60:]))
        raise SystemExit(f"dvc repro failed in {copy}")
    ended = time.monotonic()
    walls = {name: (marks[i + 1][0] if i + 1 < len(marks) else ended) - at for i, (at, name) in enumerate(marks)}
    return ended - started, walls


def stage_of(argv: list[str]) -> str:
    """The DVC stage a `kedro run --pipelines <p> --params study=…,cell=…` process was."""
    pipeline = argv[argv.index("--pipelines") + 1]
    params = dict(p.split("=", 1) for p in argv[argv.index("--params") + 1].split(",")) if "--params" in argv else {}
    if pipeline == "train":
        return f"train-{params['study']}@{params['cell']}"
    return f"{pipeline}@{params['study']}" if "study" in params else pipeline


def compute_by_stage(copy: Path) -> dict[str, dict[str, float]]:
    found: dict[str, dict[str, float]] = {}
    path = copy / "timings.jsonl"
    for line in path.read_text().splitlines() if path.exists() else []:
        record = json.loads(line)
        if "--pipelines" in record["argv"]:
            found[stage_of(record["argv"])] = record["compute_s"]
    return found


def pipeline_report(copy: Path, targets: list[str]) -> dict:
    wall, walls = repro(copy, targets)
    compute = compute_by_stage(copy)
    stages = [{"stage": name, "wall_s": round(seconds, 2), "compute_s": round(sum(compute.get(name, {}).values()), 2),
               "fixed_s": round(seconds - sum(compute.get(name, {}).values()), 2),
               "compute": {k: round(v, 2) for k, v in compute.get(name, {}).items()}}
              for name, seconds in walls.items()]
    cells = [s for s in stages if s["stage"].startswith("train-")]
    total_compute = sum(s["compute_s"] for s in stages)
    no_op_started = time.monotonic()
    subprocess.run(["dvc", "repro", *targets], cwd=copy, env=environment(copy), check=True, capture_output=True)
    return {"stages": stages, "study": {
        "wall_s": round(wall, 1), "compute_s": round(total_compute, 1), "compute_share": round(total_compute / wall, 3),
        "cells": len(cells), "cell_fixed_s_mean": round(sum(s["fixed_s"] for s in cells) / max(len(cells), 1), 2),
        "cell_fixed_s_max": max((s["fixed_s"] for s in cells), default=0.0),
        "dvc_outside_stages_s": round(wall - sum(walls.values()), 1),
        "no_op_repro_s": round(time.monotonic() - no_op_started, 2)}}


def common_way(copy: Path, study: str) -> dict:
    """Every cell of ``study`` trained by `common_cell.py`, one process each, on the study's prepared data."""
    plan = plan_studies(yaml.safe_load((copy / "params.yaml").read_text())).studies[study]
    scores, started = {}, time.monotonic()
    for cell in plan.cells:
        spec, training = cell.spec.encoders[0], cell.spec.training
        command = [sys.executable, str(ROOT / "benchmarks" / "common_cell.py"),
                   "--data", str(copy / "data" / "02_prepared" / study / cell.task), "--model", spec.model,
                   "--tunable-layers", str(cell.tunable_layers), "--seed", str(cell.seed),
                   "--output-dir", str(copy / "common" / cell.key), "--learning-rate", str(training.learning_rate),
                   "--epochs", str(training.epochs), "--batch-size", str(training.batch_size),
                   "--eval-batch-size", str(training.eval_batch_size or training.batch_size),
                   "--max-length", str(training.max_length or 128), "--weight-decay", str(training.weight_decay),
                   "--warmup-ratio", str(training.warmup_ratio)]
        if training.head_learning_rate:
            command += ["--head-learning-rate", str(training.head_learning_rate)]
        done = subprocess.run(command, env={**os.environ, "PYTHONPATH": str(copy / "src")}, check=True,
                              capture_output=True, text=True)
        scores[cell.key] = json.loads(done.stdout.strip().splitlines()[-1])["score"]
    return {"wall_s": round(time.monotonic() - started, 1), "scores": scores}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", help="a profile of profiles/ (default: the default studies)")
    parser.add_argument("--studies", help="comma-separated studies to build (default: all)")
    parser.add_argument("--common-study", default="ablation", help="the study of the end-to-end comparison")
    parser.add_argument("--no-common", action="store_true", help="skip the end-to-end comparison")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--keep", type=Path, help="build in this (new) folder and keep it: the clones, their reports "
                                                   "and dvc.lock (default: a temporary folder)")
    args = parser.parse_args(argv)
    overrides = load_profile(args.profile, ROOT) if args.profile else {}
    targets = [f"aggregate@{s}" for s in args.studies.split(",")] if args.studies else []
    with contextlib.ExitStack() as stack:
        if args.keep:
            args.keep.mkdir(parents=True)  # a new folder: never build over an earlier one
        work = args.keep or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="layertune-pipeline-")))
        report = pipeline_report(clone(work, "pipeline", overrides), targets)
        print(json.dumps(report["study"], indent=2))
        if not args.no_common:
            report["end_to_end"] = end_to_end(work, overrides, args.common_study)
            print(json.dumps({k: v for k, v in report["end_to_end"].items() if "scores" not in k}, indent=2))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return report


def end_to_end(work: Path, overrides: dict, study: str) -> dict:
    """``study`` alone, with BERT's pooler head (what AutoModelForSequenceClassification has), built by `dvc repro`
    from scratch and by one `common_cell.py` process per cell."""
    pooler = {**overrides, f"studies.{study}.encoder.pooling": "pooler"}
    copy = clone(work, "end-to-end", pooler)
    wall, _ = repro(copy, [f"aggregate@{study}"])
    ours = json.loads((copy / "reports" / study / "details.json").read_text())  # the metric's name
    scores = {}
    for cell in plan_studies(yaml.safe_load((copy / "params.yaml").read_text())).studies[study].cells:
        scores[cell.key] = json.loads((copy / "data" / "04_models" / cell.path / "metrics.json").read_text())[
            f"eval_{ours[cell.task][cell.encoder]['metric']}"]
    common = common_way(copy, study)
    shutil.rmtree(copy / "common", ignore_errors=True)
    return {"study": study, "common_wall_s": common["wall_s"], "layertune_wall_s": round(wall, 1),
            "speedup": round(common["wall_s"] / wall, 2), "common_scores": common["scores"],
            "layertune_scores": {k: round(v, 6) for k, v in scores.items()}}


if __name__ == "__main__":
    main()
