"""A study built the three ways `layertune repro` offers, side by side, each from a fresh clone of HEAD: serially
(`dvc repro`), `layertune repro --jobs N` (this machine's own pool), and `layertune repro --ray` on a Ray cluster
simulated on this machine (`ray.cluster_utils.Cluster`: a head that trains nothing and ``--nodes`` worker nodes).
Then what Ray itself costs before any cell: `ray.init()`'s time and the memory of the processes it starts.

    python benchmarks/cluster_speed.py --json reports/benchmarks/cluster.json        # ci profile, ablation + methods
    python benchmarks/cluster_speed.py --repeats 1 --studies ablation                 # quick (~3 min)

The ways alternate within each repeat (serial, jobs, ray, serial, ...), so CPU steal on a shared machine hits them
alike. Every build must give the serial build's reports byte for byte, or the script fails. Needs Ray
(`pip install "layertune[cluster]"`), the data mirror (`$LAYERTUNE_DATA_MIRROR`) and the model mirror
(`$LAYERTUNE_MODEL_MIRROR`) or the hub.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import statistics
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

WAYS = ("serial", "jobs", "ray")


def origin(work: Path, profile: str, studies: list[str]) -> Path:
    """A clone of HEAD with ``profile`` applied, only ``studies`` and the mirrors as absolute paths, committed: what a
    team's repository is."""
    copy = work / "origin"
    subprocess.run(["git", "clone", "--quiet", str(ROOT), str(copy)], check=True)
    params = apply_overrides(read_params(copy), load_profile(profile, ROOT))
    params["studies"] = {name: params["studies"][name] for name in studies}
    for key, variable in (("mirror", "LAYERTUNE_DATA_MIRROR"), ("model_mirror", "LAYERTUNE_MODEL_MIRROR")):
        if os.environ.get(variable):
            params["download"][key] = str(Path(os.environ[variable]).resolve())
    write_params(copy, params)
    run(copy, "git", "-c", "user.name=benchmark", "-c", "user.email=benchmark@example.com", "commit", "--quiet",
        "-am", f"benchmark: {profile} profile, studies {', '.join(studies)}")
    return copy


def run(folder: Path, *command: str, env: dict | None = None) -> str:
    done = subprocess.run(command, cwd=folder, env={**os.environ, **(env or {})}, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{' '.join(command)} failed in {folder}:\n{(done.stdout + done.stderr)[-4000:]}")
    return done.stdout + done.stderr


def build(work: Path, repository: Path, way: str, name: str, jobs: int, address: str | None) -> dict:
    """One build of the studies from a fresh clone (empty DVC cache, no MLflow database): its wall time, split into
    the shared stages (plan ... tokenize), the cells (from the first train stage's start to the last cell's end)
    and the rest (the reports), read from the build's output as it comes; each cell's own time; its reports'
    bytes."""
    copy = work / name
    run(work, "git", "clone", "--quiet", str(repository), str(copy))
    command = {"serial": ["dvc", "repro"], "jobs": ["layertune", "repro", "--jobs", str(jobs)],
               "ray": ["layertune", "repro", "--ray", str(address)]}[way]
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{copy / 'mlflow.db'}", "TQDM_DISABLE": "1",
           "RAY_USAGE_STATS_ENABLED": "0"}
    started = time.monotonic()
    process = subprocess.Popen(command, cwd=copy, env=env, text=True, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT)
    lines = [(time.monotonic() - started, line) for line in process.stdout]
    if process.wait():
        raise SystemExit(f"{' '.join(command)} failed in {copy}:\n{''.join(line for _, line in lines[-60:])}")
    wall = time.monotonic() - started
    cells_from, cells_to, trained, cell_s = phases(lines)
    reports = {str(path.relative_to(copy)): path.read_bytes() for path in sorted((copy / "reports").rglob("*.json"))}
    result = {"way": way, "wall_s": round(wall, 1), "shared_s": round(cells_from, 1),
              "cells_s": round(cells_to - cells_from, 1), "reports_s": round(wall - cells_to, 1),
              "cells_trained": trained, "cell_s_median": round(statistics.median(cell_s), 1) if cell_s else None}
    print(f"{way:>6}: {json.dumps(result)}", flush=True)
    return {**result, "reports": reports}


# The train stage's line for a cell that ended, whichever way it trained: "[3/8] sst2-m-0-1 trained in 4.2 s; about
# 21 s left for ablation"
CELL_DONE = re.compile(r"\[\d+/\d+\] (\S+) trained(?: in ([\d.]+) s)?(?:;.*)?$")
RUNNING = re.compile(r"^Running stage '([^']+)'")  # DVC's line for a stage it starts


def phases(lines: list[tuple[float, str]]) -> tuple[float, float, int, list[float]]:
    """When the cells began (the first train stage's start) and ended (the last cell's line), in seconds from the
    build's start; how many trained; each cell's seconds as its line gives them (a Ray cell's line gives none)."""
    began = next(at for at, line in lines if (found := RUNNING.match(line)) and found.group(1).startswith("train"))
    done = [(at, found.group(2)) for at, line in lines if (found := CELL_DONE.search(line.rstrip()))]
    return began, done[-1][0], len(done), [float(seconds) for _, seconds in done if seconds is not None]


@contextlib.contextmanager
def simulated_cluster(nodes: int, cpus: int):
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    for _ in range(nodes):
        cluster.add_node(num_cpus=cpus)
    cluster.wait_for_nodes()
    try:
        yield cluster
    finally:
        cluster.shutdown()


# Run in a process of its own: `ray.init()` on one machine, as `--ray` without an address does; then the resident
# memory of that process and of every process it started (GCS, raylet, workers, the log monitor...).
RAY_COST = """
import json, os, time
started = time.monotonic()
import ray
imported = time.monotonic()
ray.init(num_cpus=2, include_dashboard=False)
initialised = time.monotonic()
time.sleep(2)  # its idle workers have started
def children():
    parents = {}
    for stat in os.listdir("/proc"):
        if stat.isdigit():
            try:
                fields = open(f"/proc/{stat}/stat").read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            parents.setdefault(int(fields[1]), []).append(int(stat))
    found, todo = [], [os.getpid()]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo += parents.get(pid, [])
    return found
def rss_mib(pid):
    try:
        for line in open(f"/proc/{pid}/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0
processes = children()
print(json.dumps({"import_s": round(imported - started, 2), "init_s": round(initialised - imported, 2),
                  "processes": len(processes), "rss_mib": round(sum(rss_mib(pid) for pid in processes))}))
ray.shutdown()
"""


def ray_cost() -> dict:
    done = subprocess.run([sys.executable, "-c", RAY_COST], capture_output=True, text=True, check=True,
                          env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"})
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", default="ci", help="a profile of profiles/ (default: ci)")
    parser.add_argument("--studies", default="ablation,methods", help="comma-separated studies (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=3, help="builds of each way (default: %(default)s)")
    parser.add_argument("--jobs", type=int, default=2, help="`--jobs` of the pool's builds (default: %(default)s)")
    parser.add_argument("--nodes", type=int, default=2, help="worker nodes of the simulated cluster")
    parser.add_argument("--cpus-per-node", type=int, default=1, help="CPUs each worker node declares")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    studies = args.studies.split(",")
    builds: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="layertune-cluster-") as folder:
        work = Path(folder)
        repository = origin(work, args.profile, studies)
        with simulated_cluster(args.nodes, args.cpus_per_node) as cluster:
            for repeat in range(args.repeats):
                for way in WAYS:
                    builds.append(build(work, repository, way, f"{way}-{repeat}", args.jobs, cluster.address))
    serial_reports = builds[0]["reports"]
    different = [b["way"] for b in builds if b["reports"] != serial_reports]
    if different or not serial_reports:
        raise SystemExit(f"reports differ from the first serial build's: {different}")
    median = {way: {key: statistics.median(b[key] for b in builds if b["way"] == way)
                    for key in ("wall_s", "shared_s", "cells_s", "reports_s", "cell_s_median")} for way in WAYS}
    report = {
        "profile": args.profile, "studies": studies, "cells": builds[0]["cells_trained"],
        "jobs": args.jobs, "nodes": args.nodes, "cpus_per_node": args.cpus_per_node, "machine": reference(),
        "builds": [{k: v for k, v in b.items() if k != "reports"} for b in builds], "median": median,
        "wall_vs_serial": {way: round(median[way]["wall_s"] / median["serial"]["wall_s"], 2) for way in WAYS},
        "reports_identical": True, "ray_init": ray_cost()}
    print(json.dumps({k: v for k, v in report.items() if k != "builds"}, indent=2))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
