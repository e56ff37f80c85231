"""`ModelTrainer`: fine-tune a task model on a corpus until its validation slice stops improving, keeping the best
epoch's weights."""

from __future__ import annotations

import contextlib
import logging
import math
import resource
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
import pandas as pd
import torch
import transformers
from accelerate import Accelerator
from pydantic import ValidationError
from tqdm.auto import tqdm

from layertune import distributed, host_memory, timing
from layertune.batching import batch_to, make_loader
from layertune.corpus import Corpus
from layertune.drift import parameter_drift
from layertune.errors import choices_hint, describe_validation_error
from layertune.heads import TaskModel
from layertune.io import check_output_directory, output_directory, write_json
from layertune.metrics import compute_metrics
from layertune.training_config import (
    TrainingConfig,
    autocast_context,
    autocast_dtype,
    resolve_mixed_precision,
    training_device,
)

logger = logging.getLogger(__name__)


@dataclass
class TrainingResult:
    """What a training run measured. ``history`` holds one record per epoch (with the selection split's scores,
    ``validation_*`` or ``eval_*``, where it was scored); ``best_metrics`` dev's scores (``eval_*``) of the weights
    kept, from ``best_epoch``; ``predictions`` their predictions and references per scored split (``dev``, and
    ``test`` where the corpus has labelled test data)."""

    history: list[dict]
    best_epoch: int
    best_metrics: dict[str, float]
    main_metric: str
    train_time_s: float
    samples_per_s: float
    peak_memory_mb: float
    trainable_parameters: int
    total_parameters: int
    frozen_prefix_cache: dict
    predictions: dict[str, dict[str, list]] = field(repr=False)
    test_metrics: dict[str, float] = field(default_factory=dict)
    drift: pd.DataFrame = field(default=None, repr=False)
    epochs_trained: int = 0
    stopped_by: str = "max_epochs"  # or "early_stopping": the selection metric stopped improving
    selection_split: str = "dev"  # what picked the best epoch: "validation" (carved from train) or "dev"
    selection_metric: str = ""  # the history's key it picked by, e.g. "validation_accuracy"
    mixed_precision: str = "no"  # what the run computed in: "bf16", "fp16" or "no" (float32)

    @property
    def best_score(self) -> float:
        return self.best_metrics[f"eval_{self.main_metric}"]

    def summary(self) -> dict:
        """Flat, JSON-ready final figures (no per-epoch history, predictions or drift table)."""
        data = asdict(self)
        for key in ("history", "drift", "best_metrics", "frozen_prefix_cache", "predictions", "test_metrics"):
            data.pop(key)
        return {**data, **self.best_metrics, **self.test_metrics,
                "frozen_prefix_cache_used": self.frozen_prefix_cache["used"]}

    def save(self, directory: str | Path, model: TaskModel) -> None:
        """The run's files in ``directory`` (which the caller makes atomic): ``metrics.json``, ``history.json``,
        ``predictions.json``, ``run_info.json``, ``drift.csv`` and the best model in ``model/``."""
        directory = Path(directory)
        write_json(directory / "metrics.json", self.summary())
        write_json(directory / "history.json", self.history)
        write_json(directory / "predictions.json", self.predictions)
        write_json(directory / "run_info.json", {"frozen_prefix_cache": self.frozen_prefix_cache})
        self.drift.to_csv(directory / "drift.csv", index=False, lineterminator="\n")
        model.save(directory / "model")


@dataclass(frozen=True)
class Selection:
    """What picks the best epoch and stops early: a split (the validation slice, else dev) and a metric on it."""

    split: str
    metric: str  # a key of `evaluate`'s scores less "eval_": "accuracy", "loss", ...

    @classmethod
    def of(cls, args: TrainingConfig, corpus: Corpus) -> Selection:
        """The selection of a run with ``args`` on ``corpus``; an impossible one is a ValueError naming why."""
        split = "validation" if corpus.validation is not None else "dev"
        if args.early_stopping_patience is not None and split == "dev":
            raise ValueError(f"early_stopping_patience={args.early_stopping_patience} stops on a validation slice "
                             f"carved from train, and {corpus.name!r} has none: load it with validation_size=N (a "
                             "study: data.validation_size), or leave early_stopping_patience unset. Dev is never "
                             "used to stop.")
        from layertune.corpora import METRICS_BY_TASK_TYPE

        metric = (args.metric_for_best_model or corpus.main_metric).removeprefix("eval_").removeprefix("validation_")
        # The scores `evaluate` names: the corpus's metrics, or what seqeval reports for tagging.
        valid = ("loss", *(METRICS_BY_TASK_TYPE[corpus.task_type] if corpus.task_type == "token_classification"
                           else corpus.metrics))
        if metric not in valid:
            raise ValueError(f"metric_for_best_model={args.metric_for_best_model!r} is not a metric of "
                             f"{corpus.name!r}.{choices_hint(metric, valid)}")
        return cls(split, metric)

    @property
    def key(self) -> str:
        """The history's key of the selection score."""
        return f"{'eval' if self.split == 'dev' else self.split}_{self.metric}"

    def named(self, scores: dict[str, float]) -> dict[str, float]:
        """`evaluate`'s scores (``eval_*``) under the selection split's prefix."""
        prefix = "eval" if self.split == "dev" else self.split
        return {f"{prefix}_{key.removeprefix('eval_')}": value for key, value in scores.items()}

    def improves(self, record: dict, best: dict) -> bool:
        """Strictly better (transformers' EarlyStoppingCallback with no threshold): loss lower, any metric higher.
        A NaN score is no score (Spearman's of constant predictions, a regressor's first epoch in bfloat16): it
        never improves, and any score improves on it; compared as numbers, a NaN first epoch would stay the best."""
        score, best_score = record[self.key], best[self.key]
        if math.isnan(score) or math.isnan(best_score):
            return math.isnan(best_score) and not math.isnan(score)
        return score < best_score if self.metric == "loss" else score > best_score


def training_arguments(args: TrainingConfig | None, arguments: dict) -> TrainingConfig:
    """``args`` as given, or keyword arguments checked into one; a bad value is a ValueError naming it."""
    if args is not None:
        if arguments:
            raise TypeError(f"Give a TrainingConfig or keyword arguments, not both (got {sorted(arguments)} too).")
        return args
    try:
        return TrainingConfig(**arguments)
    except ValidationError as error:
        raise ValueError("Invalid training arguments: " + "; ".join(describe_validation_error(error))) from None


class ModelTrainer:
    """Trains ``model`` on ``corpus``: ``ModelTrainer(model, corpus).train(learning_rate=5e-5, epochs=3)``.

    After `train`, ``trainer.optimizer`` is the optimizer it used (as in Hugging Face's ``Trainer``).

    Under ``accelerate launch --num_processes N`` the processes train together (data parallel): each takes
    ``batch_size / N`` examples of every batch, so a step sees the same ``batch_size`` examples as in one process
    and the learning-rate schedule is the same; dev and test are split between the processes and their scores
    gathered (each example once); only the main process writes ``output_dir``. Results match a one-process run
    up to float rounding, dropout noise and the last batch, which accelerate pads with the first examples.
    """

    def __init__(self, model: TaskModel, corpus: Corpus, *, cache_dir: str | Path | None = None) -> None:
        if model.task_type != corpus.task_type:
            raise ValueError(
                f"A {type(model).__name__} ({model.task_type}) cannot train on {corpus.name!r}, a "
                f"{corpus.task_type} corpus."
            )
        if corpus.task_type != "regression" and model.num_classes != corpus.num_classes:
            raise ValueError(f"The model has {model.num_classes} classes; {corpus.name!r} has {corpus.num_classes}.")
        _adopt_label_names(model, corpus)
        self.model = model
        self.corpus = corpus
        self.cache_dir = Path(cache_dir) if cache_dir else None
        self.optimizer: torch.optim.Optimizer | None = None

    def train(self, output_dir: str | Path | None = None, *, args: TrainingConfig | None = None,
              progress: bool = True, overwrite: bool = False, **arguments) -> TrainingResult:
        """Train, score the selection split after each epoch, stop once it stops improving (with
        ``early_stopping_patience``), restore the best epoch's weights, then score dev (and test) and report.

        The selection split is the corpus's validation slice (carved from train: ``validation_size``); dev is then
        scored once, by weights it did not choose. A corpus without one selects on dev, as before validation slices
        existed (its best score is slightly optimistic), and cannot stop early.

        Takes a `TrainingConfig` (``args=``) or its fields as keyword arguments. With ``output_dir``, writes
        the files of `TrainingResult.save` there, all at once at the end (an interrupted run leaves nothing). An
        existing ``output_dir`` is replaced only if it is empty, a previous output, or ``overwrite=True``; else
        `layertune.io.OutputDirectoryError` comes before training (see `layertune.io.check_output_directory`).
        """
        args = training_arguments(args, arguments)
        selection = Selection.of(args, self.corpus)  # a bad metric or a missing slice fails before any work
        if output_dir is not None:
            check_output_directory(output_dir, overwrite=overwrite)
        task_model = self.model  # `model` below may be wrapped for data-parallel training; this never is
        accelerator = _accelerator(args)
        if accelerator.device.type == "cpu":
            host_memory.keep_freed_blocks()  # a step reuses the buffers the last one freed: no page faults
        elif accelerator.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(accelerator.device)  # this run's peak, not the process's
        transformers.set_seed(args.seed)

        parameter_groups = self._parameter_groups(args)  # validates per-encoder rates before any heavy work
        # The new, untrained parts drawn from the seed, whatever the process drew before; before the frozen-prefix
        # cache, as a checkpoint's gaps may lie in the frozen layers.
        task_model.begin_training(args.seed, targets=self.corpus.train["label"]
                                  if self.corpus.task_type == "regression" else None)
        # On the training device before the frozen-prefix pass, which computes there (else it would move the encoder
        # there and back), and before the optimizer, which picks its (fused) kernel by parameter device.
        task_model.to(accelerator.device)
        splits, cache_info = self._examples(args, accelerator)
        train_loader, score_loaders = _loaders(splits, args, accelerator)

        self.optimizer = _adamw(parameter_groups, fused=accelerator.mixed_precision != "fp16")
        scheduler = _linear_schedule(self.optimizer, args, batches_per_epoch=len(train_loader))
        initial_state = {k: v.detach().cpu().clone() for k, v in _trainable_state(task_model).items()}  # for drift
        history, best, kept, kept_weights, kept_predictions = [], None, None, None, None
        epochs_without_improvement, stopped_by = 0, "max_epochs"
        train_time = 0.0
        with _prepared(accelerator, task_model, self.optimizer, train_loader, scheduler) as (
                model, optimizer, train_loader, scheduler):
            for epoch in range(1, args.epochs + 1):
                started = time.perf_counter()
                losses = self._train_epoch(model, train_loader, optimizer, scheduler, accelerator, args, epoch,
                                           progress)
                epoch_time = time.perf_counter() - started
                train_time += epoch_time
                timing.add("training", epoch_time)

                record = {"epoch": epoch, "train_loss": sum(losses) / len(losses), "epoch_time_s": epoch_time,
                          "train_samples_per_s": len(splits["train"]) / epoch_time,
                          "learning_rate": scheduler.get_last_lr()[0]}
                if args.eval_strategy == "epoch" or epoch == args.epochs:
                    scores, predictions = self.evaluate(score_loaders[selection.split], accelerator)
                    record.update(selection.named(scores))
                    improved = best is None or selection.improves(record, best)
                    best, epochs_without_improvement = ((record, 0) if improved
                                                        else (best, epochs_without_improvement + 1))
                    if improved or not args.load_best_model_at_end:  # the weights the run ends with, and their scores
                        kept, kept_predictions = record, predictions
                        if args.load_best_model_at_end:
                            kept_weights = {k: v.detach().clone() for k, v in _trainable_state(task_model).items()}
                history.append(record)
                logger.info("epoch %d: %s", epoch, {k: _shown(v) for k, v in record.items()})
                if args.early_stopping_patience and epochs_without_improvement >= args.early_stopping_patience:
                    stopped_by = "early_stopping"
                    break

        model = task_model
        if args.load_best_model_at_end:
            model.load_state_dict(kept_weights, strict=False)
        # Dev is scored once, by the weights kept, unless it did the selecting (a corpus without a validation slice).
        dev_scores, dev_predictions = (kept, kept_predictions) if selection.split == "dev" \
            else self.evaluate(score_loaders["dev"], accelerator)
        predictions, test_metrics = {"dev": dev_predictions}, {}
        if "test" in score_loaders:
            scores, predictions["test"] = self.evaluate(score_loaders["test"], accelerator)
            test_metrics = {f"test_{k.removeprefix('eval_')}": v for k, v in scores.items()}
        result = TrainingResult(
            history=history,
            best_epoch=kept["epoch"],
            best_metrics={k: v for k, v in dev_scores.items() if k.startswith("eval_")},
            main_metric=self.corpus.main_metric,
            train_time_s=train_time,
            samples_per_s=len(history) * len(splits["train"]) / train_time,
            peak_memory_mb=_peak_memory_mb(accelerator.device),
            trainable_parameters=sum(p.numel() for p in model.parameters() if p.requires_grad),
            total_parameters=sum(p.numel() for p in model.parameters()),
            frozen_prefix_cache=cache_info, predictions=predictions, test_metrics=test_metrics,
            drift=parameter_drift(model, initial_state),
            epochs_trained=len(history), stopped_by=stopped_by, selection_split=selection.split,
            selection_metric=selection.key, mixed_precision=accelerator.mixed_precision,
        )
        if output_dir is not None and accelerator.is_main_process:
            with output_directory(output_dir, overwrite=overwrite, written_by="ModelTrainer.train") as staging:
                result.save(staging, model)
        accelerator.wait_for_everyone()  # no process goes on before the outputs exist
        return result

    def predict(self, *, args: TrainingConfig | None = None, **arguments) -> dict[str, dict[str, list]]:
        """The model's predictions and the references on the corpus's scored splits (dev, and test if it has one),
        computed as `train` scores them: under the same autocast, longest examples first, from the frozen-prefix
        cache where the model has a frozen prefix (its entries are shared with training and with other models of
        the same boundary). ``args`` as for `train`: its truncation, batch size and cache settings count."""
        args = training_arguments(args, arguments)
        accelerator = _accelerator(args)
        scored = replace(self.corpus, validation=None)  # the slice picks epochs; nothing to predict there
        self.model.to(accelerator.device)
        splits, _ = self._examples(args, accelerator, scored)
        _, score_loaders = _loaders(splits, args, accelerator)
        return {split: self.evaluate(loader, accelerator)[1] for split, loader in score_loaders.items()}

    def _examples(self, args: TrainingConfig, accelerator: Accelerator, corpus: Corpus | None = None
                  ) -> tuple[dict, dict]:
        """Every split of ``corpus`` (default: the trainer's) tokenized, with the frozen prefix's cached states where
        the run uses them, on the training device (`layertune.frozen_prefix.prepare_examples`). The cache pass
        computes as training will, under its autocast; the main process fills the caches, the others then read
        them."""
        with accelerator.main_process_first():
            return self.model.encoder.prepare_examples(corpus or self.corpus, args, cache_dir=self.cache_dir,
                                                       device=accelerator.device,
                                                       autocast=autocast_dtype(accelerator.mixed_precision))

    def _train_epoch(self, model, train_loader, optimizer, scheduler, accelerator: Accelerator,
                     args: TrainingConfig, epoch: int, progress: bool) -> list[float]:
        """One pass over the training batches; returns each batch's loss. ``model`` may be accelerate's wrapper."""
        model.train()
        losses = []
        # disable=None: a bar on a terminal, none in logs (a DVC stage's output)
        bar = tqdm(train_loader, desc=f"epoch {epoch}/{args.epochs}", disable=None if progress else True, leave=False)
        dtype = autocast_dtype(accelerator.mixed_precision)
        for step, batch in enumerate(bar, start=1):
            # accumulate: the optimizer, schedule and (between processes) gradient exchange act on every
            # gradient_accumulation_steps-th batch and on the epoch's last; on the others these calls wait
            with accelerator.accumulate(model):
                with autocast_context(accelerator.device, dtype):
                    loss = self.model.loss(model(batch), batch["labels"])
                _check_finite(loss, epoch, step, args, accelerator)
                accelerator.backward(loss)
                if args.max_grad_norm and accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
            bar.set_postfix(loss=f"{losses[-1]:.4f}")
        return losses

    @torch.no_grad()
    @timing.compute("scoring")
    def evaluate(self, loader, accelerator: Accelerator) -> tuple[dict[str, float], dict[str, list]]:
        """Loss (the mean over all loss terms, whatever the batches) and the task's metrics, keys prefixed
        ``eval_`` as in Hugging Face; and the predictions and references in corpus order.

        In a data-parallel run ``loader`` holds this process's share; the shares are gathered, so every process
        returns the scores of the whole split."""
        model = self.model
        model.eval()
        total_loss, terms, predictions, references = 0.0, 0, {}, {}
        order = iter(loader.sampler)  # which examples each batch holds
        dtype = autocast_dtype(accelerator.mixed_precision)
        for batch in loader:
            batch = batch_to(batch, accelerator.device)
            with autocast_context(accelerator.device, dtype):
                outputs = model(batch)
                batch_terms = model.loss_terms(batch["labels"])
                total_loss += model.loss(outputs, batch["labels"]).item() * batch_terms
                terms += batch_terms
            for prediction, reference in zip(*model.metric_inputs(outputs.float(), batch["labels"])):
                index = next(order)
                predictions[index], references[index] = prediction, reference
        # Every process's share, in process order (one process: its own). Each share holds its examples once (see
        # `_loaders`), and no accelerate loader is being iterated here, so gather_for_metrics drops nothing.
        shards = accelerator.gather_for_metrics([(total_loss, terms, predictions, references)], use_gather_object=True)
        total_loss, terms = sum(s[0] for s in shards), sum(s[1] for s in shards)
        predictions = {i: p for s in shards for i, p in s[2].items()}
        references = {i: r for s in shards for i, r in s[3].items()}
        in_order = sorted(predictions)
        predictions, references = [predictions[i] for i in in_order], [references[i] for i in in_order]
        scores = compute_metrics(self.corpus.metrics, predictions, references)
        return ({"eval_loss": total_loss / max(terms, 1), **{f"eval_{k}": v for k, v in scores.items()}},
                {"predictions": predictions, "references": references})

    # ----------------------------------------------------------------------------------------------------------

    def _parameter_groups(self, args: TrainingConfig) -> list[dict]:
        """AdamW's groups: each language model's trainable parameters at its own rate, then the head's (and a
        `MultiEncoder`'s combination layer's) at the head's, as `TrainingConfig.learning_rates` resolves them."""
        language_models = self.model.encoder.language_models
        rates = args.learning_rates([lm.name for lm in language_models])
        groups = [group for lm, rate in zip(language_models, rates.language_models)
                  for group in _decay_groups(lm.parameters(), rate, args.weight_decay)]
        return groups + _decay_groups(self.model.head_parameters(), rates.head, args.weight_decay)


def _shown(value: float) -> float:
    """A value of the per-epoch log line to 4 significant digits: a learning rate of 5e-05 reads 5e-05, not the 0.0
    that 4 decimals make of it (history.json keeps every digit)."""
    return value if isinstance(value, int) else float(f"{value:.4g}")


def _decay_groups(parameters, learning_rate: float, weight_decay: float) -> list[dict]:
    """AdamW groups of the trainable ``parameters`` at ``learning_rate``; biases and norms (1-D tensors) get no
    weight decay."""
    trainable = [p for p in parameters if p.requires_grad]
    groups = [{"params": [p for p in trainable if p.dim() >= 2], "lr": learning_rate, "weight_decay": weight_decay},
              {"params": [p for p in trainable if p.dim() < 2], "lr": learning_rate, "weight_decay": 0.0}]
    return [group for group in groups if group["params"]]


def _adopt_label_names(model: TaskModel, corpus: Corpus) -> None:
    """A classifier built without label names takes the corpus's, so that the model it saves predicts names, not
    ids, after `from_pretrained`. Names it already has are kept; if they differ from the corpus's, say so."""
    if getattr(model, "label_names", False) is False or not corpus.label_names:
        return  # a regressor, or a corpus without names
    if model.label_names is None:
        model.label_names = list(corpus.label_names)
    elif list(model.label_names) != list(corpus.label_names):
        logger.warning("The model's label names %s differ from those of %r, %s, whose ids it trains on: its "
                       "predictions will be named by its own.", model.label_names, corpus.name,
                       list(corpus.label_names))


def _loaders(splits: dict, args: TrainingConfig, accelerator: Accelerator) -> tuple:
    """The training loader, and one loader per scored split (dev, test) holding this process's share."""
    train_loader = make_loader(splits["train"], args.batch_size, shuffle=args.shuffle_data, seed=args.seed,
                               group_by_length=args.group_by_length)
    # Scored splits are only scored, so their order is free: longest first, each batch padded to about its own
    # length (predictions are put back in corpus order). Each process scores its share.
    shard = (accelerator.process_index, accelerator.num_processes)
    score_loaders = {split: make_loader(examples, args.eval_batch_size or args.batch_size, longest_first=True,
                                        shard=shard)
                     for split, examples in splits.items() if split != "train"}
    return train_loader, score_loaders


def _linear_schedule(optimizer: torch.optim.Optimizer, args: TrainingConfig, batches_per_epoch: int):
    """Linear warm-up over ``warmup_ratio`` of the optimizer steps, then linear decay to zero."""
    total_steps = args.epochs * math.ceil(batches_per_epoch / args.gradient_accumulation_steps)
    return transformers.get_linear_schedule_with_warmup(optimizer, math.ceil(args.warmup_ratio * total_steps),
                                                        total_steps)


def _check_finite(loss: torch.Tensor, epoch: int, step: int, args: TrainingConfig,
                  accelerator: Accelerator) -> None:
    """A NaN or infinite loss poisons every weight it reaches: stop the run instead of saving a broken model.
    Between data-parallel processes the check is collective, so that all stop together (none waits forever)."""
    finite = torch.isfinite(loss.detach()).all()
    if accelerator.num_processes > 1:
        finite = accelerator.gather(finite.float().reshape(1)).min() > 0
    if not finite:
        raise FloatingPointError(
            f"The training loss became {loss.item()} at epoch {epoch}, step {step} (learning_rate="
            f"{args.learning_rate}, head_learning_rate={args.head_learning_rate}, mixed_precision="
            f"{args.mixed_precision!r}). Lower the learning rates, or check the labels for extreme values.")


def _adamw(parameter_groups: list[dict], fused: bool = True) -> torch.optim.AdamW:
    """AdamW with all tensors updated in one fused kernel where the device has one (`Trainer`'s default,
    ``adamw_torch_fused``): the same update, and on CPU about 4x faster than the per-tensor loop.

    Not with fp16: accelerate cannot tell that a fused step was skipped on overflow, and would advance the
    learning-rate schedule anyway (huggingface/accelerate#4242)."""
    if fused:
        try:
            return torch.optim.AdamW(parameter_groups, fused=True)
        except RuntimeError:  # a device or dtype without a fused kernel
            pass
    return torch.optim.AdamW(parameter_groups)


def _trainable_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Only trainable tensors can change, so only they need a copy to remember the best epoch."""
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    return {k: v for k, v in model.state_dict().items() if k in trainable}


@contextlib.contextmanager
def _prepared(accelerator: Accelerator, model, optimizer, loader, scheduler):
    """accelerate's ``prepare`` for the block. It wraps the model's own forward in the run's autocast first: after
    the block, however it ends (a finished run, an error or Ctrl-C, in the block or in ``prepare`` itself), the model
    computes as it was built (a model never wrapped is left as it is)."""
    try:
        yield accelerator.prepare(model, optimizer, loader, scheduler)
    finally:
        accelerator.unwrap_model(model, keep_fp32_wrapper=False)


def _accelerator(args: TrainingConfig) -> Accelerator:
    """A fresh Accelerator for each run. accelerate keeps one process-wide state, which refuses a second precision;
    like `transformers.TrainingArguments`, start from a clean one (the distributed setup, PartialState, is kept).

    split_batches: ``batch_size`` is what one step sees, whatever the number of processes (a cell's spec does not
    change with the machine). find_unused_parameters: a trainable tensor the forward pass skips (a pooler beside
    mean pooling) would otherwise stop DistributedDataParallel."""
    from accelerate import DataLoaderConfiguration
    from accelerate.state import AcceleratorState
    from accelerate.utils import DistributedDataParallelKwargs

    AcceleratorState._reset_state(reset_partial_state=False)
    processes = distributed.state().num_processes  # the process group, joined as this machine allows (CPU included)
    if args.batch_size % processes:
        raise ValueError(f"batch_size={args.batch_size} cannot be split between {processes} processes: use a "
                         f"multiple of {processes}.")
    device_type = training_device().type
    # non_blocking: batches gathered in pinned host memory (states beyond the GPU's budget) are copied ahead
    return Accelerator(mixed_precision=resolve_mixed_precision(args.mixed_precision, device_type),
                       gradient_accumulation_steps=args.gradient_accumulation_steps,
                       dataloader_config=DataLoaderConfiguration(split_batches=True, non_blocking=True),
                       kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=True)])


def _peak_memory_mb(device: torch.device) -> float:
    """On a GPU, this run's peak (`ModelTrainer.train` resets the count); on a CPU, the process's peak resident memory
    so far (Linux reports KiB), which includes the runs it made before: it cannot be reset per run."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
