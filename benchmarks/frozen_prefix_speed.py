"""Frozen-prefix cache benchmark: the common recipe vs layertune without and with the cache, on real data.

For each number K of tunable layers (of L) it trains, in one process and with the same seeds, epochs, batch size,
learning rate and thread count:

(a) common   the usual recipe: `transformers.Trainer` + `AutoModelForSequenceClassification`, embeddings and the
             bottom L-K layers frozen with ``requires_grad=False`` (their dropout stays on), dynamic padding
             (`DataCollatorWithPadding`), evaluation each epoch, no checkpoints;
(b) uncached layertune, ``frozen_prefix_cache=False`` (frozen layers in eval mode, the default);
(c) cached   layertune, with the frozen prefix computed once (``FrozenPrefixCache``).

and reports per-epoch training time (evaluation excluded), total time, the dev metric, (c)/(a) against the ideal
3K/(L+2K), and the whole study (every K, every seed) for (a) and (c), where (c) pays one shared cache pass.

    python benchmarks/frozen_prefix_speed.py --json frozen_prefix_speed.json
    python benchmarks/frozen_prefix_speed.py --quick                  # a smoke run in a minute or two

See benchmarks/README.md for what each figure means and the figures measured.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import tempfile
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # machine_speed, beside this script, also when imported
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # read once, at import time: set before any Hugging Face import
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Idle OpenMP threads sleep instead of spinning: on a busy 2-core machine spinning threads slow training several
# times over (the pipeline's stages set the same). Read when torch loads, so set here; it applies to all three.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

from layertune import LanguageModel, ModelTrainer, TextClassifier, encoder_layers, load_corpus  # noqa: E402
from layertune.frozen_prefix import FrozenPrefixCache  # noqa: E402
from layertune.model_paths import resolve_model_path  # noqa: E402
from layertune.metrics import compute_metrics  # noqa: E402
from layertune.tokenization import tokenize_corpus  # noqa: E402
from layertune.training_config import (autocast_context, autocast_dtype, resolve_mixed_precision,  # noqa: E402
                                       synchronize)
from machine_speed import reference  # noqa: E402  (benchmarks/: the machine's reference figure)

MODEL = "sentence-transformers/all-MiniLM-L6-v2"
DEFAULTS = dict(train_size=2000, dev_size=None, epochs=1, seeds="0,1", layers="0,1,2,3,all")
QUICK = dict(train_size=64, dev_size=48, epochs=1, seeds="0,1", layers="0,1,all")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--model", default=MODEL, help="the encoder: a hub name or a folder (on a GPU with no weights "
                        "at hand, a bert-base-sized folder saved from its config gives the same work)")
    parser.add_argument("--task", default="sst2", choices=("sst2", "imdb"), help="SST-2 (short sentences) or IMDb "
                        "(reviews, up to 512 tokens)")
    parser.add_argument("--train-size", type=int, help=f"training examples (default {DEFAULTS['train_size']})")
    parser.add_argument("--dev-size", type=int, help="dev examples (default: the full dev set; SST-2: 872)")
    parser.add_argument("--epochs", type=int, help=f"epochs per run (default {DEFAULTS['epochs']})")
    parser.add_argument("--seeds", help=f"comma-separated seeds (default {DEFAULTS['seeds']})")
    parser.add_argument("--layers", help=f"tunable layers to compare (default {DEFAULTS['layers']})")
    parser.add_argument("--uncached-seeds", type=int, default=1,
                        help="run (b) with the first N seeds for K < all (K = all: every seed, it is (c) there)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--learning-rate", type=float, default=1e-4)
    parser.add_argument("--pooling", default="pooler", choices=("pooler", "cls", "mean"),
                        help="layertune pooling; 'pooler' is the head of AutoModelForSequenceClassification")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch threads, for all runs")
    parser.add_argument("--cache-dtypes", default="",
                        help="also train (c) with these cache dtypes, e.g. float32,bfloat16,float16")
    parser.add_argument("--group-by-length", action=argparse.BooleanOptionalAction, default=True,
                        help="also train (c) with length-grouped batches (as the pipeline does): speed, metric, "
                             "and the whole study that way")
    parser.add_argument("--interleaved-steps", type=int, default=0,
                        help="instead of whole runs, time N training steps of (a), (b), (c) taken in turn on the "
                             "same batches: per-step ratios that a changing machine load cannot skew")
    parser.add_argument("--data-mirror", default=os.environ.get("LAYERTUNE_DATA_MIRROR", "../shared/data"))
    parser.add_argument("--cache-dir", help="where tokenized data and cache entries go (default: a temporary folder)")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, for a smoke run")
    args = parser.parse_args(argv)
    for key, value in (QUICK if args.quick else DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.seeds = [int(s) for s in args.seeds.split(",")]
    args.layers = [k if k == "all" else int(k) for k in args.layers.split(",")]
    args.cache_dtypes = [d for d in args.cache_dtypes.split(",") if d]
    return args


# ---------------------------------------------------------------------------------------------------- the runs


class EpochTimer(transformers.TrainerCallback):
    """Training time per epoch; `Trainer` evaluates after ``on_epoch_end``, so evaluation is not counted."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def on_epoch_begin(self, args, state, control, **kwargs):
        self._started = time.perf_counter()

    def on_epoch_end(self, args, state, control, **kwargs):
        self.times.append(time.perf_counter() - self._started)


def accuracy(prediction: transformers.EvalPrediction) -> dict[str, float]:
    return {"accuracy": float((prediction.predictions.argmax(-1) == prediction.label_ids).mean())}


def run_common(tokenized: dict, tokenizer, k: int | str, seed: int, args: argparse.Namespace) -> dict:
    """(a): `transformers.Trainer`, frozen part marked ``requires_grad=False`` and nothing else."""
    transformers.set_seed(seed)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(resolve_model_path(args.model),
                                                                            num_labels=2)
    if k != "all":
        layers = encoder_layers(model)
        model.base_model.embeddings.requires_grad_(False)
        layers[: len(layers) - k].requires_grad_(False)
    timer = EpochTimer()
    with tempfile.TemporaryDirectory() as output_dir:
        training_args = transformers.TrainingArguments(
            output_dir=output_dir, per_device_train_batch_size=args.batch_size,
            per_device_eval_batch_size=args.batch_size, learning_rate=args.learning_rate,
            num_train_epochs=args.epochs, lr_scheduler_type="linear", warmup_steps=0, weight_decay=0.0,
            max_grad_norm=1.0, eval_strategy="epoch", save_strategy="no", logging_strategy="epoch",
            report_to="none", seed=seed, disable_tqdm=True, dataloader_num_workers=0, use_cpu=args.use_cpu,
            bf16=args.bf16,  # on a GPU, in bf16 autocast as ModelTrainer's mixed_precision="auto" trains
        )
        trainer = transformers.Trainer(
            model=model, args=training_args, train_dataset=tokenized["train"], eval_dataset=tokenized["dev"],
            data_collator=transformers.DataCollatorWithPadding(tokenizer), compute_metrics=accuracy,
            callbacks=[timer],
        )
        trainer.remove_callback(transformers.trainer_callback.PrinterCallback)  # it prints every log dict
        started, cpu = time.perf_counter(), cpu_times()
        trainer.train()
        total = time.perf_counter() - started
    scores = [log["eval_accuracy"] for log in trainer.state.log_history if "eval_accuracy" in log]
    return {"epoch_s": timer.times, "total_s": total, "metric": 100 * max(scores), "steal": steal_fraction(cpu)}


def run_layertune(corpus, k: int | str, seed: int, args: argparse.Namespace, cache: bool | str,
                  **arguments) -> dict:
    """(b) with ``cache=False``, (c) with ``cache=True``, and what ``cache="auto"`` decides: `ModelTrainer` exactly
    as a user calls it."""
    transformers.set_seed(seed)
    model = TextClassifier(LanguageModel(args.model, tunable_layers=k, pooling=args.pooling), 2)
    trainer = ModelTrainer(model, corpus, cache_dir=args.cache_dir)
    started, cpu = time.perf_counter(), cpu_times()
    result = trainer.train(progress=False, frozen_prefix_cache=cache, learning_rate=args.learning_rate,
                           batch_size=args.batch_size, epochs=args.epochs, seed=seed, **arguments)
    total = time.perf_counter() - started
    return {"epoch_s": [h["epoch_time_s"] for h in result.history], "total_s": total,
            "metric": 100 * result.best_metrics["eval_accuracy"],  # what (a) reports (IMDb's main metric is F1)
            "cached": result.frozen_prefix_cache["used"], "reason": result.frozen_prefix_cache["reason"],
            "steal": steal_fraction(cpu)}


def cache_pass(args: argparse.Namespace, tokenized: dict, boundaries: list[int], root: Path,
               dtype: str = "auto") -> tuple[float, float]:
    """Seconds for one forward pass of ``args.model`` on ``args.device`` (the GPU when there is one, as the
    pipeline's tokenize stage builds it) that fills every boundary in ``boundaries`` (train and dev splits), and the
    MiB its entries take on disk."""
    encoder = LanguageModel(args.model, tunable_layers=0)
    cache = FrozenPrefixCache(root, dtype=dtype, autocast=args.autocast, progress=False)
    started = time.perf_counter()
    keys = [key for split in ("train", "dev") for key in cache.build(encoder, tokenized[split], boundaries,
                                                                     device=args.device)]
    synchronize(torch.device(args.device))
    seconds = time.perf_counter() - started
    return seconds, sum(f.stat().st_size for key in keys for f in (root / key).iterdir()) / 2**20


# ---------------------------------------------------------------------------------------------------- reporting


def ideal_ratio(k: int | str, layers: int) -> float:
    """Forward ≈ 1 unit per layer, backward ≈ 2: cached K layers cost 3K, the common recipe L + 2K."""
    return 1.0 if k == "all" else 3 * k / (layers + 2 * k)


class _Lengths(torch.utils.data.Dataset):
    """Stands in for `Examples` in `make_loader`: a batch is its padded size in tokens."""

    def __init__(self, lengths: list[int]) -> None:
        self.lengths = lengths

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitems__(self, indices: list[int]) -> int:
        return max(self.lengths[i] for i in indices) * len(indices)


def padded_tokens(lengths: list[int], batch_size: int, group_by_length: bool, seed: int = 0) -> int:
    """Tokens an epoch processes after padding each batch to its longest example (layertune's own sampler)."""
    from layertune.batching import make_loader

    return sum(make_loader(_Lengths(lengths), batch_size, shuffle=True, seed=seed, group_by_length=group_by_length))


def median(values: list[float]) -> float:
    return statistics.median(values)


def mean(values: list[float]) -> float:
    return statistics.fmean(values)


def print_table(rows: list[dict], runs: dict) -> None:
    header = (f"{'K':>4} | {'epoch s: (a)':>12} {'(b)':>7} {'(c)':>7} | {'total s: (a)':>12} {'(b)':>7} "
              f"{'(c)+pass':>8} {'pass':>6} | {'(c)/(a)':>7} {'ideal':>6} | {'dev acc: (a)':>12} {'(b)':>6} "
              f"{'(c)':>6} | {'(b)/(a) thr':>11}")
    print(header)
    print("-" * len(header))
    for row in rows:
        k = row["tunable_layers"]
        total = {v: mean([r["total_s"] for r in runs[k][v]]) for v in ("common", "uncached", "cached")}
        print(f"{k!s:>4} | {row['common_epoch_s']:>12.2f} {row['uncached_epoch_s']:>7.2f} "
              f"{row['cached_epoch_s']:>7.2f} | {total['common']:>12.1f} {total['uncached']:>7.1f} "
              f"{total['cached'] + row['cache_pass_s']:>8.1f} {row['cache_pass_s']:>6.1f} | "
              f"{row['cached_epoch_s'] / row['common_epoch_s']:>7.3f} {row['ideal_ratio']:>6.3f} | "
              f"{row['common_metric']:>12.2f} {row['uncached_metric']:>6.2f} {row['cached_metric']:>6.2f} | "
              f"{row['common_epoch_s'] / row['uncached_epoch_s']:>11.3f}")


def paired_metric_gap(runs: dict, k) -> float:
    """Mean dev-metric difference (c) - (b) over the seeds both ran."""
    uncached = {r["seed"]: r["metric"] for r in runs[k]["uncached"]}
    return mean([r["metric"] - uncached[r["seed"]] for r in runs[k]["cached"] if r["seed"] in uncached])


def check_targets(rows: list[dict], study: dict, runs: dict) -> list[tuple[str, bool, str]]:
    """The issue's targets, each with the measured figure."""
    checks = []
    for row in rows:
        k, ratio = row["tunable_layers"], row["cached_epoch_s"] / row["common_epoch_s"]
        if k == "all":
            throughput = row["common_epoch_s"] / row["uncached_epoch_s"]
            checks.append(("K=all: (b) throughput >= 0.95x (a)", throughput >= 0.95, f"{throughput:.3f}x"))
        elif k == 0:
            checks.append(("K=0: (c)/(a) < 0.05", ratio < 0.05, f"{ratio:.3f}"))
        else:  # faster than ideal is no failure: the common recipe also pays dropout in its frozen layers
            gap = ratio - row["ideal_ratio"]
            note = " (faster than ideal)" if gap < -0.1 else ""
            checks.append((f"K={k}: (c)/(a) within 0.1 of ideal {row['ideal_ratio']:.3f}", gap <= 0.1,
                           f"{ratio:.3f} ({gap:+.3f}){note}"))
        if k != "all":
            gap = paired_metric_gap(runs, k)
            checks.append((f"K={k}: dev metric (c) = (b) within 0.5 points (same seeds)", abs(gap) <= 0.5,
                           f"{gap:+.2f}"))
    by_k = {row["tunable_layers"]: row for row in rows}
    for row in rows:
        if "auto_epoch_s" in row:  # auto may decline the cache, never make a run slower than (b)
            slower = row["auto_epoch_s"] / row["uncached_epoch_s"]
            checks.append((f"K={row['tunable_layers']}: auto ({'cached' if row['auto_cached'] else 'uncached'}) "
                           "not slower than (b) beyond 5%", slower <= 1.05, f"{slower:.3f}"))
        if row["cache_pass_s"] and 0 in by_k:
            relative = row["cache_pass_s"] / by_k[0]["uncached_epoch_s"]
            checks.append((f"K={row['tunable_layers']}: one pass <= 1.5 uncached K=0 epochs", relative <= 1.5,
                           f"{relative:.2f}"))
    speedup = study["common_s"] / study["cached_s"]
    checks.append(("whole study (c), random batches as (a), >= 2x faster than (a)", speedup >= 2, f"{speedup:.2f}x"))
    if "cached_grouped_s" in study:
        speedup = study["common_s"] / study["cached_grouped_s"]
        checks.append(("whole study (c) with length-grouped batches >= 2x faster than (a)", speedup >= 2,
                       f"{speedup:.2f}x"))
    return checks


# ---------------------------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    with benchmark_setup(args, "frozen-prefix-bench-"):
        return benchmark(args)


@contextlib.contextmanager
def benchmark_setup(args: argparse.Namespace, prefix: str):
    """What every benchmark here runs under: ``--threads`` torch threads, the GPU when there is one, quiet
    libraries, and ``--cache-dir`` or a temporary cache folder removed afterwards."""
    import datasets

    torch.set_num_threads(args.threads)
    args.device = "cuda" if torch.cuda.is_available() else "cpu"
    args.use_cpu = args.device == "cpu"
    args.bf16 = args.device == "cuda" and torch.cuda.is_bf16_supported()
    # ModelTrainer's mixed_precision="auto" on this device: cache passes built outside it compute the same way
    args.autocast = autocast_dtype(resolve_mixed_precision("auto", args.device))
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    datasets.disable_progress_bars()
    temporary = None
    if args.cache_dir is None:
        temporary = args.cache_dir = tempfile.mkdtemp(prefix=prefix)
    args.cache_dir = Path(args.cache_dir)
    try:
        yield
    finally:
        if temporary:
            shutil.rmtree(temporary, ignore_errors=True)


def cpu_times() -> tuple[int, int] | None:
    """(steal, total) jiffies of all CPUs from /proc/stat (Linux), or None."""
    try:
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    return fields[7] if len(fields) > 7 else 0, sum(fields[:8])


def steal_fraction(since: tuple[int, int] | None) -> float | None:
    """Share of CPU time the hypervisor gave to other machines since ``since``: timings are only comparable
    between runs with little steal (the side-by-side ratios are, since steal hits all variants alike)."""
    now = cpu_times()
    if since is None or now is None or now[1] == since[1]:
        return None
    return (now[0] - since[0]) / (now[1] - since[1])


def _steal_note(steal: float | None) -> str:
    return f" (steal {100 * steal:.0f}%)" if steal is not None and steal >= 0.05 else ""


def benchmark(args: argparse.Namespace) -> dict:
    started, cpu_start = time.perf_counter(), cpu_times()
    compute_metrics(("accuracy",), [0, 1], [0, 1])  # one-time imports (scipy) out of the first run
    corpus = load_corpus(args.task, data_mirror=args.data_mirror, train_size=args.train_size, dev_size=args.dev_size,
                         seed=0)
    probe = LanguageModel(args.model, tunable_layers=0)
    layers, tokenizer = probe.num_layers, probe.tokenizer
    # The same tokenized splits feed all three; ModelTrainer finds them in its cache folder, as in the pipeline.
    tokenized = tokenize_corpus(corpus, tokenizer, cache_dir=args.cache_dir / "tokenized")
    lengths = tokenized["train"]["length"]
    print(f"{args.model}: {layers} layers | {args.task} train {len(tokenized['train'])}, dev {len(tokenized['dev'])} "
          f"(mean {np.mean(lengths):.1f} tokens) | epochs {args.epochs}, seeds {args.seeds}, batch {args.batch_size},"
          f" lr {args.learning_rate}, torch threads {torch.get_num_threads()} | load average "
          f"{os.getloadavg()[0]:.2f}", flush=True)

    # A process's first training run pays one-off costs (thread pools, allocator growth, kernel selection): 37 s
    # instead of 19 s for an (a) epoch once. Warm both trainers up so that no measured run pays them.
    warm_corpus = load_corpus(args.task, data_mirror=args.data_mirror, train_size=64, dev_size=32, seed=0)
    warm = tokenize_corpus(warm_corpus, tokenizer, cache_dir=args.cache_dir / "tokenized")
    run_common(warm, tokenizer, "all", 0, args)
    run_layertune(warm_corpus, "all", 0, args, cache=False)

    # One pass fills every boundary the study needs, for train and dev: (c) of every K and seed reads it.
    boundaries = sorted({layers - k for k in args.layers if k != "all"})
    study_pass, cache_mb = (cache_pass(args, tokenized, boundaries, args.cache_dir / "frozen_prefix")
                            if boundaries else (0.0, 0.0))
    print(f"shared cache pass, boundaries {boundaries}: {study_pass:.1f} s, {cache_mb:.1f} MiB on disk (float32; a "
          f"run loads its boundary into RAM within FrozenPrefixCache's memory budget, memory-maps it beyond)",
          flush=True)
    setup = {"model": args.model, "task": args.task, "layers": layers, "train_size": len(tokenized["train"]),
             "device": torch.cuda.get_device_name() if args.device == "cuda" else f"CPU, {args.threads} threads"}
    if args.interleaved_steps:
        report = {**setup, "interleaved_steps": interleaved_steps(tokenized, tokenizer, layers, args),
                  "cpu_steal": steal_fraction(cpu_start)}
        if args.json:
            args.json.write_text(json.dumps(report, indent=2) + "\n")
        return report

    runs: dict = {}
    rows = []
    for k in args.layers:
        runs[k] = {"common": [], "uncached": [], "cached": [], "auto": [], "grouped": []}
        pass_s = 0.0
        if k != "all":  # what this K alone would pay for its cache: one pass to its boundary, train + dev
            with tempfile.TemporaryDirectory(dir=args.cache_dir) as root:
                pass_s, _ = cache_pass(args, tokenized, [layers - k], Path(root))
        for seed in args.seeds:  # interleaved, so that load and CPU steal hit all variants alike
            done = {"common": run_common(tokenized, tokenizer, k, seed, args)}
            if k == "all" or seed in args.seeds[: args.uncached_seeds]:
                done["uncached"] = run_layertune(corpus, k, seed, args, cache=False)
            if k == "all":  # "auto" cannot cache here and runs (b)'s path: (b) is (c)
                done["cached"] = done["uncached"]
            else:
                done["cached"] = run_layertune(corpus, k, seed, args, cache=True)
                if seed == args.seeds[0]:  # what "auto" decides here (the shared pass is paid), and its epoch
                    done["auto"] = run_layertune(corpus, k, seed, args, cache="auto")
            if args.group_by_length:  # (c) as the pipeline trains it: length-grouped batches
                done["grouped"] = run_layertune(corpus, k, seed, args, cache=k != "all", group_by_length=True)
            for variant, run in done.items():
                runs[k][variant].append({**run, "seed": seed})
            print(f"  K={k} seed={seed}: " + ", ".join(
                f"{v} {median(r['epoch_s']):.2f} s/epoch {r['metric']:.2f}{_steal_note(r['steal'])}"
                for v, r in done.items()), flush=True)
        row = {"tunable_layers": k}
        for variant in ("common", "uncached", "cached"):
            row[f"{variant}_epoch_s"] = median([t for r in runs[k][variant] for t in r["epoch_s"]])
        row["cache_pass_s"] = pass_s
        row["ideal_ratio"] = ideal_ratio(k, layers)
        if runs[k]["auto"]:
            row["auto_epoch_s"] = median([t for r in runs[k]["auto"] for t in r["epoch_s"]])
            row["auto_cached"] = all(r["cached"] for r in runs[k]["auto"])
            row["auto_reason"] = runs[k]["auto"][0]["reason"]
        for variant in ("common", "uncached", "cached"):
            row[f"{variant}_metric"] = mean([r["metric"] for r in runs[k][variant]])
        rows.append(row)

    study = {
        "common_s": sum(r["total_s"] for k in args.layers for r in runs[k]["common"]),
        "cached_s": study_pass + sum(r["total_s"] for k in args.layers for r in runs[k]["cached"]),
        "cache_pass_s": study_pass, "cache_mb": cache_mb,
    }
    report = {**setup, "results": rows, "study": study}

    print(f"\nper-epoch training time (median over seeds x {args.epochs} epochs), total = train + eval per run "
          f"(mean over seeds), dev accuracy (best epoch, mean over seeds); (b) ran seeds "
          f"{args.seeds[: args.uncached_seeds]} for K < all")
    print_table(rows, runs)
    print(f"\nwhole study (K in {args.layers}, seeds {args.seeds}): (a) {study['common_s']:.1f} s, (c) "
          f"{study['cached_s']:.1f} s incl. the shared cache pass {study_pass:.1f} s -> "
          f"{study['common_s'] / study['cached_s']:.2f}x")
    if "all" in args.layers and len(args.layers) > 1:  # K = all runs the same computation on both sides
        partial = [k for k in args.layers if k != "all"]
        common = sum(r["total_s"] for k in partial for r in runs[k]["common"])
        cached = study_pass + sum(r["total_s"] for k in partial for r in runs[k]["cached"])
        print(f"  without K=all: (a) {common:.1f} s, (c) {cached:.1f} s -> {common / cached:.2f}x; K=all alone: "
              f"(a) {study['common_s'] - common:.1f} s, (b) {study['cached_s'] - cached:.1f} s")

    if args.cache_dtypes:
        report["cache_dtypes"] = compare_cache_dtypes(corpus, tokenized, boundaries, args, runs)
    if args.group_by_length:
        report["group_by_length"] = compare_group_by_length(lengths, args, runs)
        study["cached_grouped_s"] = study_pass + sum(r["total_s"] for k in args.layers for r in runs[k]["grouped"])
        print(f"\nwhole study with length-grouped batches (the pipeline's train.group_by_length): (a) "
              f"{study['common_s']:.1f} s, (c) {study['cached_grouped_s']:.1f} s -> "
              f"{study['common_s'] / study['cached_grouped_s']:.2f}x")

    print("\ntargets:")
    for name, passed, figure in check_targets(rows, study, runs):
        print(f"  {'PASS' if passed else 'FAIL'}  {name}: {figure}")
    report["cpu_steal"] = steal_fraction(cpu_start)
    report["machine"] = reference()
    steal = "n/a" if report["cpu_steal"] is None else f"{100 * report['cpu_steal']:.0f}%"
    print(f"\nbenchmark wall time {time.perf_counter() - started:.0f} s, load average now "
          f"{os.getloadavg()[0]:.2f}, CPU steal during the run {steal}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json}")
    return report


def interleaved_steps(tokenized: dict, tokenizer, layers: int, args: argparse.Namespace) -> list[dict]:
    """Seconds per training step of (a), (b), (c), the three taken in turn (rotating order) on the same batches.

    Each step is what the training loops do per batch, under the whole runs' autocast (bf16 on a GPU), on the
    training device and timed to its end there: collate, forward, backward, clip, optimizer step. (a) is
    the Hugging Face model with its frozen part in train mode; (b) and (c) are layertune's model; all three use
    fused AdamW, the default of both `Trainer` and `ModelTrainer`. Loop overheads of the two
    trainers are left out: comparing with the whole-run figures shows what they cost.
    """
    from layertune.batching import Examples

    pad_id = tokenizer.pad_token_id or 0
    generator = torch.Generator().manual_seed(0)
    order = torch.randperm(len(tokenized["train"]), generator=generator).tolist() * (
        1 + args.interleaved_steps * args.batch_size // len(tokenized["train"]))
    batches = [order[i * args.batch_size : (i + 1) * args.batch_size] for i in range(args.interleaved_steps)]
    columns = [c for c in ("input_ids", "attention_mask", "token_type_ids", "labels")
               if c in tokenized["train"].column_names]
    rows = tokenized["train"].select_columns(columns)
    hf_collator = transformers.DataCollatorWithPadding(tokenizer)
    cache = FrozenPrefixCache(args.cache_dir / "frozen_prefix", autocast=args.autocast, progress=False)
    print(f"\ninterleaved steps: {len(batches)} batches of {args.batch_size}, (a) (b) (c) in turn; median s/step")
    results = []
    for k in args.layers:
        transformers.set_seed(0)
        common = transformers.AutoModelForSequenceClassification.from_pretrained(resolve_model_path(args.model),
                                                                                 num_labels=2)
        if k != "all":
            common.base_model.embeddings.requires_grad_(False)
            encoder_layers(common)[: layers - k].requires_grad_(False)
        steppers = {"common": _step_common(common.to(args.device), rows, hf_collator, args)}
        for variant in ("uncached", "cached"):
            if variant == "cached" and k == "all":
                continue
            model = TextClassifier(LanguageModel(args.model, tunable_layers=k, pooling=args.pooling), 2)
            states = None
            if variant == "cached":
                states, _ = cache.states(model.encoder, tokenized["train"], layers - k, device=args.device)
                states = states.to(args.device)
            # as ModelTrainer places them: tokens (and states) resident on the training device
            examples = Examples(tokenized["train"], pad_id, states).to(args.device)
            steppers[variant] = _step_layertune(model.to(args.device), examples, args)
        times = {variant: [] for variant in steppers}
        for step, batch in enumerate(batches):
            names = list(steppers)
            names = names[step % len(names):] + names[: step % len(names)]
            for name in names:
                started = time.perf_counter()
                with autocast_context(torch.device(args.device), args.autocast):  # as the whole runs train
                    steppers[name](batch)
                synchronize(torch.device(args.device))  # a GPU step has ended only when its kernels have
                times[name].append(time.perf_counter() - started)
        entry = {"tunable_layers": k, "ideal_ratio": ideal_ratio(k, layers),
                 **{f"{v}_step_s": median(t[1:]) for v, t in times.items()}}  # the first step warms up
        entry["cached_step_s"] = entry.get("cached_step_s", entry["uncached_step_s"])
        results.append(entry)
        print(f"  K={k}: (a) {entry['common_step_s']:.3f}  (b) {entry['uncached_step_s']:.3f}  (c) "
              f"{entry['cached_step_s']:.3f}  (c)/(a) {entry['cached_step_s'] / entry['common_step_s']:.3f} "
              f"(ideal {entry['ideal_ratio']:.3f})  (a)/(b) throughput "
              f"{entry['common_step_s'] / entry['uncached_step_s']:.3f}  load {os.getloadavg()[0]:.1f}",
              flush=True)
    return results


def _step_common(model, rows, collator, args: argparse.Namespace):
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.learning_rate,
                                  fused=True)

    def step(indices):
        batch = collator([rows[i] for i in indices]).to(args.device)  # collated on the host, as Trainer's loader does
        model(**batch).loss.backward()
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return step


def _step_layertune(model, examples, args: argparse.Namespace):
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.learning_rate,
                                  fused=True)

    def step(indices):
        batch = examples.batch(indices)
        model.loss(model(batch), batch["labels"]).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return step


def compare_cache_dtypes(corpus, tokenized: dict, boundaries: list[int], args: argparse.Namespace,
                         runs: dict) -> list[dict]:
    """Dev metric and epoch time of (c) with each storage dtype (float32 is the default already run)."""
    print("\ncache dtypes (K, dtype: epoch s, dev accuracy, difference to float32 with the same seeds):")
    for dtype in args.cache_dtypes:
        if dtype != "float32":
            seconds, _ = cache_pass(args, tokenized, boundaries, args.cache_dir / "frozen_prefix", dtype)
            print(f"  shared {dtype} cache pass: {seconds:.1f} s", flush=True)
    results = []
    for k in (k for k in args.layers if k != "all"):
        for dtype in args.cache_dtypes:
            if dtype == "float32":
                measured = runs[k]["cached"]
            else:
                measured = [run_layertune(corpus, k, seed, args, cache="auto", cache_dtype=dtype)
                            for seed in args.seeds]
            entry = {"tunable_layers": k, "dtype": dtype,
                     "epoch_s": median([t for r in measured for t in r["epoch_s"]]),
                     "metric": mean([r["metric"] for r in measured]),
                     "metric_delta": mean([r["metric"] - f["metric"] for r, f in zip(measured, runs[k]["cached"])])}
            results.append(entry)
            print(f"  K={k} {dtype:>8}: {entry['epoch_s']:.2f} s/epoch, {entry['metric']:.2f} "
                  f"({entry['metric_delta']:+.2f})", flush=True)
    return results


def compare_group_by_length(lengths: list[int], args: argparse.Namespace, runs: dict) -> dict:
    """Epoch time and dev metric of (c) with and without length-grouped batches (same seeds)."""
    random_tokens = padded_tokens(lengths, args.batch_size, False)
    grouped_tokens = padded_tokens(lengths, args.batch_size, True)
    print(f"\ngroup_by_length: padded tokens per epoch {random_tokens:,} -> {grouped_tokens:,} "
          f"(real {sum(lengths):,}); (K: epoch s random -> grouped, dev accuracy random -> grouped)")
    results = []
    for k in args.layers:
        grouped = runs[k]["grouped"]
        entry = {"tunable_layers": k,
                 "epoch_s": median([t for r in runs[k]["cached"] for t in r["epoch_s"]]),
                 "grouped_epoch_s": median([t for r in grouped for t in r["epoch_s"]]),
                 "metric": mean([r["metric"] for r in runs[k]["cached"]]),
                 "grouped_metric": mean([r["metric"] for r in grouped])}
        results.append(entry)
        print(f"  K={k}: {entry['epoch_s']:.2f} -> {entry['grouped_epoch_s']:.2f} s/epoch "
              f"({entry['grouped_epoch_s'] / entry['epoch_s']:.2f}x), {entry['metric']:.2f} -> "
              f"{entry['grouped_metric']:.2f}", flush=True)
    return {"padded_tokens": random_tokens, "grouped_padded_tokens": grouped_tokens, "real_tokens": sum(lengths),
            "results": results}


if __name__ == "__main__":
    main()
