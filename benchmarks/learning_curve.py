"""The learning curve of full fine-tuning: dev score by training size, each point trained until it stops improving.

What a default study's training size is chosen from: the smallest size at which full fine-tuning scores within 3
points of the largest size measured (benchmarks/README.md, "How large a study is"). Each point is one cell through the
library's one road (`layertune.cell.train_cell`): all-MiniLM-L6-v2, every layer tuned, the same validation slice
carved from train at every size (data seed 42), early stopping on it, dev scored once with the best weights.

    python benchmarks/learning_curve.py --task sst2 --sizes 500 1000 2000 4000 8000 16000 \\
        --json reports/benchmarks/learning_curve.json
    python benchmarks/learning_curve.py --figure reports/benchmarks/learning_curve.png   # the figure of the JSON

Points are added to the JSON as they finish (a stopped run keeps them, and a rerun skips them); ``--budget-minutes``
starts no size once the task's points have taken that long.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # machine_speed, beside this script
from machine_speed import reference  # noqa: E402  (benchmarks/: the machine's reference figure)

MODEL = "sentence-transformers/all-MiniLM-L6-v2"
# The recipe of full fine-tuning the studies use (params.yaml's training sections, tunable_layers: all).
RECIPE = {"learning_rate": 5e-5, "head_learning_rate": 1e-3, "batch_size": 16, "eval_batch_size": 128,
          "weight_decay": 0.01, "warmup_ratio": 0.1, "group_by_length": True, "epochs": 10,
          "early_stopping_patience": 2}
MAX_LENGTH = {"sst2": 64, "stsb": 128, "conll2003": 128, "cola": 64, "mrpc": 128, "rte": 256}
VALIDATION_SIZE = 500


def train_point(task: str, size: int | None, seed: int, data_mirror: str | None) -> dict:
    from layertune.cell import train_cell
    from layertune.specs import CellSpec

    spec = CellSpec.model_validate({
        "corpus": {"task": task, "train_size": size, "validation_size": VALIDATION_SIZE, "seed": 42, "test": False},
        "encoders": [{"model": MODEL, "tunable_layers": "all", "pooling": "mean"}],
        "training": {**RECIPE, "seed": seed, "max_length": MAX_LENGTH[task]}})
    started = time.perf_counter()
    corpus = spec.corpus.load(data_mirror)
    result = train_cell(spec, corpus=corpus, progress=False).result
    return {"task": task, "train_size": len(corpus.train), "seed": seed,
            "examples": size, "metric": result.main_metric, "dev_score": result.best_score,
            "best_epoch": result.best_epoch, "epochs_trained": result.epochs_trained,
            "stopped_by": result.stopped_by, "train_time_s": round(result.train_time_s, 1),
            "wall_s": round(time.perf_counter() - started, 1), "mixed_precision": result.mixed_precision,
            "validation": [round(r.get(result.selection_metric, float("nan")), 4) for r in result.history]}


def figure(points: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = sorted({p["task"] for p in points})
    fig, axes = plt.subplots(1, len(tasks), figsize=(4.2 * len(tasks), 3.4), squeeze=False)
    for ax, task in zip(axes[0], tasks):
        mine = sorted((p for p in points if p["task"] == task), key=lambda p: p["train_size"])
        # The line joins each size's mean over its seeds; every seed is a dot of its own.
        by_size: dict[int, list[float]] = {}
        for p in mine:
            by_size.setdefault(p["train_size"], []).append(100 * p["dev_score"])
        sizes = sorted(by_size)
        means = [sum(by_size[s]) / len(by_size[s]) for s in sizes]
        ax.plot(sizes, means, marker="o")
        if any(len(v) > 1 for v in by_size.values()):
            ax.scatter([p["train_size"] for p in mine], [100 * p["dev_score"] for p in mine], s=12, color="tab:gray",
                       zorder=3, label="one seed")
        # A point its epochs' cap stopped (not its patience) may be short of what its size can reach: hollow.
        capped = [(p["train_size"], 100 * p["dev_score"]) for p in mine if p["stopped_by"] != "early_stopping"]
        if capped:
            ax.scatter(*zip(*capped), s=90, facecolors="white", edgecolors="tab:blue", zorder=3,
                       label="stopped by its epochs' cap")
        ax.axhspan(max(means) - 3, max(means), color="tab:green", alpha=0.12, label="within 3 points of the top")
        ax.set_xscale("log")
        ax.set_xticks(sizes, [f"{size:,}" for size in sizes], rotation=30)
        ax.minorticks_off()
        ax.set_xlabel("training examples")
        ax.set_ylabel(f"dev {mine[0]['metric']} (points)")
        ax.set_title(f"{task}: full fine-tuning, MiniLM-L6")
        ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", choices=sorted(MAX_LENGTH))
    parser.add_argument("--sizes", type=int, nargs="+", help="training sizes; 0: all that is left after the slice")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--budget-minutes", type=float, default=60.0)
    parser.add_argument("--json", type=Path, default=Path("reports/benchmarks/learning_curve.json"))
    parser.add_argument("--figure", type=Path, help="write the figure of the JSON's points here")
    parser.add_argument("--data-mirror", default=os.environ.get("LAYERTUNE_DATA_MIRROR"))
    args = parser.parse_args()

    record = json.loads(args.json.read_text()) if args.json.is_file() else {"points": []}
    if args.task:
        import torch

        # Per point: the curve's points may come from different machines and precisions (a CPU without native
        # bfloat16 trains in float32), and a point's time means little without its machine's reference figure.
        machine = {**reference(), "threads": torch.get_num_threads(), "torch": torch.__version__}
        record["recipe"] = {**RECIPE, "model": MODEL, "validation_size": VALIDATION_SIZE, "data_seed": 42}
        spent = sum(p["wall_s"] for p in record["points"] if p["task"] == args.task) / 60
        for size in args.sizes:
            done = [p for p in record["points"] if p["task"] == args.task and p["examples"] == (size or None)
                    and p["seed"] == args.seed]
            if done:
                continue
            if spent >= args.budget_minutes:
                print(f"{args.task}: {spent:.0f} minutes spent, no more sizes (--budget-minutes)")
                break
            point = {**train_point(args.task, size or None, args.seed, args.data_mirror), "machine": machine,
                     "date": time.strftime("%Y-%m-%d")}
            spent += point["wall_s"] / 60
            record["points"].append(point)
            print(json.dumps(point), flush=True)
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(record, indent=2) + "\n")
    if args.figure:
        figure(record["points"], args.figure)


if __name__ == "__main__":
    main()
