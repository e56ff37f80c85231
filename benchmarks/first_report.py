"""What a newcomer waits for: `make study`'s build (`layertune repro`, study by study, the fewest cells first) from a
fresh clone, and when each study's report lands; then whether the build is the committed one (every timing-free
report byte for byte, dvc.lock's stages and parameters).

    python benchmarks/first_report.py --json reports/benchmarks/first_report.json     # about 30 min on 2 cores

The clone has no DVC cache and no MLflow database: every cell trains, as on a new machine (set-up aside: it uses this
environment's packages). A report has landed once its `reports/<study>.md` exists.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "src"), str(ROOT / "benchmarks")]

from machine_speed import describe, reference  # noqa: E402  (benchmarks/: the machine's reference figure)

TIMING_FREE = ("*.json", "*/details.json", "*.scores.csv", "*.losses.csv")  # as .ci/repro-check.sh compares


def watch(reports: Path, started: float, landed: dict[str, float], stop: threading.Event) -> None:
    """``landed[study]``: seconds from ``started`` until ``reports/<study>.md`` appeared."""
    while not stop.is_set():
        for report in reports.glob("*.md") if reports.is_dir() else ():
            landed.setdefault(report.stem, round(time.monotonic() - started, 1))
        stop.wait(1.0)


def same_build(clone: Path) -> dict:
    """The clone's timing-free reports against the committed ones, and its dvc.lock's stages and parameters."""
    import yaml

    differ = sorted(str(path.relative_to(clone / "reports")) for pattern in TIMING_FREE
                    for path in (clone / "reports").glob(pattern)
                    if path.read_bytes() != (ROOT / "reports" / path.relative_to(clone / "reports")).read_bytes())
    locks = [yaml.safe_load((where / "dvc.lock").read_text())["stages"] for where in (clone, ROOT)]
    stages = [{name: (stage["cmd"], stage.get("params")) for name, stage in lock.items()} for lock in locks]
    return {"reports_differ": differ, "lock_stages_equal": list(locks[0]) == list(locks[1]),
            "lock_params_equal": stages[0] == stages[1]}


def main() -> int:
    from layertune.io import write_json

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--keep", action="store_true", help="keep the clone (printed)")
    args = parser.parse_args()
    machine = reference()
    clone = Path(tempfile.mkdtemp(prefix="first-report-")) / "layertune"
    subprocess.run(["git", "clone", "--quiet", str(ROOT), str(clone)], check=True)
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{clone / 'mlflow.db'}", "PYTHONPATH": str(clone / "src")}
    landed: dict[str, float] = {}
    stop = threading.Event()
    started = time.monotonic()
    watcher = threading.Thread(target=watch, args=(clone / "reports", started, landed, stop), daemon=True)
    # The clone holds the committed reports: moved aside, so that each one lands anew.
    subprocess.run(["git", "rm", "-r", "--quiet", "--cached", "reports"], cwd=clone, check=True)
    (clone / "reports").rename(clone.parent / "committed-reports")
    watcher.start()
    log = clone.parent / "build.log"
    with log.open("w") as out:
        done = subprocess.run(["layertune", "repro"], cwd=clone, env=env, stdout=out, stderr=subprocess.STDOUT)
    total = round(time.monotonic() - started, 1)
    stop.set()
    watcher.join()
    if done.returncode:
        print(log.read_text()[-4000:], file=sys.stderr)
        print(f"the clone, kept to look into: {clone}", file=sys.stderr)
        return 1
    first = min(landed, key=landed.get)
    report = {"machine": machine, "total_s": total, "landed_s": dict(sorted(landed.items(), key=lambda kv: kv[1])),
              "first": {"study": first, "s": landed[first], "share": round(landed[first] / total, 3)},
              **same_build(clone)}
    print(f"on {describe(machine)}: the build took {total / 60:.1f} min; the first report ({first}) landed after "
          f"{landed[first] / 60:.1f} min ({report['first']['share']:.0%} of it): "
          + ", ".join(f"{study} {s / 60:.1f}" for study, s in report["landed_s"].items()))
    print(json.dumps({key: report[key] for key in ("reports_differ", "lock_stages_equal", "lock_params_equal")}))
    if args.json:
        write_json(args.json, report)
    if args.keep:
        print(f"clone: {clone}")
    else:
        shutil.rmtree(clone.parent)  # the folder this script made; nothing else in it
    return 0


if __name__ == "__main__":
    sys.exit(main())
