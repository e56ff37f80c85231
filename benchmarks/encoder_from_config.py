"""A bert-base-sized encoder with random weights and all-MiniLM-L6-v2's tokenizer (the uncased WordPiece vocabulary
of bert-base-uncased), saved as a model folder: per step the same work as bert-base, for timing on a machine that no
pretrained weights of that size reach (the GPU machines here). Its dev scores mean nothing.

    python benchmarks/encoder_from_config.py /tmp/bert-base
    python benchmarks/frozen_prefix_speed.py --model /tmp/bert-base --task imdb ...
"""

from __future__ import annotations

import argparse
from pathlib import Path

import transformers

from layertune.model_paths import resolve_model_path


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--tokenizer", default="sentence-transformers/all-MiniLM-L6-v2",
                        help="a model name or folder whose tokenizer the encoder takes")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.folder.exists() and (not args.folder.is_dir() or any(args.folder.iterdir())):
        parser.error(f"{args.folder} exists and is not an empty folder: name a new one")
    tokenizer = transformers.AutoTokenizer.from_pretrained(resolve_model_path(args.tokenizer))
    config = transformers.BertConfig(vocab_size=len(tokenizer))  # bert-base: 12 layers of 768, 12 heads, 3072
    transformers.set_seed(args.seed)
    transformers.AutoModel.from_config(config).save_pretrained(args.folder)
    tokenizer.save_pretrained(args.folder)
    print(f"{args.folder}: {config.num_hidden_layers} layers of {config.hidden_size}, {len(tokenizer)} tokens")
    return args.folder


if __name__ == "__main__":
    main()
