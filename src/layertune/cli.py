"""Command line: ``layertune train-cell --task sst2 --model all-MiniLM-L6-v2 --tunable-layers 2 --seed 1 ...``."""

from __future__ import annotations

import argparse
import json
import logging
import sys

from pydantic import ValidationError


def _layers(value: str) -> int | str:
    return value if value == "all" else int(value)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="layertune", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    cell = commands.add_parser("train-cell", help="train one (task, model, tunable_layers, seed) cell")
    cell.add_argument("--task", required=True, help="cola, sst2, mrpc, rte, stsb, imdb, or a HF dataset name")
    cell.add_argument("--config", help="dataset config, e.g. --task glue --config mrpc")
    cell.add_argument("--model", required=True, help="local folder, packaged model or Hugging Face hub id")
    cell.add_argument("--tunable-layers", type=_layers, default="all", help="0 … L, or 'all'")
    cell.add_argument("--seed", type=int, default=42)
    cell.add_argument("--output-dir", required=True)
    cell.add_argument("--train-size", type=int)
    cell.add_argument("--dev-size", type=int)
    cell.add_argument("--pooling", default="cls")
    cell.add_argument("--learning-rate", type=float, default=5e-5)
    cell.add_argument("--head-learning-rate", type=float)
    cell.add_argument("--batch-size", type=int, default=16)
    cell.add_argument("--epochs", type=int, default=3)
    cell.add_argument("--weight-decay", type=float, default=0.0)
    cell.add_argument("--warmup-ratio", type=float, default=0.0)
    cell.add_argument("--max-length", type=int)
    cell.add_argument("--no-frozen-prefix-cache", action="store_true", help="always run the frozen layers")
    cell.add_argument("--data-mirror", help="local data folder (default: $LAYERTUNE_DATA_MIRROR)")
    cell.add_argument("--cache-dir", help="tokenized-data and frozen-prefix cache (default: $LAYERTUNE_CACHE)")
    return parser


def main(argv: list[str] | None = None) -> int:
    from layertune.cell import CorpusSpec, EncoderSpec, run_cell
    from layertune.trainer import TrainingArguments

    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        corpus = CorpusSpec(task=args.task, config=args.config, train_size=args.train_size, dev_size=args.dev_size)
        encoder = EncoderSpec(model=args.model, tunable_layers=args.tunable_layers, pooling=args.pooling)
        training = TrainingArguments(
            learning_rate=args.learning_rate, head_learning_rate=args.head_learning_rate,
            batch_size=args.batch_size, epochs=args.epochs, weight_decay=args.weight_decay,
            warmup_ratio=args.warmup_ratio, seed=args.seed, max_length=args.max_length,
            frozen_prefix_cache=False if args.no_frozen_prefix_cache else "auto",
        )
        result = run_cell(corpus, encoder, training, args.output_dir, data_mirror=args.data_mirror,
                          cache_dir=args.cache_dir)
    except (ValueError, ValidationError, OSError) as error:
        print(f"layertune: error: {error}", file=sys.stderr)
        return 2
    print(json.dumps(result.summary(), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
