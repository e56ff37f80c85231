"""A fair learning rate for each number of tunable layers, chosen on the validation slice (never dev).

    python benchmarks/rate_sweep.py --task sst2 --train-size 2000 --tunable-layers 1 2 3 \\
        --rates 5e-5 1e-4 2e-4 4e-4 --json reports/benchmarks/rate_sweep.json
    python benchmarks/rate_sweep.py --task sst2 --train-size 2000 --tunable-layers 0 --head-rates 3e-3 1e-2 3e-2 \\
        --head-weight-decays 0 0.1 1
    python benchmarks/rate_sweep.py --task stsb --train-size 2000 --tunable-layers 0 --head-rates 1e-2 3e-2 \\
        --head-dropouts 0 0.1 --head-schedules 100:10 40:40 --json reports/benchmarks/head_schedule_sweep.json
    python benchmarks/rate_sweep.py --task sst2 --train-size 2000 --tunable-layers all --method lora \\
        --rates 1e-3 3e-3 1e-2 --json reports/benchmarks/method_sweep.json

Each (K, rate) trains one cell as a default study trains it (`learning_curve.RECIPE`: the same validation slice,
early stopping on it, the study's epochs and patience for that K) and records its best validation score; the rate
kept for K is the one with the best validation score (ties: the smaller rate). For the head alone the grid can also
cross its rates with AdamW weight decays (`--head-weight-decays`), as its optimum, the probe, is a penalised linear
model, with the dropout before it (`--head-dropouts`), and with its schedule (`--head-schedules EPOCHS:PATIENCE`: the
rate decays linearly to zero over EPOCHS, so 40:40 runs the decay to its end, keeping the best epoch); `--method` sweeps a tuning method's rate (LoRA, IA3, BitFit: params.yaml's ``methods.<m>.learning_rate``).
Dev is scored too, and written beside, but chooses nothing. The chosen rates are what params.yaml's
``per_tunable_layers`` give each K.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from learning_curve import MAX_LENGTH, MODEL, RECIPE, VALIDATION_SIZE

from layertune.specs import HeadSpec

# The head alone trains from cached final states: many cheap epochs, a patience to match.
HEAD_ONLY = {"epochs": 100, "early_stopping_patience": 10, "warmup_ratio": 0.0, "weight_decay": 0.0}
HEAD_DROPOUT = HeadSpec.model_fields["head_dropout"].default  # the study's head, unless swept


def sweep_point(task: str, size: int, tunable_layers, rate: float, head_rate: float, seed: int, corpus,
                cache_dir: str | None, weight_decay: float | None = None, method: str = "top_k",
                head_dropout: float = HEAD_DROPOUT, schedule: tuple[int, int] | None = None) -> dict:
    from layertune.cell import train_cell
    from layertune.specs import CellSpec

    training = {**RECIPE, **(HEAD_ONLY if tunable_layers == 0 else {}), "learning_rate": rate,
                "head_learning_rate": head_rate, "seed": seed, "max_length": MAX_LENGTH[task]}
    if weight_decay is not None:
        training["weight_decay"] = weight_decay
    if schedule is not None:
        training["epochs"], training["early_stopping_patience"] = schedule
    spec = CellSpec.model_validate({
        "corpus": {"task": task, "train_size": size, "validation_size": VALIDATION_SIZE, "seed": 42, "test": False},
        "encoders": [{"model": MODEL, "tunable_layers": tunable_layers, "pooling": "mean", "method": method}],
        "head": {"head_dropout": head_dropout}, "training": training})
    started = time.perf_counter()
    result = train_cell(spec, corpus=corpus, cache_dir=cache_dir, progress=False).result
    best = result.history[result.best_epoch - 1]
    return {"task": task, "train_size": size, "method": method, "tunable_layers": str(tunable_layers),
            "learning_rate": rate, "head_learning_rate": head_rate, "weight_decay": training["weight_decay"],
            "head_dropout": head_dropout, "epochs": training["epochs"],
            "early_stopping_patience": training["early_stopping_patience"],
            "seed": seed, "validation_score": best[result.selection_metric],
            "dev_score": result.best_score, "best_epoch": result.best_epoch, "epochs_trained": result.epochs_trained,
            "stopped_by": result.stopped_by, "wall_s": round(time.perf_counter() - started, 1)}


def default_decay(tunable_layers) -> float:
    return HEAD_ONLY["weight_decay"] if str(tunable_layers) == "0" else RECIPE["weight_decay"]


def default_schedule(tunable_layers) -> tuple[int, int]:
    recipe = HEAD_ONLY if str(tunable_layers) == "0" else RECIPE
    return recipe["epochs"], recipe["early_stopping_patience"]


def settings(point: dict) -> dict:
    """A point's settings, the keys older records lack at their values then (top-K, the default weight decay,
    dropout and schedule; a K > 0 point's schedule is the study's for that K, not recorded before)."""
    epochs, patience = default_schedule(point["tunable_layers"])
    return {"method": "top_k", "weight_decay": default_decay(point["tunable_layers"]), "head_dropout": HEAD_DROPOUT,
            "epochs": epochs, "early_stopping_patience": patience, **point}


def chosen(points: list[dict]) -> dict:
    """Per task, size and K: the rate (or, for K = 0, head rate, weight decay, dropout and schedule) with the best
    validation score of the first seed swept (ties: the smaller rate, then the smaller decay, the larger dropout, the
    shorter schedule, the shorter patience)."""
    def key_of(point: dict) -> str:
        method = settings(point)["method"]
        return f"{point['task']}@{point['train_size']}:" + ("" if method == "top_k" else f"{method}-") \
            + point["tunable_layers"]

    first_seed: dict = {}
    for point in points:
        first_seed[key_of(point)] = min(point["seed"], first_seed.get(key_of(point), point["seed"]))
    found: dict = {}
    for point in points:
        key = key_of(point)
        if point["seed"] != first_seed[key]:
            continue
        rate = point["head_learning_rate"] if point["tunable_layers"] == "0" else point["learning_rate"]
        full = settings(point)
        candidate = {"rate": rate, "weight_decay": full["weight_decay"], "head_dropout": full["head_dropout"],
                     "epochs": full["epochs"], "early_stopping_patience": full["early_stopping_patience"],
                     "validation_score": point["validation_score"], "dev_score": point["dev_score"]}

        def order(c: dict) -> tuple:
            return (c["validation_score"], -c["rate"], -c["weight_decay"], c["head_dropout"], -c["epochs"],
                    -c["early_stopping_patience"])

        if key not in found or order(candidate) > order(found[key]):
            found[key] = candidate
    return found


def schedule_of(text: str) -> tuple[int, int]:
    """``EPOCHS:PATIENCE`` (``40:40``) as two positive whole numbers."""
    try:
        epochs, patience = (int(part) for part in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give EPOCHS:PATIENCE, two whole numbers (40:40)") from None
    if epochs < 1 or patience < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: epochs and patience must be at least 1")
    return epochs, patience


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", required=True, choices=sorted(MAX_LENGTH))
    parser.add_argument("--train-size", type=int, required=True)
    parser.add_argument("--tunable-layers", nargs="+", required=True)
    parser.add_argument("--rates", type=float, nargs="+", default=[RECIPE["learning_rate"]])
    parser.add_argument("--head-rates", type=float, nargs="+", default=[RECIPE["head_learning_rate"]])
    parser.add_argument("--head-weight-decays", type=float, nargs="+", default=[HEAD_ONLY["weight_decay"]],
                        help="AdamW weight decays crossed with --head-rates for the head alone (K = 0)")
    parser.add_argument("--head-dropouts", type=float, nargs="+", default=[HEAD_DROPOUT],
                        help="the dropout before the head, crossed with the rest for the head alone (K = 0)")
    parser.add_argument("--head-schedules", nargs="+", type=schedule_of, default=[default_schedule(0)],
                        metavar="EPOCHS:PATIENCE", help="the head alone's maximum epochs (over which its rate decays "
                        "to zero) and early-stopping patience, crossed with the rest (default 100:10)")
    parser.add_argument("--method", default="top_k", help="the tuning method by name, with its defaults: "
                        "top_k, lora, ia3 or bitfit (layertune.tuning_methods)")
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
        grid = [(RECIPE["learning_rate"], head, decay, dropout, schedule) for head in args.head_rates
                for decay in args.head_weight_decays for dropout in args.head_dropouts
                for schedule in args.head_schedules] if tunable_layers == 0 \
            else [(rate, RECIPE["head_learning_rate"], None, HEAD_DROPOUT, None) for rate in args.rates]
        for rate, head_rate, decay, dropout, schedule in grid:
            epochs, patience = schedule or default_schedule(tunable_layers)
            wanted = {"task": args.task, "train_size": args.train_size, "seed": args.seed, "method": args.method,
                      "tunable_layers": str(tunable_layers), "learning_rate": rate, "head_learning_rate": head_rate,
                      "weight_decay": decay if decay is not None else default_decay(tunable_layers),
                      "head_dropout": dropout, "epochs": epochs, "early_stopping_patience": patience}
            if any(all(settings(p)[k] == v for k, v in wanted.items()) for p in record["points"]):
                continue  # swept already: a sweep resumes where it stopped
            point = sweep_point(args.task, args.train_size, tunable_layers, rate, head_rate, args.seed, corpus,
                                args.cache_dir, decay, args.method, dropout, schedule)
            record["points"].append(point)
            record["chosen"] = chosen(record["points"])
            print(json.dumps(point), flush=True)
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record.get("chosen", {}), indent=1))


if __name__ == "__main__":
    main()
