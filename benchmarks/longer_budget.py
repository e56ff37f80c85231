"""Would a longer budget change an answer? One seed of every setting, trained with every maximum number of epochs
doubled, against the same seed at the default maxima.

    python benchmarks/longer_budget.py --project /tmp/copy --json reports/benchmarks/longer_budget.json
    python benchmarks/longer_budget.py --project /tmp/copy --studies methods --json longer_budget_methods.json
    python benchmarks/swapped_claims.py --project /tmp/copy-2 --cells-from /tmp/copy --json swapped.json

``--project`` is a copy of this project with the default studies built (its data/ folder, cells included: the
"same" side then trains nothing). The script writes two profiles into that copy and builds each as a DVC
experiment (`dvc exp run`): ``seed-1`` (every study's first seed, the default maxima) and ``seed-1-longer`` (the
same seed, every ``epochs`` of the study's training and of each ``per_tunable_layers`` and ``per_task`` entry
doubled). ``--studies`` limits both to some studies: the others keep their params and recorded rounds, so DVC
has nothing of theirs to rebuild. It then sets each study's headline and its claims side by side
(`swapped_claims.claims`: each setting's *within tolerance?*, the recommendation, the verdicts). At one seed a
decided study claims little (no seed spread is measured): to ask whether its claims over all its seeds hold, put
the longer side's cells in place of that seed's in a copy of the full build (`swapped_claims.py --cells-from`).
What early stopping made of each cell (epochs trained, stopped by) is in the cells' folders.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))  # swapped_claims, beside this script, also when imported
from swapped_claims import claims, studies_of  # noqa: E402


def profiles(params: dict, studies: list[str], decided: dict) -> dict[str, dict]:
    """``seed-1`` and ``seed-1-longer`` overrides of ``params`` (`pipelines.profiles`' dotted keys) for ``studies``;
    the other studies keep their recorded rounds (``decided``, rounds.yaml's record)."""
    kept = {name: record for name, record in decided.items() if name not in studies}
    same, longer = {"decided": kept}, {"decided": kept}
    for name in studies:
        study = params["studies"][name]
        for profile in (same, longer):
            profile[f"studies.{name}.seeds"] = study["seeds"][:1]
            if "decide" in study:
                profile[f"studies.{name}.decide.evaluation_size"] = None  # one seed: no rounds to add examples to
        longer[f"studies.{name}.training.epochs"] = 2 * study["training"]["epochs"]
        if overrides := study.get("per_tunable_layers"):
            longer[f"studies.{name}.per_tunable_layers"] = _doubled(overrides)
        if overrides := study.get("per_task"):
            longer[f"studies.{name}.per_task"] = {task: _doubled(per_k) for task, per_k in overrides.items()}
    return {"seed-1": same, "seed-1-longer": longer}


def _doubled(per_k: dict) -> dict:
    """Per-K overrides with each ``epochs`` they set doubled."""
    return {k: {**entry, **({"epochs": 2 * entry["epochs"]} if "epochs" in entry else {})} for k, entry in per_k.items()}


def build(project: Path, profile: str, studies: list[str]) -> dict:
    """Build ``profile`` in ``project``; each of ``studies``' headline (reports/<study>.json) and the seconds."""
    arguments = subprocess.run([sys.executable, "-m", "pipelines.profiles", profile], cwd=project, check=True,
                               capture_output=True, text=True).stdout.split()
    started = time.perf_counter()
    subprocess.run(["dvc", "exp", "run", "--quiet", *arguments], cwd=project, check=True)
    seconds = time.perf_counter() - started
    reports = project / "reports"
    return {"seconds": round(seconds),
            "reports": {name: json.loads((reports / f"{name}.json").read_text()) for name in studies},
            "claims": {name: claims(json.loads((reports / name / "details.json").read_text())) for name in studies}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--project", type=Path, required=True)
    parser.add_argument("--json", type=Path, default=Path("reports/benchmarks/longer_budget.json"))
    parser.add_argument("--studies", nargs="+", metavar="STUDY", help="only these studies (default: all)")
    args = parser.parse_args()

    params, studies = studies_of(parser, args.project, args.studies)
    decided = (yaml.safe_load((args.project / "rounds.yaml").read_text()) or {}).get("decided") or {}
    overrides_by_profile = profiles(params, studies, decided)
    for name, overrides in overrides_by_profile.items():
        (args.project / "profiles" / f"{name}.yaml").write_text(yaml.safe_dump(overrides, sort_keys=False))
    built = {}
    for name in ("seed-1", "seed-1-longer"):
        subprocess.run(["git", "checkout", "--", "params.yaml", "rounds.yaml"], cwd=args.project, check=True)
        built[name] = build(args.project, name, studies)
        print(name, json.dumps(built[name]), flush=True)
    subprocess.run(["git", "checkout", "--", "params.yaml", "rounds.yaml"], cwd=args.project, check=True)
    same, longer = (built[name]["claims"] for name in ("seed-1", "seed-1-longer"))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"profiles": overrides_by_profile, "seed-1": built["seed-1"],
                                     "seed-1-longer": built["seed-1-longer"],
                                     "claims_equal": {name: same[name] == longer[name] for name in same}},
                                    indent=2) + "\n")


if __name__ == "__main__":
    main()
