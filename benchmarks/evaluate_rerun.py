"""What a decided study's evaluate stage costs when it reruns (at every round of `layertune repro --decide`): the
stage forced (`dvc repro --force --single-item evaluate@<study>`) in a built project, side by side in one run, with
the cache of the cells' predictions on the evaluation examples empty (every cell scored on them, as each round did
before the cache) and full (the cells of earlier rounds read back, as a round now does).

    python benchmarks/evaluate_rerun.py --project /path/to/built/project ablation methods --json out.json

The project's cache entries are moved aside for the empty run and put back afterwards; its outputs and dvc.lock
come out as they were (the stage writes the same files).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "src"), str(ROOT / "benchmarks")]

from layertune.io import write_json  # noqa: E402
from pipelines.evaluate.nodes import EVALUATION_CACHE  # noqa: E402
from machine_speed import reference  # noqa: E402  (benchmarks/: the machine's reference figure)


def forced_evaluate(project: Path, study: str) -> float:
    started = time.monotonic()
    done = subprocess.run(["dvc", "repro", "--force", "--single-item", f"evaluate@{study}"], cwd=project,
                          capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"evaluate@{study} failed in {project}:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    return round(time.monotonic() - started, 1)


def feature_cache(project: Path) -> Path:
    """Where the project's catalog keeps the feature cache, which holds the evaluation cache."""
    catalog = yaml.safe_load((project / "conf" / "base" / "catalog.yml").read_text())
    return Path(catalog["feature_cache"]["path"])


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("studies", nargs="+", help="decided studies whose rounds added evaluation examples")
    parser.add_argument("--project", type=Path, default=Path.cwd(), help="a built project (default: here)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    entries = args.project / feature_cache(args.project) / EVALUATION_CACHE
    aside = entries.with_name(f".{EVALUATION_CACHE}-aside-{os.getpid()}")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=args.project, capture_output=True,
                            text=True).stdout.strip()
    report: dict = {"commit": commit or None, "machine": reference(),
                    "date": time.strftime("%Y-%m-%d"), "stage_wall_s": {}}
    for study in args.studies:
        forced_evaluate(args.project, study)  # the cache holds every cell of the study from here on
        if entries.exists():
            entries.rename(aside)
        try:
            empty = forced_evaluate(args.project, study)
        finally:
            if aside.exists():
                shutil.rmtree(entries, ignore_errors=True)  # what the empty run wrote: the same entries again
                aside.rename(entries)
        report["stage_wall_s"][study] = {"cache_empty": empty, "cache_full": forced_evaluate(args.project, study)}
        print(json.dumps({study: report["stage_wall_s"][study]}), flush=True)
    if args.json:
        write_json(args.json, report)
    return report


if __name__ == "__main__":
    main()
