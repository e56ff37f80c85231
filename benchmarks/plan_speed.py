"""What the plan stage costs (it runs at every `dvc repro`, a build with nothing to do included): the default
project's plan, with its tuning-method checks built (an empty check cache: the first plan on a machine) and
remembered (`$LAYERTUNE_CACHE/checks`: every plan after it), side by side, alternating, in a clone of this checkout.
Also how many times one `layertune repro` runs it: once (it ran once per study more, and again at the end, before
each study's stages were run with `dvc repro --single-item`).

    python benchmarks/plan_speed.py --json reports/benchmarks/plan.json

Needs the data and model mirrors ($LAYERTUNE_DATA_MIRROR, $LAYERTUNE_MODEL_MIRROR), as `make benchmark` sets them.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "src"), str(Path(__file__).resolve().parent)]


def timed_plan(project: Path, cache: Path) -> float:
    """Seconds of `kedro run --pipelines plan` (the plan stage's command) in ``project`` with ``cache``."""
    env = {**os.environ, "LAYERTUNE_CACHE": str(cache), "KEDRO_DISABLE_TELEMETRY": "1", "DO_NOT_TRACK": "1",
           "TQDM_DISABLE": "1", "PYTHONPATH": str(project / "src")}
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "kedro", "run", "--pipelines", "plan"], cwd=project, env=env,
                          capture_output=True, text=True)
    seconds = time.perf_counter() - started
    if done.returncode:
        raise SystemExit(f"plan_speed: the plan failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    return seconds


def main() -> int:
    from layertune.io import write_json
    from machine_speed import describe, reference

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="plan-speed-") as folder:
        work = Path(folder)
        project = work / "project"
        subprocess.run(["git", "clone", "--quiet", str(ROOT), str(project)], check=True)
        warm = work / "warm"
        timed_plan(project, warm)  # fills the warm cache
        built, remembered = [], []
        for repeat in range(args.repeats):
            built.append(timed_plan(project, work / f"cold-{repeat}"))  # a cache folder never used
            remembered.append(timed_plan(project, warm))
    from pipelines.params import read_params

    studies = len(read_params(ROOT)["studies"])
    report = {"machine": reference(), "repeats": args.repeats,
              "plan_s": {"checks_built": round(statistics.median(built), 2),
                         "checks_remembered": round(statistics.median(remembered), 2)},
              "plan_runs_per_layertune_repro": {"before": studies + 2, "now": 1, "studies": studies}}
    report["plan_s"]["ratio"] = round(report["plan_s"]["checks_remembered"] / report["plan_s"]["checks_built"], 2)
    print(f"on {describe(report['machine'])}")
    print(f"the default project's plan stage: {report['plan_s']['checks_built']} s with its tuning-method checks "
          f"built, {report['plan_s']['checks_remembered']} s remembered (median of {args.repeats}); "
          f"`layertune repro` runs it once, not {studies + 2} times")
    if args.json:
        write_json(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
