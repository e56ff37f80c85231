"""Where a study build's wall time goes, built from scratch the way a user builds it (`dvc repro` in a fresh clone):
its compute (training, a cache pass, tokenizing, scoring: what the library measures, `layertune.timing`) against
the rest, the bookkeeping (DVC, Kedro, process starts, MLflow, writing folders, reports), per cell. Side by side in
one run: the default studies, and synthetic studies of N head-only cells (paraphrase-MiniLM-L3-v2 on SST-2, 64
training and 64 dev examples, one epoch, N seeds), at this commit and, with ``--before REV``, at another.

    python benchmarks/pipeline_speed.py --json reports/benchmarks/pipeline.json      # the default studies; 10, 60,
                                                                                     # 100 and 1,000 cells
    python benchmarks/pipeline_speed.py --no-default --cells 10,60,100 --before 32137cd --json out.json
    python benchmarks/pipeline_speed.py --no-default --cells 10 --keep /tmp/build    # quick; keep the clones

Per build: its wall time, its compute by kind, bookkeeping = wall − compute, and that per cell; the train stages'
own wall and compute; a no-op `dvc repro` after it; the MB of its data and DVC cache. Across the synthetic sizes: the bookkeeping each cell adds
(the slope between two sizes), which a per-cell cost that grows with the study would show.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]  # the project, and machine_speed beside this script

from pipelines.params import read_params, write_params  # noqa: E402
from pipelines.profiles import apply_overrides, load_profile  # noqa: E402
from machine_speed import reference  # noqa: E402  (benchmarks/: the machine's reference figure)

RUNNING = re.compile(r"^Running stage '([^']+)':")
MODEL = "sentence-transformers/paraphrase-MiniLM-L3-v2"


def synthetic_study(cells: int) -> dict:
    """N head-only cells of one setting: N seeds."""
    return {"report": {"kind": "layers", "tolerance": 0.01}, "tasks": ["sst2"], "encoders": {"l3": MODEL},
            "tunable_layers": [0], "seeds": list(range(1, cells + 1)),
            "data": {"train_size": 64, "dev_size": 64, "seed": 42}, "encoder": {"pooling": "mean"},
            "training": {"learning_rate": 1.0e-4, "head_learning_rate": 3.0e-2, "batch_size": 16,
                         "eval_batch_size": 64, "epochs": 1, "eval_strategy": "end", "max_length": 64}}


def clone(work: Path, name: str, revision: str, params_of) -> Path:
    """A fresh clone of ``revision`` (empty caches, no MLflow database), its params.yaml made by ``params_of``, the
    mirrors as absolute paths; an older revision's generated train stages written, as its `make study` did."""
    copy = work / name
    subprocess.run(["git", "clone", "--quiet", str(ROOT), str(copy)], check=True)
    subprocess.run(["git", "-C", str(copy), "checkout", "--quiet", revision], check=True)
    params = params_of(read_params(copy))
    for key, variable in (("mirror", "LAYERTUNE_DATA_MIRROR"), ("model_mirror", "LAYERTUNE_MODEL_MIRROR")):
        if os.environ.get(variable):
            params["download"][key] = str(Path(os.environ[variable]).resolve())
    write_params(copy, params)
    if (copy / "pipelines" / "dvc_stages.py").is_file():  # before one train stage per study
        subprocess.run([sys.executable, "-m", "pipelines.dvc_stages"], cwd=copy, check=True, capture_output=True,
                       env={**os.environ, "PYTHONPATH": str(copy)})
    return copy


def environment(copy: Path) -> dict:
    return {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{copy / 'mlflow.db'}", "PYTHONPATH": str(copy / "src"),
            "LAYERTUNE_TIMINGS": str(copy / "timings.jsonl"), "LAYERTUNE_WARM_DIR": str(copy / ".warm"),
            "TQDM_DISABLE": "1"}


def build(copy: Path) -> dict:
    """`dvc repro` of ``copy``: wall time, compute by kind, bookkeeping, the train stages' share; a no-op rebuild."""
    started = time.monotonic()
    process = subprocess.Popen(["dvc", "repro"], cwd=copy, env=environment(copy), text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    marks, log = [], []
    for line in process.stdout:
        log.append(line)
        if found := RUNNING.match(line):
            marks.append((time.monotonic(), found.group(1)))
    if process.wait():
        sys.stderr.write("".join(log[-60:]))
        raise SystemExit(f"dvc repro failed in {copy}")
    wall = time.monotonic() - started
    ended = time.monotonic()
    stage_walls = {name: (marks[i + 1][0] if i + 1 < len(marks) else ended) - at for i, (at, name) in enumerate(marks)}
    compute, train_compute = _compute(copy)
    cells = sum(1 for _ in (copy / "data" / "04_models").glob("*/*/metrics.json"))
    train_wall = sum(seconds for name, seconds in stage_walls.items() if name.startswith("train"))
    no_op_started = time.monotonic()
    subprocess.run(["dvc", "repro"], cwd=copy, env=environment(copy), check=True, capture_output=True)
    total = sum(compute.values())
    return {"cells": cells, "stages": len(stage_walls), "wall_s": round(wall, 1),
            "compute_s": {kind: round(seconds, 1) for kind, seconds in sorted(compute.items())},
            "bookkeeping_s": round(wall - total, 1), "bookkeeping_per_cell_s": round((wall - total) / cells, 3),
            "train_stages": {"wall_s": round(train_wall, 1), "compute_s": round(sum(train_compute.values()), 1),
                             "bookkeeping_per_cell_s": round((train_wall - sum(train_compute.values())) / cells, 3)},
            "no_op_repro_s": round(time.monotonic() - no_op_started, 1), "disk_mb": disk(copy)}


def disk(copy: Path) -> dict[str, float]:
    """MB on disk of the build's data (cells, caches, plans) and of DVC's cache (what `dvc push` would send)."""
    def size(folder: Path) -> float:
        return round(sum(f.stat().st_size for f in folder.rglob("*") if f.is_file() and not f.is_symlink()) / 2**20, 1)

    return {"data": size(copy / "data"), "cells": size(copy / "data" / "04_models"),
            "dvc_cache": size(copy / ".dvc" / "cache")}


def _compute(copy: Path) -> tuple[dict[str, float], dict[str, float]]:
    """Compute by kind of every process of the build (`layertune.timing` writes a line per process at its exit),
    and of the train stages' processes (their workers included) alone."""
    every: dict[str, float] = {}
    train: dict[str, float] = {}
    path = copy / "timings.jsonl"
    for line in path.read_text().splitlines() if path.exists() else []:
        record = json.loads(line)
        argv = record["argv"]
        training = "--pipelines" in argv and argv[argv.index("--pipelines") + 1] == "train" or \
            "multiprocessing" in " ".join(argv)  # a train stage's worker process
        for kind, seconds in record["compute_s"].items():
            every[kind] = every.get(kind, 0.0) + seconds
            if training:
                train[kind] = train.get(kind, 0.0) + seconds
    return every, train


def slopes(sizes: dict[str, dict]) -> dict[str, float]:
    """Bookkeeping each cell adds between consecutive sizes, in seconds: flat when no cost grows with the study."""
    ordered = sorted(sizes.items(), key=lambda item: int(item[0]))
    return {f"{a}->{b}": round((sizes[b]["bookkeeping_s"] - sizes[a]["bookkeeping_s"]) / (int(b) - int(a)), 3)
            for (a, _), (b, _) in zip(ordered, ordered[1:])}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--no-default", action="store_true", help="skip the default studies' build")
    parser.add_argument("--profile", help="a profile of profiles/ for the default build (default: params.yaml)")
    parser.add_argument("--cells", default="10,60,100,1000", help="synthetic study sizes (comma-separated; '' for "
                                                                  "none)")
    parser.add_argument("--before", metavar="REV", help="also build the synthetic studies at this revision")
    parser.add_argument("--before-cells", help="sizes at --before (default: --cells)")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--keep", type=Path, help="build in this (new) folder and keep the clones")
    args = parser.parse_args(argv)
    sizes = [int(n) for n in args.cells.split(",") if n]
    before_sizes = [int(n) for n in (args.before_cells or args.cells).split(",") if n]
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()
    report: dict = {"commit": head, "machine": reference(), "date": time.strftime("%Y-%m-%d")}
    with contextlib.ExitStack() as stack:
        if args.keep:
            args.keep.mkdir(parents=True)  # a new folder: never build over an earlier one
        work = args.keep or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="layertune-pipeline-")))
        if not args.no_default:
            overrides = load_profile(args.profile, ROOT) if args.profile else {}
            report["default"] = build(clone(work, "default", "HEAD", lambda p: apply_overrides(p, overrides)))
            print(json.dumps({"default": report["default"]}), flush=True)
        for revision, label, chosen in (("HEAD", "after", sizes),
                                        *([(args.before, "before", before_sizes)] if args.before else [])):
            found = report.setdefault("synthetic", {}).setdefault(label, {"commit": revision})
            for cells in chosen:
                params_of = lambda p, n=cells: {**p, "studies": {"synthetic": synthetic_study(n)}}  # noqa: E731
                found[str(cells)] = build(clone(work, f"{label}-{cells}", revision, params_of))
                print(json.dumps({label: {cells: found[str(cells)]}}), flush=True)
            found["added_per_cell_s"] = slopes({k: v for k, v in found.items() if k.isdigit()})
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
