"""A fair learning rate for each number of tunable layers, chosen on the validation slice (never dev).

    python benchmarks/rate_sweep.py --task sst2 --train-size 2000 --tunable-layers 1 2 3 \\
        --rates 5e-5 1e-4 2e-4 4e-4 --json reports/benchmarks/rate_sweep.json
    python benchmarks/rate_sweep.py --task sst2 --train-size 2000 --tunable-layers 0 --head-rates 3e-3 1e-2 3e-2

Each (K, rate) trains one cell as a default study trains it (`learning_curve.RECIPE`: the same validation slice,
early stopping on it, the study's epochs and patience for that K) and records its best validation score; the rate
kept for K is the one with the best validation score (ties: the smaller rate). Dev is scored too, and written
beside, but chooses nothing. The chosen rates are what params.yaml's ``per_tunable_layers`` give each K.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from learning_curve import MAX_LENGTH, MODEL, RECIPE, VALIDATION_SIZE

# The head alone trains from cached final states: many cheap epochs, a patience to match.
HEAD_ONLY = {"epochs": 100, "early_stopping_patience": 10, "warmup_ratio": 0.0, "weight_decay": 0.0}


def sweep_point(task: str, size: int, tunable_layers, rate: float, head_rate: float, seed: int, corpus,
                cache_dir: str | None) -> dict:
    from layertune.cell import train_cell
    from layertune.specs import CellSpec

    training = {**RECIPE, **(HEAD_ONLY if tunable_layers == 0 else {}), "learning_rate": rate,
                "head_learning_rate": head_rate, "seed": seed, "max_length": MAX_LENGTH[task]}
    spec = CellSpec.model_validate({
        "corpus": {"task": task, "train_size": size, "validation_size": VALIDATION_SIZE, "seed": 42, "test": False},
        "encoders": [{"model": MODEL, "tunable_layers": tunable_layers, "pooling": "mean"}], "training": training})
    started = time.perf_counter()
    result = train_cell(spec, corpus=corpus, cache_dir=cache_dir, progress=False).result
    best = result.history[result.best_epoch - 1]
    return {"task": task, "train_size": size, "tunable_layers": str(tunable_layers), "learning_rate": rate,
            "head_learning_rate": head_rate, "seed": seed, "validation_score": best[result.selection_metric],
            "dev_score": result.best_score, "best_epoch": result.best_epoch, "epochs_trained": result.epochs_trained,
            "stopped_by": result.stopped_by, "wall_s": round(time.perf_counter() - started, 1)}


def chosen(points: list[dict]) -> dict:
    """Per task, size and K: the rate (or head rate, for K = 0) with the best validation score."""
    found: dict = {}
    for point in points:
        key = f"{point['task']}@{point['train_size']}:{point['tunable_layers']}"
        rate = point["head_learning_rate"] if point["tunable_layers"] == "0" else point["learning_rate"]
        best = found.get(key)
        if best is None or (point["validation_score"], -rate) > (best["validation_score"], -best["rate"]):
            found[key] = {"rate": rate, "validation_score": point["validation_score"], "dev_score": point["dev_score"]}
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", required=True, choices=sorted(MAX_LENGTH))
    parser.add_argument("--train-size", type=int, required=True)
    parser.add_argument("--tunable-layers", nargs="+", required=True)
    parser.add_argument("--rates", type=float, nargs="+", default=[RECIPE["learning_rate"]])
    parser.add_argument("--head-rates", type=float, nargs="+", default=[RECIPE["head_learning_rate"]])
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", type=Path, default=Path("reports/benchmarks/rate_sweep.json"))
    parser.add_argument("--data-mirror", default=os.environ.get("LAYERTUNE_DATA_MIRROR"))
    parser.add_argument("--cache-dir", default=os.environ.get("LAYERTUNE_CACHE"))
    args = parser.parse_args()

    from layertune.specs import CorpusSpec

    record = json.loads(args.json.read_text()) if args.json.is_file() else {"points": []}
    corpus = CorpusSpec(task=args.task, train_size=args.train_size, validation_size=VALIDATION_SIZE, seed=42,
                        test=False).load(args.data_mirror)
    for value in args.tunable_layers:
        tunable_layers = value if value == "all" else int(value)
        rates = [(RECIPE["learning_rate"], head) for head in args.head_rates] if tunable_layers == 0 \
            else [(rate, RECIPE["head_learning_rate"]) for rate in args.rates]
        for rate, head_rate in rates:
            if any(p["task"] == args.task and p["train_size"] == args.train_size and p["seed"] == args.seed
                   and p["tunable_layers"] == str(tunable_layers) and p["learning_rate"] == rate
                   and p["head_learning_rate"] == head_rate for p in record["points"]):
                continue
            point = sweep_point(args.task, args.train_size, tunable_layers, rate, head_rate, args.seed, corpus,
                                args.cache_dir)
            record["points"].append(point)
            record["chosen"] = chosen(record["points"])
            print(json.dumps(point), flush=True)
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record.get("chosen", {}), indent=1))


if __name__ == "__main__":
    main()
