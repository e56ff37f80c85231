"""``layertune repro``: build the studies as `dvc repro` does, with each study's cells trained where you say.

    layertune repro [STUDY ...]                   # one cell at a time: the same build as `dvc repro`
    layertune repro --jobs 4                      # four cells at a time on this machine (one GPU each, if any)
    layertune repro --ray [ADDRESS]               # every cell a task on a Ray cluster ("layertune[cluster]")
    layertune repro --decide [--budget MINUTES]   # the studies with a decide section, round after round

Every way is `dvc repro` of the studies' reports: DVC runs each stage once, and each study's train stage trains its
cells that are not built yet where this command tells it, through the environment (``LAYERTUNE_JOBS``,
``LAYERTUNE_RAY``, ``LAYERTUNE_CPUS_PER_CELL``: `pipelines.scheduling`; ``LAYERTUNE_JOBS=4 dvc repro`` is the same
build). Without a study named, it builds the project study by study, the one with the fewest cells first, so each
report lands as soon as that study's cells are trained (a plain `dvc repro` writes the first report at its very
end); the stages, reports and dvc.lock are those of a plain `dvc repro`. Each cell trains exactly as in a serial
build: the reports are the same, byte for byte. One build of a project runs at a time.
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from pipelines import STAGES
from pipelines.processes import BuildRunning, Children, Interrupted, one_build, tied

PROG = "layertune repro"
STUDY_STAGES = STAGES[2:]  # each study's own: prepare to aggregate


class BuildFailed(RuntimeError):
    """`dvc repro` failed; its output (above) says why."""


def repro(studies: Sequence[str], jobs: int = 1, ray: str | None = None, cpus_per_cell: int | None = None,
          every: bool = False) -> None:
    """`dvc repro` of the reports of ``studies`` (``every``: of the whole project, study by study), their cells
    trained ``jobs`` at a time here, or on the Ray cluster at ``ray`` ("": `ray.init`'s own choice). `BuildFailed`
    if it fails; `Interrupted` once a signal stopped it (and every process it started)."""
    from pipelines.ray_cluster import CPUS_ENV, RAY_ENV, check_reachable
    from pipelines.scheduling import JOBS_ENV

    if jobs < 1:
        raise ValueError(f"--jobs must be at least 1; got {jobs}")
    if cpus_per_cell is not None and cpus_per_cell < 1:
        raise ValueError(f"--cpus-per-cell must be at least 1; got {cpus_per_cell}")
    env = {**os.environ, JOBS_ENV: str(jobs)}
    if ray is not None:
        check_reachable(ray or None)  # within seconds, before any work: Ray's own connect retries for minutes
        env[RAY_ENV] = ray
        if cpus_per_cell is not None:
            env[CPUS_ENV] = str(cpus_per_cell)
    children = Children()

    def dvc(*arguments: str, **popen):
        """`dvc` with ``arguments``, done (None: stopping, nothing more starts); `BuildFailed` if it failed."""
        command = ["dvc", *arguments]
        # tied: a build killed with SIGKILL takes its `dvc` with it, and `dvc` its stage (`pipelines.processes`)
        done = children.run(tied(command), env=env, **popen)
        if done is not None and done.returncode:
            raise BuildFailed(f"{' '.join(command)} failed (exit status {done.returncode}); its output above says "
                              "why")
        return done

    with children.stopped_on_signal():
        if not every:
            dvc("repro", *(f"aggregate@{study}" for study in studies))
            return
        # The stages of one `dvc repro`, study by study (see the module's docstring). --single-item: a study's own
        # stages without the plan again (it runs whenever DVC follows the dependencies: seconds each time, for
        # nothing, as it ran just before). Last, whatever else dvc.yaml holds.
        dvc("repro", "plan", "download")
        built = ["plan", "download"]
        for study in smallest_first(studies):
            stages = [f"{stage}@{study}" for stage in STUDY_STAGES]
            dvc("repro", "--single-item", *stages)
            built += stages
        # dvc.yaml's stages, its `foreach` expanded (train@ablation)
        listed = dvc("stage", "list", "--name-only", stdout=subprocess.PIPE, text=True)
        if others := [stage for stage in (listed.stdout.split() if listed else []) if stage not in built]:
            dvc("repro", *others)


def smallest_first(studies: Sequence[str]) -> list[str]:
    """``studies`` by the number of cells their last plan holds, fewest first (ties: in the given order)."""
    from pipelines.catalog import catalog_path
    from pipelines.plans import TrainPlan

    def cells(study: str) -> int:
        return len(TrainPlan.model_validate_json(catalog_path("train_plan", study).read_text()).cells)

    return sorted(studies, key=cells)


def study_names(chosen: Sequence[str], decided: bool = False) -> list[str]:
    """``chosen``, or every study of params.yaml (``decided``: every one with a decide section); `ValueError` for an
    unknown name or, with ``decided``, a study without a decide section. params.yaml is checked first as far as DVC
    reads it: DVC's own errors would not name the key, and a file of nested aliases would hang it."""
    from pipelines.params import check_names, read_params

    params = read_params()
    check_names(params)
    found = params.get("studies") or {}
    studies = list(found)
    unknown = [name for name in chosen if name not in studies]
    if unknown:
        raise ValueError(f"no study {', '.join(map(repr, unknown))} in params.yaml; its studies: {', '.join(studies)}")
    if decided and not chosen:
        studies = [name for name in studies if isinstance(found[name], dict) and found[name].get("decide") is not None]
        if not studies:
            raise ValueError("--decide: no study of params.yaml has a decide section; add one, e.g. decide: "
                             "{looks: 4, seeds_per_round: 2} (docs/pipeline.md, \"Deciding in rounds\")")
    studies = list(chosen) or studies
    if decided and (missing := [name for name in studies if not isinstance(found[name].get("decide"), dict)]):
        raise ValueError(f"--decide: {', '.join(f'studies.{name}' for name in missing)} has no decide section; add "
                         "one to decide in rounds, e.g. decide: {looks: 4, seeds_per_round: 2} (see "
                         "docs/pipeline.md, \"Deciding in rounds\")")
    return studies


def configure(parser: argparse.ArgumentParser) -> Callable[[argparse.Namespace], int]:
    """The options of ``layertune repro`` (an entry point of group ``layertune.commands``), and its function."""
    parser.description, parser.formatter_class = __doc__, argparse.RawDescriptionHelpFormatter
    parser.add_argument("studies", nargs="*", metavar="STUDY", help="studies to build (default: every study of "
                        "params.yaml)")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("-j", "--jobs", type=int, help="cells trained at a time on this machine (default: "
                       "$LAYERTUNE_JOBS, else 1)")
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
    from pipelines.scheduling import JOBS_ENV, number_from_environment

    try:
        if not Path("dvc.yaml").is_file():
            raise ValueError("run it in the project folder (where dvc.yaml is)")
        if args.cpus_per_cell is not None and args.ray is None:
            raise ValueError("--cpus-per-cell is an option of --ray")
        if args.budget is not None and not args.decide:
            raise ValueError("--budget is an option of --decide")
        if args.budget is not None and not 0 < args.budget < math.inf:
            raise ValueError(f"--budget is minutes, a positive number; got {args.budget:g}")
        # $LAYERTUNE_JOBS: what `LAYERTUNE_JOBS=4 dvc repro` reads too
        jobs = args.jobs if args.jobs is not None else number_from_environment(JOBS_ENV, 1)
        studies = study_names(args.studies, decided=args.decide)
        with one_build(Path.cwd()):
            if args.decide:
                from pipelines.decide import decide

                return decide(studies, args.budget, lambda: repro(studies, jobs, args.ray, args.cpus_per_cell),
                              jobs=jobs)
            repro(studies, jobs, args.ray, args.cpus_per_cell, every=not args.studies)
            return 0
    except (ValueError, BuildRunning, BuildFailed) as error:
        print(f"{PROG}: {error}", file=sys.stderr)
        return 2 if isinstance(error, ValueError) else 1
    except Interrupted as error:
        print(f"{PROG}: {error}; the cells it was training were stopped", file=sys.stderr)
        return 128 + error.signum
    except KeyboardInterrupt:  # between builds (a round half recorded is trained at the next call)
        print(f"{PROG}: stopped by SIGINT", file=sys.stderr)
        return 130


def main(argv: list[str] | None = None) -> int:
    """``python -m pipelines.repro``: the same as ``layertune repro``."""
    parser = argparse.ArgumentParser(prog=PROG)
    return configure(parser)(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
