"""One cell trained the common way, as `run_glue.py` users do: a new process, `transformers.Trainer`, the frozen part
marked ``requires_grad=False`` and nothing else (its dropout stays on, it runs every step), the model saved at the
end. The pipeline benchmark runs one of these per cell, side by side with `dvc repro` on the same grid.

    python benchmarks/common_cell.py --data data/02_prepared/ablation/sst2 --model sentence-transformers/all-MiniLM-L6-v2
        --tunable-layers 2 --seed 1 --output-dir /tmp/cell --learning-rate 2e-4 --head-learning-rate 3e-2 ...

It prints one JSON line: the dev score after the last epoch (as `run_glue.py --do_eval` scores, and as the study's
`eval_strategy: end` does) and the wall time.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

STARTED = time.perf_counter()

import datasets  # noqa: E402  (the imports are part of what a cell costs: timed from the start)
import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from scipy.stats import spearmanr  # noqa: E402

from layertune.layer_stack import encoder_layers  # noqa: E402  (the layer stack of any encoder)
from layertune.model_paths import resolve_model_path  # noqa: E402  (the same weights: offline here)


def score(prediction: transformers.EvalPrediction) -> dict[str, float]:
    if prediction.predictions.ndim == 1 or prediction.predictions.shape[-1] == 1:
        return {"spearmanr": float(spearmanr(prediction.label_ids, prediction.predictions.reshape(-1)).statistic)}
    return {"accuracy": float((prediction.predictions.argmax(-1) == prediction.label_ids).mean())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--data", type=Path, required=True, help="a prepared task: train.parquet, dev.parquet")
    parser.add_argument("--model", required=True)
    parser.add_argument("--tunable-layers", required=True)
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--output-dir", type=Path, required=True)
    parser.add_argument("--learning-rate", type=float, default=5e-5)
    parser.add_argument("--head-learning-rate", type=float)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--eval-batch-size", type=int, default=64)
    parser.add_argument("--max-length", type=int, default=128)
    parser.add_argument("--weight-decay", type=float, default=0.0)
    parser.add_argument("--warmup-ratio", type=float, default=0.0)
    args = parser.parse_args()

    data = {split: datasets.Dataset.from_parquet(str(args.data / f"{split}.parquet")) for split in ("train", "dev")}
    text = [c for c in data["train"].column_names if c != "label"]
    regression = data["train"].features["label"].dtype.startswith("float")
    tokenizer = transformers.AutoTokenizer.from_pretrained(resolve_model_path(args.model))
    data = {split: ds.map(lambda rows: tokenizer(*[rows[c] for c in text], truncation=True,
                                                 max_length=args.max_length), batched=True)
            for split, ds in data.items()}
    transformers.set_seed(args.seed)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(
        resolve_model_path(args.model), num_labels=1 if regression else 2)
    if args.tunable_layers != "all":
        tunable, layers = int(args.tunable_layers), encoder_layers(model)
        model.base_model.embeddings.requires_grad_(False)
        layers[: len(layers) - tunable].requires_grad_(False)
        if tunable == 0 and getattr(model.base_model, "pooler", None) is not None:
            model.base_model.pooler.requires_grad_(False)  # as layertune: the pooler tunes with the top layers
    # Two learning rates (encoder, head) and no decay on biases and norms, as the study trains; a user passes these
    # to Trainer as its optimizer.
    groups = []
    for in_encoder, rate in ((True, args.learning_rate), (False, args.head_learning_rate or args.learning_rate)):
        chosen = [p for n, p in model.named_parameters()
                  if p.requires_grad and n.startswith(model.base_model_prefix) == in_encoder]
        groups += [{"params": [p for p in chosen if p.dim() >= 2], "lr": rate, "weight_decay": args.weight_decay},
                   {"params": [p for p in chosen if p.dim() < 2], "lr": rate, "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW([g for g in groups if g["params"]])
    steps = args.epochs * math.ceil(len(data["train"]) / args.batch_size)
    scheduler = transformers.get_linear_schedule_with_warmup(optimizer, math.ceil(args.warmup_ratio * steps), steps)
    training = transformers.TrainingArguments(
        output_dir=str(args.output_dir), per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=args.eval_batch_size, num_train_epochs=args.epochs,
        eval_strategy="no", save_strategy="no", logging_strategy="epoch", report_to="none", seed=args.seed, disable_tqdm=True,
        max_grad_norm=1.0)
    trainer = transformers.Trainer(model=model, args=training, train_dataset=data["train"],
                                   eval_dataset=data["dev"], compute_metrics=score, optimizers=(optimizer, scheduler),
                                   data_collator=transformers.DataCollatorWithPadding(tokenizer))
    trainer.train()
    trainer.save_model()
    scores = trainer.evaluate()
    key = "eval_spearmanr" if regression else "eval_accuracy"
    print(json.dumps({"score": float(np.round(scores[key], 6)), "wall_s": time.perf_counter() - STARTED}))


if __name__ == "__main__":
    main()
