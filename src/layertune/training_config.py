"""`TrainingConfig`: every argument of `ModelTrainer.train`, as one typed, checked object.

Kept free of torch so that checking a study's parameters (the plan stage) costs milliseconds, not seconds.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveFloat, PositiveInt, field_validator, model_validator

if TYPE_CHECKING:
    import torch


class TrainingConfig(BaseModel):
    """Every argument of `ModelTrainer.train`, checked once before any work: an unknown, mistyped or non-finite
    value is named in the error. The study's ``training`` sections are this model too, so the library and
    params.yaml accept exactly the same values."""

    # strict: "16" is not an int and "1e-3" is not a float (YAML 1.1 reads an exponent without a dot as a string).
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, allow_inf_nan=False)

    learning_rate: float | list[float] = Field(5e-5, description="one rate, or one per encoder of a MultiEncoder")
    # Measured with the other defaults (3 epochs, batch 16; 500 SST-2 sentences, MiniLM-L3/L6): the head alone
    # reaches 73-75 % dev accuracy at 3e-3, 55-73 % at 1e-3 and stays near chance at the encoders' 5e-5; with one or
    # all layers training, 3e-3 scores as well as 1e-3 and 5e-5 (SST-2), or better (STS-B).
    head_learning_rate: float | None = Field(
        3e-3, gt=0, description="the head's own rate (and a MultiEncoder's combination layer's); default 3e-3: new, "
        "randomly initialised weights need larger steps than pretrained ones, and 3e-3 lets the head alone learn in "
        "a few hundred steps while doing no harm when layers train too; null: learning_rate")
    batch_size: PositiveInt = Field(16, description="examples per forward pass, over all processes together (each "
                                    "of N data-parallel processes takes batch_size / N)")
    gradient_accumulation_steps: PositiveInt = Field(
        1, description="forward passes per optimizer step: a step sees batch_size x this many examples")
    eval_batch_size: PositiveInt | None = Field(None, description="default: batch_size")
    epochs: PositiveInt = Field(3, le=100_000, description="passes over the training data; with "
                                "early_stopping_patience, the most it may take (at most 100,000: more is a typo, not a "
                                "study)")
    eval_strategy: Literal["epoch", "end"] = Field(
        "epoch", description="score the selection split (the corpus's validation slice, else dev) after every epoch, "
                             "or only after the last")
    # Stopping and selection under transformers' names (TrainingArguments, EarlyStoppingCallback). They select on the
    # corpus's validation slice (carved from train), never on dev: dev is scored once, with the weights kept.
    early_stopping_patience: PositiveInt | None = Field(
        None, description="stop once the selection metric has not improved for this many epochs in a row (needs a "
                          "validation slice and eval_strategy: epoch); null: train every epoch")
    metric_for_best_model: str | None = Field(
        None, description="the metric that picks the best epoch and stops early: one of the task's metrics, or loss "
                          "(lower is better); null: the task's main metric")
    load_best_model_at_end: bool = Field(
        True, description="end with the weights of the best-scored epoch (the default here, unlike transformers'); "
                          "false: the last epoch's")
    shuffle_data: bool = Field(True, description="a new order of the training examples each epoch (from the seed)")
    weight_decay: float = Field(0.0, ge=0, description="AdamW's, on every weight but biases and LayerNorms")
    warmup_ratio: float = Field(0.0, ge=0, le=1, description="share of the steps the learning rate warms up over, "
                                                             "then decays linearly to 0")
    max_grad_norm: float | None = Field(1.0, gt=0, description="gradient clipping; null: none")
    seed: int = Field(42, description="every random start of the run: new weights, data order, dropout")
    group_by_length: bool = Field(False, description="batch examples of similar length together (faster; shuffled "
                                                     "within and across groups)")
    frozen_prefix_cache: bool | Literal["auto"] = Field(
        "auto", description="train the top layers from cached states of the frozen ones: true (where exact), false, "
        "or auto: where exact and estimated cheaper on this device, pass included (the run records why)")
    cache_dtype: Literal["auto", "float32", "float16", "bfloat16"] = Field(
        "auto", description="how cached states are stored; auto: as the frozen layers hand them on (exact); float16 "
        "or bfloat16 halve float32 states at a rounding cost")
    cache_memory_mb: PositiveFloat | None = Field(
        None, description="at most this many MiB of cached states on the training device; null: what it has free "
        "after the model and its training state (beyond it, states stay in host memory)")
    max_length: PositiveInt | None = Field(None, description="truncation length; default: the task's")
    mixed_precision: Literal["auto", "no", "fp16", "bf16"] = Field(
        "auto", description="autocast: auto is bf16 on a GPU that has it (else fp16) and on a CPU that computes it "
        "natively (AVX-512 BF16 or AMX; else float32); no: float32; bf16 or fp16: asked for (bf16 on a CPU without "
        "it is an error)")

    @property
    def head_rate(self) -> float:
        """The head's rate: ``head_learning_rate``, else the encoders' (the largest, where each has its own)."""
        rates = self.learning_rate if isinstance(self.learning_rate, list) else [self.learning_rate]
        return self.head_learning_rate or max(rates)

    def learning_rates(self, language_models: Sequence[str]) -> LearningRates:
        """The rates of a run whose encoder holds ``language_models`` (their names, in order): ``learning_rate``
        read once, the only place that tells one rate from a list of them. A list has one rate per language model;
        a single rate is each one's."""
        count = len(language_models)
        if not isinstance(self.learning_rate, list):
            return LearningRates((self.learning_rate,) * count, self.head_rate)
        if len(self.learning_rate) != count:
            raise ValueError(
                f"Got {len(self.learning_rate)} learning rates {self.learning_rate} for {count} language models "
                f"({', '.join(language_models)}): give one rate per language model, in the same order, or a single "
                "float for all.")
        return LearningRates(tuple(self.learning_rate), self.head_rate)

    @field_validator("mixed_precision", mode="before")
    @classmethod
    def _yaml_no(cls, value):
        """``mixed_precision: no`` unquoted is YAML 1.1's false (DVC writes it so from ``-S ...='no'``): float32."""
        return "no" if value is False else value

    @model_validator(mode="after")
    def _stopping_needs_scores(self) -> TrainingConfig:
        if self.early_stopping_patience is not None and self.eval_strategy != "epoch":
            raise ValueError(f"early_stopping_patience={self.early_stopping_patience} needs a score after every epoch:"
                             f" eval_strategy must be 'epoch', not {self.eval_strategy!r}")
        return self

    @property
    def selects_best(self) -> bool:
        """Whether the run keeps the weights of its best-scored epoch (several epochs scored, the best kept)."""
        return self.load_best_model_at_end and self.eval_strategy == "epoch"

    @field_validator("learning_rate")
    @classmethod
    def _positive_rates(cls, value):
        rates = value if isinstance(value, list) else [value]
        if not rates or any(r <= 0 for r in rates):
            raise ValueError(f"learning rates must be positive; got {value!r}")
        return value


@dataclass(frozen=True)
class LearningRates:
    """A run's learning rates, resolved once (`TrainingConfig.learning_rates`): one per language model of its encoder,
    in order, and the head's (a `MultiEncoder`'s combination layer's too: new weights, like the head)."""

    language_models: tuple[float, ...]
    head: float


def encoder_rates(rates: list[float]) -> float | list[float]:
    """``learning_rate`` for language models with ``rates``: one rate where they agree, else one per model."""
    return rates[0] if len(set(rates)) == 1 else list(rates)


def cache_decision(frozen_prefix_layers: int | None, frozen_dropout: bool, setting: bool | str,
                   method: str = "top_k") -> tuple[bool, str]:
    """Whether training from cached states is exact for an encoder with ``frozen_prefix_layers`` frozen (None:
    every layer is tuned) by ``method`` (`layertune.tuning_methods`), and why (recorded in the run's metadata).
    ``setting`` True insists, and fails where the cache cannot be exact; "auto" uses it where it can; False never.

    Every method leaves the embeddings and the layers below the top K untouched, so it trains exactly from their
    cached output; a method on every layer (LoRA, IA3 or BitFit with tunable_layers='all') leaves no layer's output
    fixed."""
    if setting is False:
        return False, "disabled by frozen_prefix_cache=False"
    if frozen_prefix_layers is None:
        if method == "top_k":
            reason = "every layer trains (tunable_layers='all'): nothing is frozen"
        else:
            reason = (f"{method} changes every layer (tunable_layers='all'), so no layer's output is fixed; {method} "
                      "on the top K layers (tunable_layers=K) trains from the cached states of the layers below")
    elif frozen_dropout:
        reason = "frozen layers keep train-mode dropout (frozen_dropout=True), so their output changes each step"
    else:
        return True, f"embeddings and the bottom {frozen_prefix_layers} layers computed once"
    if setting is True:
        raise ValueError(f"frozen_prefix_cache=True cannot be honoured: {reason}. Use 'auto' or False.")
    return False, reason


def training_device() -> torch.device:
    """Where `ModelTrainer` trains (and the probes compute their features): the GPU when there is one, else the CPU."""
    import torch

    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def resolve_mixed_precision(setting: str, device_type: str) -> str:
    """``mixed_precision`` as accelerate takes it: "auto" is bf16 on a GPU that has it, else fp16 on a GPU; on a CPU
    bf16 where it computes bfloat16 natively (`cpu_has_native_bf16`: 1.5-2x float32's speed there), else "no"
    (emulated, autocast is slower than float32). The cache pass computes under the same. bf16 asked for on a CPU
    without it is an error: it would run, slower than float32, and round like no float32 run."""
    if device_type == "cuda":
        import torch

        if setting == "auto":
            return "bf16" if torch.cuda.is_bf16_supported() else "fp16"
        return setting
    if setting == "auto":
        return "bf16" if cpu_has_native_bf16() else "no"
    if setting == "bf16" and not cpu_has_native_bf16():
        raise ValueError("mixed_precision='bf16': this CPU has no native bfloat16 (AVX-512 BF16 or AMX), where it "
                         "would train slower than float32; use 'auto' (float32 here) or 'no'.")
    return setting


def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes bfloat16 matrix products natively (AVX-512 BF16 or AMX tiles), as torch reports it."""
    import torch

    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(getattr(torch.cpu, probe, lambda: False)() for probe in probes)


def autocast_dtype(mixed_precision: str):
    """The dtype autocast computes in for a resolved ``mixed_precision`` (None for "no")."""
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(mixed_precision)


@contextlib.contextmanager
def placed_on(module, device):
    """``module`` on ``device`` (a torch.device) inside the block, where it was afterwards: for work that computes on
    the training device before training moves the model there (the frozen-prefix pass, its cost estimate). The
    whole block, not only its forward loop: every tensor it builds lives on ``device``."""
    original = next(module.parameters()).device
    module.to(device)
    try:
        yield module
    finally:
        module.to(original)


def synchronize(device) -> None:
    """Wait for the work queued on ``device`` (a torch.device): a GPU computes asynchronously, so a clock read before
    this times the launch, not the work. A no-op on the CPU."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextlib.contextmanager
def autocast_context(device, dtype):
    """What every forward of a run on ``device`` (a torch.device) computing in ``dtype`` (None: float32) runs under:
    training steps, scoring, the frozen-prefix pass and its cost estimate, the probes. One context for all, so that
    cached states are what an uncached run computes.

    Autocast to ``dtype``, as accelerate enters it around each forward; and on a CPU in bfloat16, the math
    scaled-dot-product attention kernel: torch 2.13's fused (flash) CPU kernel is quick forward, but its bfloat16
    backward is about 12x slower than its float32 one (all-MiniLM-L6-v2, 16 x 40 tokens: 15.3 ms a layer against
    1.2), which made a bf16 training step no faster than a float32 one; the math kernel's batched products run on the
    CPU's bf16 units (benchmarks/README.md, "float32 against bfloat16"). Every other device and precision attends as
    torch chooses."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with contextlib.ExitStack() as stack:
        if dtype is not None:
            stack.enter_context(torch.autocast(device.type, dtype=dtype))
        if device.type == "cpu" and dtype == torch.bfloat16:
            stack.enter_context(sdpa_kernel([SDPBackend.MATH]))
        yield
