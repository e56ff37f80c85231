"""What trains inside an encoder's tunable layers: the layers whole (top-K tuning), or LoRA, IA3 or BitFit in them.

Each method is one frozen pydantic spec: the library's argument (``LanguageModel(name, tunable_layers=2,
method=Lora(r=8))``), the check of its settings, and the form a cell and a saved model store (``{name: lora, r: 8,
...}``). A string names a method with its defaults: ``method="lora"``.

A method applies to the layers ``tunable_layers`` names: ``"all"`` every layer, K the top K. LoRA and IA3 are Hugging
Face ``peft``'s (`LoraConfig`, `IA3Config` with ``layers_to_transform`` = the tuned layers' indices and
``layers_pattern`` = the layer stack's path); BitFit (Ben Zaken et al., 2022: bias terms only) has no peft config, so
it is ``requires_grad`` on the tuned layers' biases. The task head always trains.

With K < L the embeddings and the bottom L-K layers are untouched whatever the method, so training from their cached
output (`layertune.frozen_prefix`) is exact for LoRA, IA3 and BitFit as for top-K tuning; on all layers no layer's
output is fixed, so nothing is cached.

This module imports neither torch nor peft when loaded: checking a study's parameters stays fast.
"""

from __future__ import annotations

import math
import re
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PositiveFloat,
    PositiveInt,
    TypeAdapter,
    model_validator,
)

from layertune.errors import choices_hint

if TYPE_CHECKING:
    import torch
    from torch import nn

    from layertune.language_model import LanguageModel

METHODS = ("top_k", "lora", "ia3", "bitfit")


class _MethodSpec(BaseModel):
    """Strict like `layertune.cell.Spec` (which cannot be imported here: cell.py imports this module)."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, allow_inf_nan=False)

    name: str
    adapts_layers: ClassVar[bool] = True  # False: what trains is the layers themselves (top-K)

    def check_tunable_layers(self, tunable_layers: int | str) -> None:
        """A ValueError if this method cannot apply to ``tunable_layers`` (K=0 leaves it no layer)."""
        if tunable_layers == 0 and self.adapts_layers:
            raise ValueError(
                f"tunable_layers=0 with method {self.name!r}: {self.name} adapts the tuned layers, and 0 tunes none. "
                f"Use tunable_layers >= 1 or 'all' with {self.name}, or method 'top_k' with tunable_layers=0 to "
                "train the head alone.")

    def apply(self, lm: LanguageModel) -> Any:
        """Set what trains in ``lm`` (its ``tunable_layers`` and pooling given); return the peft tuner that holds
        its adapters, or None."""
        raise NotImplementedError

    def initial_adapter(self, name: str, shape: torch.Size, generator: torch.Generator) -> torch.Tensor:
        """The initial value of the adapter tensor ``name``, as the method makes it when applied, drawn from
        ``generator`` (see `layertune.initialization`)."""
        raise ValueError(f"{name!r} is not an adapter tensor of method {self.name!r}, which adds none.")

    def label(self) -> str:
        """Short text for logs and tables: ``lora(r=8, alpha=16.0, dropout=0.1)``."""
        settings = ", ".join(f"{key}={value}" for key, value in self.model_dump(exclude={"name"}).items()
                             if value is not None)
        return f"{self.name}({settings})" if settings else self.name


class TopK(_MethodSpec):
    """Top-K tuning: every weight of the tuned layers trains (``tunable_layers="all"``: the embeddings too, unless
    ``freeze_embeddings``; with ``pooling="pooler"`` and K >= 1, the pooler)."""

    name: Literal["top_k"] = "top_k"
    adapts_layers: ClassVar[bool] = False

    def apply(self, lm: LanguageModel) -> None:
        everything = lm.tunable_layers == "all"
        lm.model.requires_grad_(everything)
        if everything and lm.freeze_embeddings:
            lm.embeddings.requires_grad_(False)
        for index in lm.tuned_layer_indices:
            lm.layers[index].requires_grad_(True)
        if lm.pooler is not None:
            # An unused pooler stays frozen so that trainable-parameter counts mean what they say.
            lm.pooler.requires_grad_(lm.pooling == "pooler" and (everything or lm.tunable_layers > 0))


class _PeftMethod(_MethodSpec):
    """A method that peft injects into the tuned layers' linear modules; everything else stays frozen (the pooler
    too, as in peft's recipe, whose ``modules_to_save`` is the task head only: layertune's head always trains)."""

    target_modules: list[str] | None = Field(
        None, min_length=1, description="the linear modules to adapt, by name within a layer (e.g. query, value, or "
                                        "attention.self.query); null: peft's default for the architecture")

    def peft_config(self, lm: LanguageModel):
        """peft's config of this method for ``lm``: its target modules checked (or peft's defaults), restricted to
        the tuned layers (``layers_to_transform``, ``layers_pattern`` = the layer stack's path)."""
        raise NotImplementedError

    def apply(self, lm: LanguageModel):
        from peft.mapping import PEFT_TYPE_TO_TUNER_MAPPING

        config = self.peft_config(lm)
        lm.model.requires_grad_(False)
        # peft's tuner injects the adapters into lm.model in place and marks only them trainable; it is kept for
        # merge_and_unload.
        return PEFT_TYPE_TO_TUNER_MAPPING[config.peft_type](lm.model, config, "default")

    def _modules(self, lm: LanguageModel, key: str, given: list[str] | None, defaults: dict) -> list[str]:
        """``given`` checked against the tuned layers' linear modules, or peft's default for the model type."""
        linear = _linear_modules(lm.layers[lm.tuned_layer_indices[0]])
        choices = sorted({name.rpartition(".")[2] for name in linear}) + linear
        if given is None:
            model_type = lm.model.config.model_type
            if model_type not in defaults:
                raise ValueError(f"method.{key}: peft has no default {self.name} modules for model type "
                                 f"{model_type!r} ({lm.name}); name them, e.g. {{name: {self.name}, {key}: [...]}}."
                                 f"{choices_hint('', choices)}")
            return list(defaults[model_type])
        for target in given:
            if not any(name == target or name.endswith(f".{target}") for name in linear):
                raise ValueError(f"method.{key}: {target!r} is not a linear module of {lm.name}'s layers (give a "
                                 f"name within a layer, or its last part).{choices_hint(target, choices)}")
        return list(given)


class Lora(_PeftMethod):
    """LoRA (Hu et al., 2021): a trained low-rank update ``alpha / r * B A`` beside each target linear weight of
    the tuned layers; the weights themselves stay frozen. peft's ``LoraConfig``."""

    name: Literal["lora"] = "lora"
    r: PositiveInt = Field(8, description="rank of the update")
    alpha: PositiveFloat = Field(16.0, description="scale: the update is multiplied by alpha / r")
    dropout: float = Field(0.1, ge=0, lt=1, description="dropout on the adapter's input")

    def peft_config(self, lm: LanguageModel):
        from peft import LoraConfig
        from peft.utils.constants import (
            TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as DEFAULTS,
        )

        return LoraConfig(r=self.r, lora_alpha=self.alpha, lora_dropout=self.dropout, bias="none",
                          target_modules=self._modules(lm, "target_modules", self.target_modules, DEFAULTS),
                          layers_to_transform=lm.tuned_layer_indices, layers_pattern=re.escape(lm.layers_name))

    def initial_adapter(self, name: str, shape: torch.Size, generator: torch.Generator) -> torch.Tensor:
        """peft's default (``init_lora_weights=True``): A Kaiming-uniform, B zero, so the update starts at zero."""
        import torch

        if ".lora_A." in name:
            return torch.nn.init.kaiming_uniform_(torch.empty(shape), a=math.sqrt(5), generator=generator)
        if ".lora_B." in name:
            return torch.zeros(shape)
        return super().initial_adapter(name, shape, generator)


class IA3(_PeftMethod):
    """IA3 (Liu et al., 2022): trained vectors that rescale the target modules' outputs (the inputs of the
    feed-forward ones). peft's ``IA3Config``."""

    name: Literal["ia3"] = "ia3"
    feedforward_modules: list[str] | None = Field(
        None, description="which target modules are feed-forward (IA3 rescales their input); null: peft's default "
                          "for the architecture (among the target modules)")

    @model_validator(mode="after")
    def _feedforward_among_targets(self) -> IA3:
        given = self.feedforward_modules is not None and self.target_modules is not None
        if given and (extra := [m for m in self.feedforward_modules if m not in self.target_modules]):
            raise ValueError(f"feedforward_modules {extra} are not in target_modules {self.target_modules}: "
                             "feed-forward modules are target modules whose input IA3 rescales")
        return self

    def peft_config(self, lm: LanguageModel):
        from peft import IA3Config
        from peft.utils import constants

        targets = self._modules(lm, "target_modules", self.target_modules,
                                constants.TRANSFORMERS_MODELS_TO_IA3_TARGET_MODULES_MAPPING)
        defaults = constants.TRANSFORMERS_MODELS_TO_IA3_FEEDFORWARD_MODULES_MAPPING
        if self.feedforward_modules is None and self.target_modules is not None:
            # Modules of the user's own choosing: the feed-forward ones are peft's default ones among them.
            feedforward = [m for m in defaults.get(lm.model.config.model_type, []) if m in targets]
        else:
            feedforward = self._modules(lm, "feedforward_modules", self.feedforward_modules, defaults)
        if extra := [m for m in feedforward if m not in targets]:
            raise ValueError(f"method.feedforward_modules: {extra} are not among the target modules {targets}: name "
                             "them in target_modules too")
        # IA3Config has no layers_to_transform: the tuned layers' modules are named in full instead.
        return IA3Config(target_modules=_module_keys(lm, targets), feedforward_modules=_module_keys(lm, feedforward))

    def initial_adapter(self, name: str, shape: torch.Size, generator: torch.Generator) -> torch.Tensor:
        """peft's default (``init_ia3_weights=True``): ones, so the adapted model starts as the base model."""
        import torch

        if ".ia3_l." in name:
            return torch.ones(shape)
        return super().initial_adapter(name, shape, generator)


class BitFit(_MethodSpec):
    """BitFit (Ben Zaken et al., 2022): only bias terms train, those of the tuned layers (``tunable_layers="all"``:
    every bias, the embeddings' included unless ``freeze_embeddings``; with ``pooling="pooler"``, the pooler's)."""

    name: Literal["bitfit"] = "bitfit"

    def apply(self, lm: LanguageModel) -> None:
        lm.model.requires_grad_(False)
        everything = lm.tunable_layers == "all"
        modules = [lm.model] if everything else [lm.layers[index] for index in lm.tuned_layer_indices]
        if lm.pooler is not None and lm.pooling == "pooler":
            modules.append(lm.pooler)
        for module in modules:
            for name, parameter in module.named_parameters():
                if name.rpartition(".")[2] == "bias":
                    parameter.requires_grad_(True)
        if everything and lm.freeze_embeddings:
            lm.embeddings.requires_grad_(False)
        if everything and lm.pooler is not None and lm.pooling != "pooler":
            lm.pooler.requires_grad_(False)  # unused: frozen, so that counts mean what they say


def _as_method(value: Any) -> Any:
    """``"lora"`` → ``{"name": "lora"}``; an unknown or missing name is one error naming the valid ones."""
    if isinstance(value, str):
        value = {"name": value}
    if isinstance(value, dict):
        name = value.get("name")
        if name is None:
            raise ValueError(f"a tuning method needs its name, e.g. {{name: lora, r: 8}}; got {value!r}. Valid names: "
                             f"{', '.join(METHODS)}")
        if name not in METHODS:
            raise ValueError(f"unknown tuning method {name!r}.{choices_hint(name, METHODS)}")
    return value


TuningMethod = Annotated[TopK | Lora | IA3 | BitFit, Field(discriminator="name"), BeforeValidator(_as_method)]
_ADAPTER: TypeAdapter = TypeAdapter(TuningMethod)


def tuning_method(value: str | dict | _MethodSpec) -> TopK | Lora | IA3 | BitFit:
    """A method from its name (``"lora"``: its defaults), its saved form (``{"name": "lora", "r": 4}``) or itself;
    a pydantic ValidationError names the bad key."""
    return value if isinstance(value, _MethodSpec) else _ADAPTER.validate_python(value)


def _module_keys(lm: LanguageModel, names: list[str]) -> list[str]:
    """Full names in ``lm.model`` of the tuned layers' linear modules that ``names`` name (in full within a layer,
    or by their last parts)."""
    keys = []
    for index in lm.tuned_layer_indices:
        for name in _linear_modules(lm.layers[index]):
            if any(name == wanted or name.endswith(f".{wanted}") for wanted in names):
                keys.append(f"{lm.layers_name}.{index}.{name}")
    return keys


def _linear_modules(layer: nn.Module) -> list[str]:
    """Names, within one layer, of its linear modules (what LoRA and IA3 can adapt)."""
    from torch import nn

    return [name for name, module in layer.named_modules() if isinstance(module, nn.Linear)]
