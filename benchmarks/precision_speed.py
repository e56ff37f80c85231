"""float32 against bfloat16 on this CPU: per-step and whole-cell times, and the dev scores, for K = 0, 2 and all.

    python benchmarks/precision_speed.py --json reports/benchmarks/precision.json
    python benchmarks/precision_speed.py --task stsb --json reports/benchmarks/precision_stsb.json
    python benchmarks/precision_speed.py --tunable-layers all --glibc-malloc-defaults --json ...  # glibc's malloc

One process, the real all-MiniLM-L6-v2 and real SST-2 or STS-B (2,000 training examples, a 500-example validation
slice, the whole dev split; batch 16, max length 64, the studies' recipe with a fixed number of epochs, no early
stopping, so that both precisions do the same work). Each K trains with ``mixed_precision="no"`` and ``"bf16"``, same
seeds, the two alternating per seed so that the machine's other load hits both alike; K = 0 and 2 read the frozen-
prefix cache (built once per precision and boundary before timing: its pass computes in the run's precision, and the
cache keys say which), K = all cannot cache. Per run: the median step time (an epoch's training time over its
batches), the whole cell's wall time (build, data, training, scoring), and the dev score.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

MODEL = "sentence-transformers/all-MiniLM-L6-v2"
RECIPE = dict(learning_rate=5e-5, head_learning_rate=1e-3, batch_size=16, eval_batch_size=128, weight_decay=0.01,
              warmup_ratio=0.1, group_by_length=True, max_length=64, eval_strategy="epoch")


def run(corpus, tunable_layers, precision: str, seed: int, epochs: int, cache_dir: str) -> dict:
    from layertune import LanguageModel, ModelTrainer, TextClassifier, TextRegressor

    started = time.perf_counter()
    language_model = LanguageModel(MODEL, tunable_layers=tunable_layers, pooling="mean")
    model = TextRegressor(language_model) if corpus.task_type == "regression" else TextClassifier(language_model, 2)
    trainer = ModelTrainer(model, corpus, cache_dir=cache_dir)
    result = trainer.train(progress=False, seed=seed, epochs=epochs, mixed_precision=precision,
                           **{**RECIPE, "learning_rate": 1e-4 if tunable_layers != "all" else 5e-5,
                              "head_learning_rate": 1e-2 if tunable_layers == 0 else 1e-3})
    batches = -(-len(corpus.train) // RECIPE["batch_size"])
    return {"tunable_layers": str(tunable_layers), "precision": result.mixed_precision, "seed": seed,
            "step_ms": 1000 * statistics.median(r["epoch_time_s"] for r in result.history) / batches,
            "train_s": result.train_time_s, "cell_s": time.perf_counter() - started,
            "dev_score": result.best_score, "cached": result.frozen_prefix_cache["used"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path, default=Path("reports/benchmarks/precision.json"))
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--train-size", type=int, default=2000)
    parser.add_argument("--task", choices=["sst2", "stsb"], default="sst2",
                        help="SST-2: single sentences, 12.8 word pieces on average; STS-B: pairs, 27.5")
    parser.add_argument("--tunable-layers", nargs="+", default=["0", "2", "all"], choices=["0", "2", "all"])
    parser.add_argument("--glibc-malloc-defaults", action="store_true",
                        help="leave glibc's malloc as it is (LAYERTUNE_KEEP_FREED_BLOCKS=0)")
    parser.add_argument("--data-mirror", default=os.environ.get("LAYERTUNE_DATA_MIRROR"))
    args = parser.parse_args()

    import torch

    from layertune.corpora import load_corpus
    from layertune.training_config import cpu_has_native_bf16

    if not cpu_has_native_bf16():
        raise SystemExit("This CPU has no native bfloat16 (AVX-512 BF16 or AMX): there is nothing to compare; "
                         "mixed_precision auto trains in float32 here.")
    if args.glibc_malloc_defaults:
        os.environ["LAYERTUNE_KEEP_FREED_BLOCKS"] = "0"
    corpus = load_corpus(args.task, train_size=args.train_size, validation_size=500, seed=42,
                         data_mirror=args.data_mirror)
    settings = [int(k) if k != "all" else k for k in args.tunable_layers]
    runs = []
    with tempfile.TemporaryDirectory() as cache_dir:
        for tunable_layers in [k for k in settings if k != "all"]:  # both precisions' cache entries, before timing
            for precision in ("no", "bf16"):
                run(corpus, tunable_layers, precision, seed=0, epochs=1, cache_dir=cache_dir)
        for tunable_layers in settings:
            for seed in args.seeds:
                for precision in (("no", "bf16") if seed % 2 else ("bf16", "no")):
                    runs.append(run(corpus, tunable_layers, precision, seed, args.epochs, cache_dir))
                    print(json.dumps(runs[-1]), flush=True)
    summary = {}
    for tunable_layers in args.tunable_layers:
        mine = {p: [r for r in runs if r["tunable_layers"] == tunable_layers and r["precision"] == p]
                for p in ("no", "bf16")}
        median = {p: {key: statistics.median(r[key] for r in rows) for key in ("step_ms", "train_s", "cell_s")}
                  for p, rows in mine.items()}
        scores = {p: [round(100 * r["dev_score"], 2) for r in rows] for p, rows in mine.items()}
        summary[tunable_layers] = {
            "float32": median["no"], "bfloat16": median["bf16"],
            "speedup_step": median["no"]["step_ms"] / median["bf16"]["step_ms"],
            "speedup_train": median["no"]["train_s"] / median["bf16"]["train_s"],
            "speedup_cell": median["no"]["cell_s"] / median["bf16"]["cell_s"],
            "dev_score": {"float32": scores["no"], "bfloat16": scores["bf16"]}}
        print(tunable_layers, json.dumps(summary[tunable_layers]))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({
        "machine": {"cpu": _cpu_name(), "threads": torch.get_num_threads(), "torch": torch.__version__,
                    "avx512_bf16": torch.cpu._is_avx512_bf16_supported(), "amx": torch.cpu._is_amx_tile_supported(),
                    "malloc": "glibc defaults" if args.glibc_malloc_defaults else "freed blocks kept"},
        "setup": {"model": MODEL, "task": args.task, "metric": corpus.main_metric, "train_size": args.train_size,
                  "epochs": args.epochs, "seeds": args.seeds, **RECIPE},
        "summary": summary, "runs": runs}, indent=2) + "\n")


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


if __name__ == "__main__":
    main()
