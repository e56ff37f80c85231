"""``layertune repro``: build the studies as `dvc repro` does, with several cells at a time.

    layertune repro [STUDY ...]                   # one cell at a time: the same as `dvc repro`
    layertune repro --jobs 4                      # four cells at a time on this machine (one GPU each, if any)
    layertune repro --ray [ADDRESS]               # every cell a task on a Ray cluster ("layertune[cluster]")
    layertune repro --decide [--budget MINUTES]   # the studies with a decide section, round after round

Every way builds the stages all cells read once (plan … tokenize), then each cell that changed (`changed_cells`),
then evaluates and aggregates with a plain ``dvc repro`` of the studies' reports, every cell being up to date by
then. Each cell trains exactly as in a serial build: the reports are the same, byte for byte. Only this process
writes dvc.lock.
"""

from __future__ import annotations

import argparse
import math
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from pipelines.dvc_stages import changed_cells
from pipelines.parallel import Children, Interrupted, StageFailed, devices, run_cells
from pipelines.processes import tied

PROG = "layertune repro"


def shared_stages(studies: Sequence[str]) -> list[str]:
    """The stages whose outputs the cells of ``studies`` read."""
    return ["plan", *(f"{stage}@{study}" for study in studies for stage in ("prepare", "tokenize"))]


def repro(studies: Sequence[str], jobs: int = 1, ray: str | None = None, cpus_per_cell: int | None = None) -> int:
    """The studies' shared stages, then their changed cells (``jobs`` at a time here, or on the Ray cluster at
    ``ray``: "" for `ray.init`'s own choice), then evaluate and aggregate; 0 when all succeeded."""
    if jobs < 1:
        raise ValueError(f"--jobs must be at least 1; got {jobs}")
    cluster = None
    if ray is not None:
        from pipelines.ray_cluster import RayCluster

        inputs = {study: shared_stages([study]) for study in studies}
        cluster = RayCluster.connect(ray or None, inputs, cpus_per_cell)  # every check before any work
    children = Children()
    status = "KILLED"  # how the build ended, for the cluster's parent runs (MLflow's statuses)
    try:
        with children.stopped_on_signal():
            returncode = _build(studies, children, cluster.train if cluster else _local(jobs, children),
                                pull=cluster is not None)
        status = "FINISHED" if returncode == 0 else "FAILED"
        return returncode
    except (Interrupted, KeyboardInterrupt):
        raise  # KILLED
    except Exception:
        status = "FAILED"
        raise
    finally:
        if cluster is not None:
            cluster.close(status)


def _local(jobs: int, children: Children) -> Callable[[list[str]], None]:
    def train(cells: list[str]) -> None:
        gpus = devices()
        print(f"{PROG}: {len(cells)} cell(s) to train, {jobs} at a time"
              + (f" on GPUs {', '.join(g for g in gpus if g is not None)}" if gpus != [None] else ""), flush=True)
        run_cells(cells, jobs, gpus, children)
    return train


def _build(studies: Sequence[str], children: Children, train: Callable[[list[str]], None], pull: bool) -> int:
    # tied: a build killed with SIGKILL takes its `dvc` with it, and that the stage it runs (`pipelines.processes`)
    tokenize = children.run(tied(["dvc", "repro", *(f"tokenize@{study}" for study in studies)]))
    if tokenize.returncode:
        raise subprocess.CalledProcessError(tokenize.returncode, tokenize.args)
    reports = [f"aggregate@{study}" for study in studies]
    try:
        train(changed_cells(reports))
    except StageFailed as error:
        print(f"{PROG}: {error}", file=sys.stderr)
        return 1
    # --pull: cells trained elsewhere are restored from the remote's run-cache (DVC says "is cached - skipping run")
    return children.run(tied(["dvc", "repro", *(["--pull"] if pull else []), *reports])).returncode


def study_names(chosen: Sequence[str], decided: bool = False) -> list[str]:
    """``chosen``, or every study of params.yaml (``decided``: every one with a decide section); an unknown name is
    an error naming the studies there are."""
    import yaml

    found = (yaml.safe_load(Path("params.yaml").read_text()) or {}).get("studies") or {}
    studies = list(found)
    unknown = [name for name in chosen if name not in studies]
    if unknown:
        raise ValueError(f"no study {', '.join(map(repr, unknown))} in params.yaml; its studies: {', '.join(studies)}")
    if decided and not chosen:
        studies = [name for name in studies if isinstance(found[name], dict) and found[name].get("decide") is not None]
        if not studies:
            raise ValueError("--decide: no study of params.yaml has a decide section; add one, e.g. decide: "
                             "{looks: 4, seeds_per_round: 2} (docs/pipeline.md, \"Deciding in rounds\")")
    return list(chosen) or studies


def configure(parser: argparse.ArgumentParser) -> Callable[[argparse.Namespace], int]:
    """The options of ``layertune repro`` (an entry point of group ``layertune.commands``), and its function."""
    parser.description, parser.formatter_class = __doc__, argparse.RawDescriptionHelpFormatter
    parser.add_argument("studies", nargs="*", metavar="STUDY", help="studies to build (default: every study of "
                        "params.yaml)")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("-j", "--jobs", type=int, default=1, help="cells trained at a time on this machine")
    where.add_argument("--ray", nargs="?", const="", metavar="ADDRESS",
                       help="train the cells on a Ray cluster: its address (host:port, ray://…), else $RAY_ADDRESS, "
                            "a cluster started on this machine (ray start --head), or a new local instance")
    parser.add_argument("--cpus-per-cell", type=int, help="with --ray: CPUs a cell takes (default: 1 on a cluster "
                        "with GPUs, where a cell takes a GPU; else every CPU of the smallest node)")
    parser.add_argument("--decide", action="store_true", help="build the studies (default: those with a decide "
                        "section) round after round until each question is answered or its rounds are spent "
                        "(pipelines/decide.py)")
    parser.add_argument("--budget", type=float, metavar="MINUTES", help="with --decide: start no round that would "
                        "end past this many minutes (default: the studies' decide.budget_minutes)")
    return run


def run(args: argparse.Namespace) -> int:
    if not Path("dvc.yaml").is_file():
        print(f"{PROG}: run it in the project folder (where dvc.yaml is)", file=sys.stderr)
        return 2
    if args.cpus_per_cell is not None and args.ray is None:
        print(f"{PROG}: --cpus-per-cell is an option of --ray", file=sys.stderr)
        return 2
    if args.budget is not None and not args.decide:
        print(f"{PROG}: --budget is an option of --decide", file=sys.stderr)
        return 2
    if args.budget is not None and not 0 < args.budget < math.inf:
        print(f"{PROG}: --budget is minutes, a positive number; got {args.budget:g}", file=sys.stderr)
        return 2
    try:
        studies = study_names(args.studies, decided=args.decide)
        if args.decide:
            from pipelines.decide import decide

            return decide(studies, args.budget, lambda: repro(studies, args.jobs, args.ray, args.cpus_per_cell),
                          jobs=args.jobs)
        return repro(studies, args.jobs, args.ray, args.cpus_per_cell)
    except (ValueError, subprocess.CalledProcessError) as error:
        print(f"{PROG}: {error}", file=sys.stderr)
        return 2
    except Interrupted as error:
        print(f"{PROG}: {error}; the cells it was training were stopped", file=sys.stderr)
        return 128 + error.signum
    except KeyboardInterrupt:  # between builds (a round half recorded gets its dvc.yaml stages at the next call)
        print(f"{PROG}: stopped by SIGINT", file=sys.stderr)
        return 130


def main(argv: list[str] | None = None) -> int:
    """``python -m pipelines.repro``: the same as ``layertune repro``."""
    parser = argparse.ArgumentParser(prog=PROG)
    return configure(parser)(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
