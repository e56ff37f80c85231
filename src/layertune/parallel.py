"""Build the studies with several cells at a time on one machine, on DVC's own mechanisms.

`dvc repro` runs one stage at a time. DVC does allow several `dvc repro` processes on disjoint stages of one
workspace: each holds the repository lock only while it reads and records state (not while its command runs), and
locks the paths it reads and writes. So `repro` builds the stages every cell of a study reads once (plan … tokenize),
then runs each cell that changed as its own ``dvc --wait-for-lock repro --single-item <cell>``, ``jobs`` at a time
(each waits for the repository lock instead of failing on it), and finishes with a plain `dvc repro` of the
studies (evaluate, aggregate; every cell is up to date by then). On a machine with GPUs each worker sees one GPU
(``CUDA_VISIBLE_DEVICES``), in turn. Each cell trains exactly as in a serial build, so the results are the same,
byte for byte.
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

class StageFailed(RuntimeError):
    """A cell's `dvc repro` failed; its output is in the message."""


def devices() -> list[str | None]:
    """The GPUs workers take turns on: ``$CUDA_VISIBLE_DEVICES``, else those `nvidia-smi` lists; [None] on CPU."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [d for d in visible.split(",") if d.strip()] or [None]
    if shutil.which("nvidia-smi"):
        listed = subprocess.run(["nvidia-smi", "--list-gpus"], capture_output=True, text=True, check=False).stdout
        found = [str(i) for i, line in enumerate(listed.splitlines()) if line.startswith("GPU ")]
        if found:
            return found
    return [None]


def changed_cells(targets: Sequence[str]) -> list[str]:
    """The train stages `dvc status` reports changed upstream of ``targets``."""
    status = subprocess.run(["dvc", "status", "--json", "--with-deps", *targets], capture_output=True, text=True, check=True)
    return sorted(name for name in json.loads(status.stdout or "{}") if name.split("@")[0].startswith("train-"))


def run_cells(cells: Sequence[str], jobs: int, gpus: Sequence[str | None]) -> None:
    """``dvc --wait-for-lock repro --single-item <cell>`` for each cell, ``jobs`` at a time; the first failure
    stops new cells from starting and is raised once the running ones end."""
    free: queue.Queue = queue.Queue()
    for slot in range(jobs):
        free.put(gpus[slot % len(gpus)])

    stop = threading.Event()  # set by the first failure: cells that have not started yet do not start

    def run(cell: str) -> float | None:
        if stop.is_set():
            return None
        gpu = free.get()
        env = dict(os.environ) if gpu is None else {**os.environ, "CUDA_VISIBLE_DEVICES": gpu}
        started = time.monotonic()
        try:
            completed = subprocess.run(["dvc", "--wait-for-lock", "repro", "--single-item", cell], env=env, text=True,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, check=False)
        finally:
            free.put(gpu)
        if completed.returncode:
            stop.set()
            raise StageFailed(f"{cell} failed:\n{completed.stdout[-4000:]}")
        return time.monotonic() - started

    with ThreadPoolExecutor(jobs) as pool:
        futures = {pool.submit(run, cell): cell for cell in cells}
        finished = 0
        for future in as_completed(futures):  # each cell reported as it ends
            if future.exception() is not None:
                raise future.exception()  # once the running cells end (leaving the pool waits for them)
            if future.result() is not None:  # None: not started, after a failure
                finished += 1
                print(f"layertune repro: [{finished}/{len(cells)}] {futures[future]} done in {future.result():.1f} s",
                      flush=True)


def repro(jobs: int, studies: Sequence[str]) -> int:
    """The studies' shared stages, then their changed cells ``jobs`` at a time, then evaluate and aggregate; 0 when
    all succeeded."""
    if jobs < 1:
        raise ValueError(f"--jobs must be at least 1; got {jobs}")
    subprocess.run(["dvc", "repro", *(f"tokenize@{study}" for study in studies)], check=True)
    reports = [f"aggregate@{study}" for study in studies]
    cells = changed_cells(reports)
    gpus = devices()
    print(f"layertune repro: {len(cells)} cell(s) to train, {jobs} at a time"
          + (f" on GPUs {', '.join(g for g in gpus if g is not None)}" if gpus != [None] else ""), flush=True)
    try:
        run_cells(cells, jobs, gpus)
    except StageFailed as error:
        print(f"layertune repro: {error}", file=sys.stderr)
        return 1
    return subprocess.run(["dvc", "repro", *reports], check=False).returncode


def study_names(chosen: Sequence[str]) -> list[str]:
    """``chosen``, or every study of params.yaml; an unknown name is an error naming the studies there are."""
    import yaml

    studies = list((yaml.safe_load(Path("params.yaml").read_text()) or {}).get("studies") or {})
    unknown = [name for name in chosen if name not in studies]
    if unknown:
        raise ValueError(f"no study {', '.join(map(repr, unknown))} in params.yaml; its studies: {', '.join(studies)}")
    return list(chosen) or studies


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="layertune repro", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("studies", nargs="*", help="studies to build (default: every study of params.yaml)")
    parser.add_argument("-j", "--jobs", type=int, default=1, help="cells trained at a time")
    args = parser.parse_args(argv)
    if not Path("dvc.yaml").is_file():
        print("layertune repro: run it in the project folder (where dvc.yaml is)", file=sys.stderr)
        return 2
    try:
        return repro(args.jobs, study_names(args.studies))
    except (ValueError, subprocess.CalledProcessError) as error:
        print(f"layertune repro: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
