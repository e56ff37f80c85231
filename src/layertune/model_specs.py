"""The recipe of a task model's parts, typed and checked: a language model (`EncoderSpec`), how several are
combined (`CombineSpec`), the head (`HeadSpec`).

Each spec has exactly the arguments of the object it describes, builds it (`EncoderSpec.build`) and is read back from
a built one (`EncoderSpec.of`, `CombineSpec.of`): it is also what a saved model's ``config.json`` holds
(`layertune.persistence`). From an `EncoderSpec` alone a plan knows which frozen-prefix cache entry a run will read
(`cache_boundary`). A cell's recipe puts them together with its data and training (`layertune.specs`).

Imports no torch: checking a study's parameters stays fast.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, NonNegativeFloat, PositiveInt, model_validator

from layertune.model_paths import model_layers
from layertune.training_config import cache_decision
from layertune.tuning_methods import TopK, TuningMethod

if TYPE_CHECKING:
    from torch import nn


class Spec(BaseModel):
    """Strict like `TrainingConfig`: no unknown keys, no strings for numbers, no NaN."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, allow_inf_nan=False)


def _tunable_layers(value: int | str) -> int | str:
    if value != "all" and value < 0:
        raise ValueError(f"tunable_layers must be 'all' or an int >= 0; got {value}")
    return value


# How many top layers train: checked here, once, wherever a spec or a study holds it (a model's own layer count is
# checked by `LanguageModel`, which knows it).
TunableLayers = Annotated[int | Literal["all"], AfterValidator(_tunable_layers)]


class EncoderSettings(Spec):
    """Every argument of `LanguageModel` besides the model and its tunable layers."""

    pooling: Literal["cls", "mean", "pooler"] | None = Field(
        None, description="cls, mean or pooler; null: the model's own (a sentence-transformers pooling config), else "
                          "cls")
    hidden_dropout_prob: float | None = Field(None, ge=0, lt=1, description="null: the checkpoint's")
    freeze_embeddings: bool = Field(False, description="keep the embeddings fixed even with tunable_layers all")
    frozen_dropout: bool = Field(False, description="dropout in the frozen layers too (default: eval mode there)")
    trust_remote_code: bool = Field(False, description="run code that ships with the model (only if you trust it)")
    revision: str | None = Field(None, description="the model's commit, branch or tag on the hub")
    layers: str | None = Field(None, description="dotted path of the transformer layer stack (an nn.ModuleList, e.g. "
                                                 "'encoder.layer'), for models whose stack the generic search misses")
    method: TuningMethod = Field(TopK(), description="what trains in the tuned layers: top_k (the layers whole), lora, "
                                                     "ia3 or bitfit; a name, or one with settings: {name: lora, r: 8, "
                                                     "alpha: 16, dropout: 0.1, target_modules: [query, value]}")

    @model_validator(mode="after")
    def _method_fits_layers(self) -> EncoderSettings:
        # EncoderSpec adds tunable_layers; a study's shared settings have none (the grid gives them).
        self.method.check_tunable_layers(getattr(self, "tunable_layers", "all"))
        return self


class EncoderSpec(EncoderSettings):
    """One `LanguageModel`: what to load and which of its layers to tune. (Its learning rate is the cell's training
    argument: ``training.learning_rate``, one per language model of a `MultiEncoder`.)"""

    model: str = Field(description="a hub id, a local folder, or a model of the model mirror")
    tunable_layers: TunableLayers = Field("all", description="how many top layers train: 0 (the head alone) up to "
                                                             "the model's layer count, or all (the embeddings too)")

    def build(self) -> nn.Module:
        """The `LanguageModel` this spec describes."""
        from layertune.language_model import LanguageModel

        return LanguageModel(self.model, self.tunable_layers, **self.model_dump(exclude={"model", "tunable_layers"}))

    @classmethod
    def of(cls, lm: nn.Module) -> EncoderSpec:
        """The spec that builds the `LanguageModel` ``lm`` again, its layers and pooling resolved: what a saved
        model's ``config.json`` holds for it."""
        return cls(model=lm.name, tunable_layers=lm.tunable_layers, pooling=lm.pooling,
                   hidden_dropout_prob=lm.hidden_dropout_prob, freeze_embeddings=lm.freeze_embeddings,
                   frozen_dropout=lm.frozen_dropout, trust_remote_code=lm.trust_remote_code, revision=lm.revision,
                   layers=lm.layers_path, method=lm.method)


class CombineSpec(Spec):
    """How a `MultiEncoder` combines its language models."""

    method: Literal["concat", "dme"]
    dropout: float = Field(0.0, ge=0, lt=1, description="on the combined vector")
    projection_size: PositiveInt | None = Field(None, description="dme's common size; null: the largest hidden size")

    @classmethod
    def of(cls, encoder: nn.Module) -> CombineSpec:
        """How the `MultiEncoder` ``encoder`` combines its language models (dme's projection size resolved): what a
        saved model's ``config.json`` holds for it."""
        return cls(method=encoder.combine_method, dropout=encoder.dropout.p, projection_size=encoder.projection_size)


class HeadSpec(Spec):
    """The task head's arguments (`TextClassifier`, `TextRegressor`, `TokenClassifier`)."""

    head: Literal["linear", "mlp"] = Field("linear", description="one linear layer, or an MLP of one hidden layer")
    head_hidden_size: PositiveInt | None = Field(None, description="the MLP's hidden size; null: the encoder's")
    head_dropout: NonNegativeFloat = Field(0.1, lt=1, description="dropout before the head")


# --------------------------------------------------------------------------------- the frozen-prefix cache's entries


def states_spec(spec: EncoderSpec) -> EncoderSpec:
    """What the frozen layers' output of an encoder built from ``spec`` depends on: its weights and config, not which
    top layers train, how it pools or its method (LoRA, IA3 or BitFit on the top K leave the layers below as top-K
    does). Encoders with equal ``states_spec`` share their cache entries."""
    return spec.model_copy(update={"tunable_layers": "all", "pooling": "cls", "method": TopK()})


def cache_boundary(spec: EncoderSpec, frozen_prefix_cache: bool | str = "auto") -> int | None:
    """The boundary (number of frozen layers) whose cached states a run of ``spec`` reads, or None where it trains
    without the cache (`layertune.training_config.cache_decision`: every layer tuned, frozen dropout, or disabled).
    Read from the model's config, without loading weights, so a plan knows every entry before anything trains."""
    frozen = None if spec.tunable_layers == "all" else (
        model_layers(spec.model, revision=spec.revision) - spec.tunable_layers)
    used, _ = cache_decision(frozen, spec.frozen_dropout, frozen_prefix_cache, method=spec.method.name)
    return frozen if used else None
