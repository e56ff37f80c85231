"""LoRA speed benchmark: layertune's LoRA against the common `peft` + `transformers.Trainer` recipe, on real data.

Training time per epoch, in one process, with the same data, batch size, max_length, learning rate, schedule,
number of steps and torch threads on every side (CPU, float32; evaluation and set-up are not timed):

(a) LoRA on every layer (r=8, alpha=16, dropout=0.1, peft's default target modules):
      layertune  ``LanguageModel(MODEL, method=Lora(r=8))`` + `ModelTrainer` (nothing to cache: every layer changes)
      recipe     ``peft.get_peft_model(AutoModelForSequenceClassification, LoraConfig(task_type="SEQ_CLS", ...))``
                 + ``transformers.Trainer``, ``DataCollatorWithPadding``, no evaluation, no saving, no logging
    run in turn (A B, B A, ...); the issue's goal is layertune >= 0.95x the recipe's throughput.
(b) LoRA on the top K layers, for each K:
      cached     layertune with the frozen-prefix cache (states entering layer L-K computed once, before training;
                 that one-off build is timed on its own)
      uncached   layertune with ``frozen_prefix_cache=False``
      recipe     the recipe of (a) restricted to the same layers (``layers_to_transform``, ``layers_pattern``)
    each against LoRA on every layer; the issue's goal: cached time about K/L of LoRA-all, as for top-K tuning.

    python benchmarks/tuning_methods_speed.py --json reports/benchmarks/tuning_methods.json
    python benchmarks/tuning_methods_speed.py --quick              # smoke run: 128 sentences, K = 1, about a minute

See benchmarks/README.md for what each figure means and the figures measured.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # read once, at import time: set before any Hugging Face import
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Idle OpenMP threads sleep instead of spinning (read when torch loads): see frozen_prefix_speed.py for why.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling benchmark's helpers

import numpy as np
import torch
import transformers
from frozen_prefix_speed import EpochTimer, _steal_note, benchmark_setup, cpu_times, median, steal_fraction
from peft import LoraConfig, TaskType, get_peft_model

from layertune import LanguageModel, Lora, ModelTrainer, TextClassifier, load_corpus
from layertune.frozen_prefix import FrozenPrefixCache
from layertune.metrics import compute_metrics
from layertune.model_paths import resolve_model_path
from layertune.tokenization import tokenize_corpus
from layertune.training_config import synchronize
from machine_speed import reference  # noqa: E402  (benchmarks/: the machine's reference figure)

MODEL = "sentence-transformers/all-MiniLM-L6-v2"
DEFAULTS = {"train_size": 400, "dev_size": 64, "repeats": 4, "top_k_repeats": 2, "layers": "1,2,3"}
QUICK = {"train_size": 128, "dev_size": 32, "repeats": 2, "top_k_repeats": 1, "layers": "1"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--train-size", type=int, help=f"training sentences (default {DEFAULTS['train_size']})")
    parser.add_argument("--dev-size", type=int,
                        help=f"dev sentences (default {DEFAULTS['dev_size']}): layertune scores dev once after "
                             "training (not timed); the recipe scores nothing")
    parser.add_argument("--repeats", type=int,
                        help=f"(a): runs per side, taken in pairs A B, B A, ... (default {DEFAULTS['repeats']})")
    parser.add_argument("--top-k-repeats", type=int,
                        help=f"(b): runs per variant and K, the order of the three reversed each time "
                             f"(default {DEFAULTS['top_k_repeats']})")
    parser.add_argument("--layers", help=f"K for (b), comma-separated (default {DEFAULTS['layers']})")
    parser.add_argument("--epochs", type=int, default=1, help="epochs per run (each is timed)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--learning-rate", type=float, default=5e-4, help="adapters and head alike")
    parser.add_argument("--max-length", type=int, default=128)
    parser.add_argument("--rank", type=int, default=8, help="LoRA r (alpha 2r, dropout 0.1, as layertune's Lora)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch threads, for all runs")
    parser.add_argument("--data-mirror", default=os.environ.get("LAYERTUNE_DATA_MIRROR", "../shared/data"))
    parser.add_argument("--cache-dir", help="where tokenized data and cache entries go (default: a temporary folder)")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, for a smoke run")
    args = parser.parse_args(argv)
    for key, value in (QUICK if args.quick else DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.layers = [int(k) for k in args.layers.split(",") if k]
    if args.repeats < 1 or args.top_k_repeats < 1:
        parser.error("--repeats and --top-k-repeats must be at least 1")
    args.method = Lora(r=args.rank, alpha=2.0 * args.rank, dropout=0.1)
    return args


# ---------------------------------------------------------------------------------------------------- the runs


class TrainingTokens:
    """Counts the padded tokens and batches a model trains on (a forward pre-hook; scoring passes are skipped): the
    two sides draw their random batches differently, so an epoch's padding differs a little between them."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.tokens = self.batches = 0
        self.starts: list[float] = []  # when each training forward began: step times without the loops' ends
        self.handle = module.register_forward_pre_hook(self, with_kwargs=True)

    def __call__(self, module, args, kwargs):
        if module.training:
            self.starts.append(time.perf_counter())
            batch = args[0] if args else kwargs  # layertune: model(batch); Trainer: model(**batch)
            self.tokens += batch["input_ids"].numel()
            self.batches += 1

    def step_s(self, epochs: int) -> list[float]:
        """Seconds from each training forward to the next within an epoch, each epoch's first step (which warms up)
        left out."""
        per_epoch = len(self.starts) // epochs
        return [float(t) for e in range(epochs)
                for t in np.diff(self.starts[e * per_epoch : (e + 1) * per_epoch])[1:]]


def lora_config(args: argparse.Namespace, layers: list[int] | None) -> LoraConfig:
    """The recipe's config: peft's default target modules for the architecture (BERT: query, value)."""
    method = args.method
    restricted = {"layers_to_transform": layers, "layers_pattern": "layer"} if layers is not None else {}
    return LoraConfig(task_type=TaskType.SEQ_CLS, r=method.r, lora_alpha=method.alpha, lora_dropout=method.dropout,
                      **restricted)


def run_recipe(tokenized: dict, tokenizer, k: int | str, seed: int, args: argparse.Namespace) -> dict:
    """The common recipe: `peft.get_peft_model` on `AutoModelForSequenceClassification`, `transformers.Trainer`."""
    transformers.set_seed(seed)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(resolve_model_path(MODEL), num_labels=2)
    layers = model.config.num_hidden_layers
    model = get_peft_model(model, lora_config(args, None if k == "all" else list(range(layers - k, layers))))
    timer = EpochTimer()
    counter = TrainingTokens(model)
    with tempfile.TemporaryDirectory() as output_dir:
        training_args = transformers.TrainingArguments(
            output_dir=output_dir, per_device_train_batch_size=args.batch_size, learning_rate=args.learning_rate,
            num_train_epochs=args.epochs, lr_scheduler_type="linear", warmup_steps=0, weight_decay=0.0,
            max_grad_norm=1.0, eval_strategy="no", save_strategy="no", logging_strategy="no", report_to="none",
            seed=seed, disable_tqdm=True, dataloader_num_workers=0, use_cpu=args.use_cpu,
            bf16=args.bf16,  # on a GPU, in bf16 autocast as ModelTrainer's mixed_precision="auto" trains
        )
        trainer = transformers.Trainer(model=model, args=training_args, train_dataset=tokenized["train"],
                                       data_collator=transformers.DataCollatorWithPadding(tokenizer),
                                       callbacks=[timer])
        trainer.remove_callback(transformers.trainer_callback.PrinterCallback)  # it prints every log dict
        cpu = cpu_times()
        trainer.train()
    return {"epoch_s": timer.times, "step_s": counter.step_s(args.epochs), "tokens": counter.tokens / args.epochs,
            "batches": counter.batches / args.epochs, "trainable": model.get_nb_trainable_parameters()[0], "steal": steal_fraction(cpu)}


def run_layertune(corpus, k: int | str, seed: int, args: argparse.Namespace, cache: bool | str) -> dict:
    """`ModelTrainer` as a user calls it, with the recipe's settings (one learning rate for adapters and head)."""
    transformers.set_seed(seed)
    model = TextClassifier(LanguageModel(MODEL, tunable_layers=k, pooling="pooler", method=args.method), 2)
    counter = TrainingTokens(model)
    cpu = cpu_times()
    result = ModelTrainer(model, corpus, cache_dir=args.cache_dir).train(
        progress=False, frozen_prefix_cache=cache, learning_rate=args.learning_rate, head_learning_rate=None,
        batch_size=args.batch_size, epochs=args.epochs, seed=seed, max_length=args.max_length, weight_decay=0.0,
        warmup_ratio=0.0, max_grad_norm=1.0, eval_strategy="end", mixed_precision="no")
    return {"epoch_s": [h["epoch_time_s"] for h in result.history], "step_s": counter.step_s(args.epochs),
            "tokens": counter.tokens / args.epochs, "batches": counter.batches / args.epochs,
            "trainable": result.trainable_parameters,
            "cache": result.frozen_prefix_cache, "steal": steal_fraction(cpu)}


def cache_build(tokenized: dict, k: int, args: argparse.Namespace) -> tuple[float, list[str]]:
    """Seconds for the one-off pass that fills the top-K LoRA model's cache entry (states entering layer L-K, train
    and dev; hashing and checksum included) on ``args.device``, in the folder `ModelTrainer` reads; and the entries'
    keys."""
    encoder = LanguageModel(MODEL, tunable_layers=k, pooling="pooler", method=args.method)
    cache = FrozenPrefixCache(args.cache_dir / "frozen_prefix", autocast=args.autocast, progress=False)
    started = time.perf_counter()
    keys = [key for split in ("train", "dev") for key in cache.build(encoder, tokenized[split],
                                                                       [encoder.frozen_prefix_layers],
                                                                       device=args.device)]
    synchronize(torch.device(args.device))
    return time.perf_counter() - started, keys


# ---------------------------------------------------------------------------------------------------- reporting


def epoch_s(runs: list[dict]) -> float:
    """Median epoch time over runs × epochs."""
    return median([t for run in runs for t in run["epoch_s"]])


def step_s(runs: list[dict]) -> float:
    """Median time of a training step over runs, each epoch's first step left out (`TrainingTokens.step_s`)."""
    return median([t for run in runs for t in run["step_s"]])


def tokens_per_s(runs: list[dict]) -> float:
    return median([run["tokens"] / t for run in runs for t in run["epoch_s"]])


def ideal_ratios(k: int, layers: int) -> dict[str, float]:
    """Per layer: forward 1 unit, backward about 1 (gradients of the activations; LoRA's weight gradients are tiny
    and the frozen weights get none). LoRA-all costs 2L; cached top K 2K; uncached or the recipe L + K."""
    return {"cached_to_all": k / layers, "uncached_to_all": (layers + k) / (2 * layers),
            "cached_to_recipe": 2 * k / (layers + k)}


# ---------------------------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    with benchmark_setup(args, "tuning-methods-bench-"):
        return benchmark(args)


def benchmark(args: argparse.Namespace) -> dict:
    started, cpu_start = time.perf_counter(), cpu_times()
    compute_metrics(("accuracy",), [0, 1], [0, 1])  # one-time imports (scipy) out of the first run
    corpus = load_corpus("sst2", data_mirror=args.data_mirror, train_size=args.train_size, dev_size=args.dev_size,
                         seed=0)
    probe = LanguageModel(MODEL, tunable_layers=1)
    layers, tokenizer = probe.num_layers, probe.tokenizer
    # The very token ids ModelTrainer trains on (it finds them in the same folder) feed the recipe too.
    tokenized = tokenize_corpus(corpus, tokenizer, max_length=args.max_length,
                                cache_dir=args.cache_dir / "tokenized")
    lengths = tokenized["train"]["length"]
    print(f"{MODEL}: {layers} layers | SST-2 train {len(tokenized['train'])} (mean {np.mean(lengths):.1f} tokens), "
          f"dev {len(tokenized['dev'])} | {args.method.label()}, peft's default targets | batch {args.batch_size}, "
          f"lr {args.learning_rate}, max_length {args.max_length}, epochs {args.epochs}, torch threads "
          f"{torch.get_num_threads()} | load average {os.getloadavg()[0]:.2f}", flush=True)

    # A process's first training run pays one-off costs (thread pools, allocator growth): one small run per side.
    warm_corpus = load_corpus("sst2", data_mirror=args.data_mirror, train_size=64, dev_size=16, seed=0)
    warm = tokenize_corpus(warm_corpus, tokenizer, max_length=args.max_length, cache_dir=args.cache_dir / "tokenized")
    run_recipe(warm, tokenizer, "all", 0, args)
    run_layertune(warm_corpus, "all", 0, args, cache=False)

    # (a) LoRA on every layer: pairs A B, B A, ... with one seed per pair.
    print(f"\n(a) LoRA on all {layers} layers: {args.repeats} runs per side, in pairs A B, B A, ...", flush=True)
    pairs = []
    for repeat in range(args.repeats):
        sides = ("layertune", "recipe") if repeat % 2 == 0 else ("recipe", "layertune")
        done = {}
        for side in sides:
            done[side] = (run_layertune(corpus, "all", repeat, args, cache="auto") if side == "layertune"
                          else run_recipe(tokenized, tokenizer, "all", repeat, args))
        assert not done["layertune"]["cache"]["used"], "LoRA on all layers cannot use the cache"
        pairs.append(done)
        print(f"  seed {repeat} ({' '.join(sides)}): " + ", ".join(
            f"{side} {median(run['epoch_s']):.2f} s/epoch ({run['tokens']:,.0f} padded tokens)"
            f"{_steal_note(run['steal'])}" for side, run in done.items()), flush=True)
    runs = {side: [pair[side] for pair in pairs] for side in ("layertune", "recipe")}
    train_size = len(tokenized["train"])
    lora_all = {side: {"epoch_s": epoch_s(runs[side]), "samples_per_s": train_size / epoch_s(runs[side]),
                       "step_s": step_s(runs[side]),
                       "padded_tokens_per_s": tokens_per_s(runs[side]),
                       "epoch_s_runs": [t for run in runs[side] for t in run["epoch_s"]],
                       "padded_tokens": [run["tokens"] for run in runs[side]],
                       "batches": runs[side][0]["batches"], "trainable_parameters": runs[side][0]["trainable"]}
                for side in ("layertune", "recipe")}
    lora_all["throughput_ratio"] = lora_all["recipe"]["epoch_s"] / lora_all["layertune"]["epoch_s"]
    lora_all["paired_throughput_ratio"] = median([
        median(pair["recipe"]["epoch_s"]) / median(pair["layertune"]["epoch_s"]) for pair in pairs])
    lora_all["step_throughput_ratio"] = lora_all["recipe"]["step_s"] / lora_all["layertune"]["step_s"]
    lora_all["token_throughput_ratio"] = (lora_all["layertune"]["padded_tokens_per_s"]
                                          / lora_all["recipe"]["padded_tokens_per_s"])

    # (b) LoRA on the top K: the one-off cache build first (timed alone), then cached, uncached and the recipe.
    top_k = []
    for k in args.layers:
        build_s, keys = cache_build(tokenized, k, args)
        print(f"\n(b) LoRA on the top {k} of {layers}: cache build (train + dev, boundary {layers - k}) {build_s:.2f} s",
              flush=True)
        variants = {"cached": [], "uncached": [], "recipe": []}
        for repeat in range(args.top_k_repeats):
            order = list(variants) if repeat % 2 == 0 else list(reversed(variants))
            line = []
            for variant in order:
                if variant == "recipe":
                    run = run_recipe(tokenized, tokenizer, k, repeat, args)
                else:
                    run = run_layertune(corpus, k, repeat, args, cache="auto" if variant == "cached" else False)
                    assert run["cache"]["used"] == (variant == "cached"), run["cache"]
                    if variant == "cached":  # it read the entry built above: its epochs pay no build
                        assert [run["cache"]["train_entry"], run["cache"]["dev_entry"]] == keys, run["cache"]
                variants[variant].append(run)
                line.append(f"{variant} {median(run['epoch_s']):.2f} s{_steal_note(run['steal'])}")
            print(f"  seed {repeat}: " + ", ".join(line), flush=True)
        row = {"tunable_layers": k, "cache_build_s": build_s,
               **{f"{v}_epoch_s": epoch_s(r) for v, r in variants.items()},
               **{f"{v}_step_s": step_s(r) for v, r in variants.items()},
               **{f"{v}_trainable_parameters": r[0]["trainable"] for v, r in variants.items()},
               **{f"{v}_padded_tokens": median([run["tokens"] for run in r]) for v, r in variants.items()}}
        row["cached_to_lora_all"] = row["cached_epoch_s"] / lora_all["layertune"]["epoch_s"]
        row["uncached_to_lora_all"] = row["uncached_epoch_s"] / lora_all["layertune"]["epoch_s"]
        row["recipe_to_recipe_lora_all"] = row["recipe_epoch_s"] / lora_all["recipe"]["epoch_s"]
        row["cached_to_recipe"] = row["cached_epoch_s"] / row["recipe_epoch_s"]
        row["cached_to_uncached"] = row["cached_epoch_s"] / row["uncached_epoch_s"]
        saved = row["uncached_epoch_s"] - row["cached_epoch_s"]
        row["cache_break_even_epochs"] = build_s / saved if saved > 0 else None
        row["ideal"] = ideal_ratios(k, layers)
        top_k.append(row)

    report = {"model": MODEL, "layers": layers, "train_size": train_size, "dev_size": len(tokenized["dev"]),
              "batch_size": args.batch_size, "max_length": args.max_length, "learning_rate": args.learning_rate,
              "epochs_per_run": args.epochs, "method": args.method.model_dump(), "torch_threads":
              torch.get_num_threads(), "repeats": args.repeats, "top_k_repeats": args.top_k_repeats,
              "lora_all": lora_all, "top_k": top_k}
    print_report(report)
    report["cpu_steal"] = steal_fraction(cpu_start)
    report["machine"] = reference()
    report["wall_s"] = time.perf_counter() - started
    steal = "n/a" if report["cpu_steal"] is None else f"{100 * report['cpu_steal']:.0f}%"
    print(f"\nbenchmark wall time {report['wall_s']:.0f} s, load average now {os.getloadavg()[0]:.2f}, CPU steal "
          f"during the run {steal}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json}")
    return report


def print_report(report: dict) -> None:
    a, layers = report["lora_all"], report["layers"]
    print(f"\n(a) LoRA on all layers, median of {report['repeats']} runs per side:")
    print(f"  {'':10} {'epoch s':>8} {'samples/s':>10} {'padded tok/s':>13} {'step s':>7} {'trainable':>10}")
    for side in ("layertune", "recipe"):
        s = a[side]
        print(f"  {side:10} {s['epoch_s']:>8.2f} {s['samples_per_s']:>10.1f} {s['padded_tokens_per_s']:>13.0f} "
              f"{s['step_s']:>7.3f} {s['trainable_parameters']:>10,}")
    goal = a["throughput_ratio"] >= 0.95
    print(f"  layertune / recipe throughput: {a['throughput_ratio']:.3f}x (median of pairs "
          f"{a['paired_throughput_ratio']:.3f}x; per padded token {a['token_throughput_ratio']:.3f}x; per step, the "
          f"first left out, {a['step_throughput_ratio']:.3f}x) -> "
          f"{'PASS' if goal else 'FAIL'} (goal >= 0.95x)")
    print(f"\n(b) LoRA on the top K of {layers}: epoch s (median), and each over LoRA on all layers (same side); "
          "ideal in brackets")
    print(f"  {'K':>2} {'cached':>7} {'uncached':>9} {'recipe':>7} {'build s':>8} | {'cached/all':>15} "
          f"{'uncached/all':>15} {'recipe/all':>15} | {'cached/recipe':>16}")
    for row in report["top_k"]:
        ideal = row["ideal"]
        print(f"  {row['tunable_layers']:>2} {row['cached_epoch_s']:>7.2f} {row['uncached_epoch_s']:>9.2f} "
              f"{row['recipe_epoch_s']:>7.2f} {row['cache_build_s']:>8.2f} | "
              f"{row['cached_to_lora_all']:>6.3f} ({ideal['cached_to_all']:.3f}) "
              f"{row['uncached_to_lora_all']:>6.3f} ({ideal['uncached_to_all']:.3f}) "
              f"{row['recipe_to_recipe_lora_all']:>6.3f} ({ideal['uncached_to_all']:.3f}) | "
              f"{row['cached_to_recipe']:>7.3f} ({ideal['cached_to_recipe']:.3f})")


if __name__ == "__main__":
    main()
