"""Would a study's claims hold if some of its cells had been trained otherwise? The claims of a built project's
reports, after its cells are replaced or added, against the claims of the reports its git HEAD commits.

    # one seed of every setting at doubled maxima (longer_budget.py's longer side), in place of that seed's cells
    python benchmarks/swapped_claims.py --project /tmp/copy --cells-from /tmp/longer --json swapped.json

    # another pair of seeds (cells trained with `dvc exp run -S 'studies.ner.seeds=[2,3]'` or `kedro run`)
    python benchmarks/swapped_claims.py --project /tmp/copy --studies ner multi_encoder --json seeds_2_3.json

``--project`` is a copy of this project with the default studies built (every cell in data/04_models); it is
changed: its cells and reports. ``--cells-from`` is another project whose cell folders (data/04_models/<study>/
<cell key>) take the place of the same keys in ``--project``: the same cell, trained otherwise. The plan, evaluate
and aggregate stages then run through Kedro, not DVC: a replaced cell's spec is not its plan's, and `dvc repro`
would train it again. A claim is what a report states, not a score: each setting's *within tolerance?*, the
recommendation and the settings it cannot decide between, the multi-encoder's verdicts.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

CLAIM_KEYS = ("within_tolerance", "recommended_layers", "undecided_between", "cheapest_by_trainable_parameters",
              "undecided_by_trainable_parameters")


def claims(details: dict) -> dict:
    """The claims of a report's details.json, by question (task, encoder or layers)."""
    found = {}
    for task, questions in details.items():
        for question, result in questions.items():
            if question == "baselines" or not isinstance(result, dict):
                continue
            picked = {key: result[key] for key in CLAIM_KEYS if key in result}
            if "versus_reference" in result:
                picked["versus_reference"] = {name: verdict["verdict"]
                                              for name, verdict in result["versus_reference"].items()}
            found[f"{task} / {question}"] = picked
    return found


def studies_of(parser: argparse.ArgumentParser, project: Path, named: list[str] | None) -> tuple[dict, list[str]]:
    """``project``'s params, and the studies ``--studies`` named (default: all); an unknown one is a usage error."""
    params = yaml.safe_load((project / "params.yaml").read_text())
    studies = named or list(params["studies"])
    if unknown := sorted(set(studies) - set(params["studies"])):
        parser.error(f"--studies: {', '.join(map(repr, unknown))} not in {project / 'params.yaml'}. "
                     f"Valid choices: {', '.join(params['studies'])}")
    return params, studies


def replace_cells(project: Path, source: Path, studies: list[str]) -> dict[str, list[str]]:
    """Copy ``source``'s cell folders of ``studies`` over ``project``'s; the keys replaced, per study."""
    replaced = {}
    for study in studies:
        folders = sorted(p for p in (source / "data" / "04_models" / study).glob("*") if p.is_dir()
                         and not p.name.startswith("."))
        for folder in folders:
            target = project / "data" / "04_models" / study / folder.name
            if not target.is_dir():
                sys.exit(f"--cells-from: {folder.name} of {study} is not a cell of {project}; only the same keys "
                         "are replaced")
            shutil.rmtree(target)
            shutil.copytree(folder, target, symlinks=True)
        replaced[study] = [folder.name for folder in folders]
    return replaced


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--project", type=Path, required=True)
    parser.add_argument("--cells-from", type=Path, help="a project whose cell folders replace the same keys")
    parser.add_argument("--studies", nargs="+", metavar="STUDY", help="only these studies (default: all)")
    parser.add_argument("--json", type=Path, required=True)
    args = parser.parse_args()

    _, studies = studies_of(parser, args.project, args.studies)
    replaced = replace_cells(args.project, args.cells_from, studies) if args.cells_from else {}

    def kedro(*arguments: str) -> None:
        subprocess.run([sys.executable, "-m", "kedro", "run", "--pipelines", *arguments], cwd=args.project,
                       check=True)

    kedro("plan")
    result = {"replaced": replaced, "studies": {}}
    for study in studies:
        kedro("evaluate", "--params", f"study={study}")
        kedro("aggregate", "--params", f"study={study}")
        committed = json.loads(subprocess.run(["git", "show", f"HEAD:reports/{study}/details.json"],
                                              cwd=args.project, check=True, capture_output=True, text=True).stdout)
        now = json.loads((args.project / "reports" / study / "details.json").read_text())
        before, after = claims(committed), claims(now)
        result["studies"][study] = {"claims_equal": before == after, "committed": before, "now": after}
        print(study, "claims equal" if before == after else "claims differ", flush=True)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
