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
from pathlib import Path
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
    from transformers import PretrainedConfig

METHODS = ("top_k", "lora", "ia3", "bitfit")


class _MethodSpec(BaseModel):
    """Strict like `layertune.specs.Spec` (which cannot be imported here: specs.py imports this module)."""

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

    def check_model(self, config: PretrainedConfig | dict, layers: str | None = None, name: str = "the model"
                    ) -> None:
        """A ValueError naming ``method.<key>`` if a setting does not fit the model of ``config`` (its
        `PretrainedConfig`, or its config.json as a dict; ``layers``: the dotted path of its layer stack, None:
        guessed), checked on the model's structure alone: no weights are read. Top-K and BitFit fit every model. A
        model whose code ships with it (a model type transformers does not know) is not built here: its settings
        are checked when it loads."""

    def apply(self, lm: nn.Module) -> Any:
        """Set what trains in the `LanguageModel` ``lm`` (its ``tunable_layers`` and pooling given); return the peft
        tuner that holds its adapters, or None."""
        raise NotImplementedError

    def initial_adapters(self, shapes: dict[str, torch.Size], generator: torch.Generator
                         ) -> dict[str, torch.Tensor]:
        """The initial values of a language model's adapter tensors (``shapes``: their names and shapes, in
        parameter order), drawn from ``generator`` as the method draws them when applied, values it then overwrites
        included (see `layertune.initialization`)."""
        if shapes:
            raise ValueError(f"{next(iter(shapes))!r} is not an adapter tensor of method {self.name!r}, which adds "
                             "none.")
        return {}

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

    def apply(self, lm: nn.Module) -> None:
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

    def check_model(self, config: PretrainedConfig | dict, layers: str | None = None, name: str = "the model"
                    ) -> None:
        # A check that passed is remembered: building the layer imports torch and the model's code (~5 s), and a
        # study's parameters are checked at every `dvc repro`.
        passed = _passed_check(self, config, layers)
        if passed.is_file():
            return
        known = _known_config(config)
        if known is not None:
            self.modules(_empty_layer(known, layers), known.model_type, name)
        _remember(passed)

    def modules(self, layer: nn.Module, model_type: str, name: str) -> dict[str, list[str]]:
        """The modules this method adapts in ``layer`` (one transformer layer of a model of ``model_type``), by
        name within the layer, per setting (``{"target_modules": [...]}``): the given ones checked, or peft's
        defaults. A setting that does not fit is a ValueError naming ``method.<key>`` and the valid values."""
        raise NotImplementedError

    def peft_config(self, lm: nn.Module):
        """peft's config of this method for ``lm``: `modules` of its tuned layers, restricted to them
        (``layers_to_transform``, ``layers_pattern`` = the layer stack's path)."""
        raise NotImplementedError

    def apply(self, lm: nn.Module):
        from peft.mapping import PEFT_TYPE_TO_TUNER_MAPPING

        config = self.peft_config(lm)
        lm.model.requires_grad_(False)
        # peft's tuner injects the adapters into lm.model in place and marks only them trainable; it is kept for
        # merge_and_unload.
        return PEFT_TYPE_TO_TUNER_MAPPING[config.peft_type](lm.model, config, "default")

    def _tuned_modules(self, lm: nn.Module) -> dict[str, list[str]]:
        return self.modules(lm.layers[lm.tuned_layer_indices[0]], lm.model.config.model_type, lm.name)

    def _checked(self, layer: nn.Module, model_type: str, name: str, key: str, given: list[str] | None,
                 defaults: dict) -> list[str]:
        """``given`` checked against the layer's linear modules, or peft's default for the model type."""
        linear = list(_linear_modules(layer))
        choices = sorted({module.rpartition(".")[2] for module in linear}) + linear
        if given is None:
            if model_type not in defaults:
                raise ValueError(f"method.{key}: peft has no default {self.name} modules for model type "
                                 f"{model_type!r} ({name}); name them, e.g. {{name: {self.name}, {key}: [...]}}."
                                 f"{choices_hint('', choices)}")
            return list(defaults[model_type])
        for target in given:
            if not any(_names(module, target) for module in linear):
                raise ValueError(f"method.{key}: {target!r} is not a linear module of {name}'s layers (give a "
                                 f"name within a layer, or its last part).{choices_hint(target, choices)}")
        return list(given)


class Lora(_PeftMethod):
    """LoRA (Hu et al., 2021): a trained low-rank update ``alpha / r * B A`` beside each target linear weight of
    the tuned layers; the weights themselves stay frozen. peft's ``LoraConfig``."""

    name: Literal["lora"] = "lora"
    r: PositiveInt = Field(8, description="rank of the update")
    alpha: PositiveFloat = Field(16.0, description="scale: the update is multiplied by alpha / r")
    dropout: float = Field(0.1, ge=0, lt=1, description="dropout on the adapter's input")

    def modules(self, layer: nn.Module, model_type: str, name: str) -> dict[str, list[str]]:
        from peft.utils.constants import (
            TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as DEFAULTS,
        )

        targets = self._checked(layer, model_type, name, "target_modules", self.target_modules, DEFAULTS)
        for module, linear in _linear_modules(layer).items():
            side = min(linear.in_features, linear.out_features)
            if any(_names(module, target) for target in targets) and self.r > side:
                # A rank above the smaller side adds parameters, never expressiveness (r: 100000 on 384-wide layers
                # made 153.6 M trainable parameters of a 17.4 M model).
                raise ValueError(f"method.r: {self.r} is above the smaller side of target module {module!r} of "
                                 f"{name}'s layers ({linear.in_features} x {linear.out_features}): a rank-r update "
                                 f"of that weight has rank at most {side}. Give r <= {side}.")
        return {"target_modules": targets}

    def peft_config(self, lm: nn.Module):
        from peft import LoraConfig

        return LoraConfig(r=self.r, lora_alpha=self.alpha, lora_dropout=self.dropout, bias="none",
                          target_modules=self._tuned_modules(lm)["target_modules"],
                          layers_to_transform=lm.tuned_layer_indices, layers_pattern=re.escape(lm.layers_name))

    def initial_adapters(self, shapes: dict[str, torch.Size], generator: torch.Generator
                         ) -> dict[str, torch.Tensor]:
        """peft's default (``init_lora_weights=True``): A Kaiming-uniform, B zero, so the update starts at zero. peft
        first makes each module's A and B as torch's linear layers, which draw their weights, then draws A again and
        zeroes B: so are they drawn here, module after module."""
        import torch

        values = {}
        for name, shape in shapes.items():
            if ".lora_B." in name and name.replace(".lora_B.", ".lora_A.") in shapes:
                continue  # drawn with its A
            if ".lora_A." not in name or (name_b := name.replace(".lora_A.", ".lora_B.")) not in shapes:
                return super().initial_adapters({name: shape}, generator)
            for made in (shape, shapes[name_b]):  # A and B made as torch's linear layers, which draw their weights
                _kaiming_uniform(made, generator)
            values[name], values[name_b] = _kaiming_uniform(shape, generator), torch.zeros(shapes[name_b])
        return values


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

    def modules(self, layer: nn.Module, model_type: str, name: str) -> dict[str, list[str]]:
        from peft.utils import constants

        targets = self._checked(layer, model_type, name, "target_modules", self.target_modules,
                                constants.TRANSFORMERS_MODELS_TO_IA3_TARGET_MODULES_MAPPING)
        defaults = constants.TRANSFORMERS_MODELS_TO_IA3_FEEDFORWARD_MODULES_MAPPING
        if self.feedforward_modules is None and self.target_modules is not None:
            # Modules of the user's own choosing: the feed-forward ones are peft's default ones among them.
            feedforward = [m for m in defaults.get(model_type, []) if m in targets]
        else:
            feedforward = self._checked(layer, model_type, name, "feedforward_modules", self.feedforward_modules,
                                        defaults)
        if extra := [m for m in feedforward if m not in targets]:
            raise ValueError(f"method.feedforward_modules: {', '.join(map(repr, extra))} "
                             f"{'is' if len(extra) == 1 else 'are'} not among the target modules of {name} "
                             f"({', '.join(map(repr, targets))}): feed-forward modules are target "
                             "modules whose input IA3 rescales; name them in target_modules too, or choose among "
                             "those.")
        return {"target_modules": targets, "feedforward_modules": feedforward}

    def peft_config(self, lm: nn.Module):
        from peft import IA3Config

        modules = self._tuned_modules(lm)
        # IA3Config has no layers_to_transform: the tuned layers' modules are named in full instead.
        return IA3Config(target_modules=_module_keys(lm, modules["target_modules"]),
                         feedforward_modules=_module_keys(lm, modules["feedforward_modules"]))

    def initial_adapters(self, shapes: dict[str, torch.Size], generator: torch.Generator
                         ) -> dict[str, torch.Tensor]:
        """peft's default (``init_ia3_weights=True``): ones, so the adapted model starts as the base model. peft draws
        each vector from a normal distribution first, then sets it to ones: so is it drawn here."""
        import torch

        values = {}
        for name, shape in shapes.items():
            if ".ia3_l." not in name:
                return super().initial_adapters({name: shape}, generator)
            torch.randn(shape, generator=generator)
            values[name] = torch.ones(shape)
        return values


class BitFit(_MethodSpec):
    """BitFit (Ben Zaken et al., 2022): only bias terms train, those of the tuned layers (``tunable_layers="all"``:
    every bias, the embeddings' included unless ``freeze_embeddings``; with ``pooling="pooler"``, the pooler's)."""

    name: Literal["bitfit"] = "bitfit"

    def apply(self, lm: nn.Module) -> None:
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


def _kaiming_uniform(shape: torch.Size, generator: torch.Generator) -> torch.Tensor:
    """torch's draw of a linear layer's weight (`nn.Linear.reset_parameters`)."""
    import torch

    return torch.nn.init.kaiming_uniform_(torch.empty(shape), a=math.sqrt(5), generator=generator)


def _module_keys(lm: nn.Module, names: list[str]) -> list[str]:
    """Full names in ``lm.model`` of the tuned layers' linear modules that ``names`` name (in full within a layer,
    or by their last parts)."""
    keys = []
    for index in lm.tuned_layer_indices:
        for name in _linear_modules(lm.layers[index]):
            if any(_names(name, wanted) for wanted in names):
                keys.append(f"{lm.layers_name}.{index}.{name}")
    return keys


def _names(module: str, wanted: str) -> bool:
    """Whether ``wanted`` names the module ``module`` of a layer: in full, or by its last parts (as peft matches)."""
    return module == wanted or module.endswith(f".{wanted}")


def _linear_modules(layer: nn.Module) -> dict[str, nn.Linear]:
    """One layer's linear modules (what LoRA and IA3 can adapt), by name within the layer."""
    from torch import nn

    return {name: module for name, module in layer.named_modules() if isinstance(module, nn.Linear)}


def _passed_check(method: _PeftMethod, config: PretrainedConfig | dict, layers: str | None) -> Path:
    """Where a passed `check_model` is remembered: a file named by everything the check reads (the method, the
    model's config, the layer stack, this module's code and the versions of the libraries that build the layer)."""
    import hashlib
    import importlib.metadata
    import json

    from layertune.io import cache_root, file_digest

    code = [Path(__file__), Path(__file__).with_name("layer_stack.py")]  # read, not imported (layer_stack: torch)
    inputs = {"method": method.model_dump(mode="json"), "layers": layers,
              "config": config if isinstance(config, dict) else config.to_dict(),
              "code": [file_digest(module) for module in code],
              "versions": [importlib.metadata.version(package) for package in ("torch", "transformers", "peft")]}
    key = hashlib.sha256(json.dumps(inputs, sort_keys=True, default=str).encode()).hexdigest()
    return cache_root() / "checks" / key


def _remember(path: Path) -> None:
    """An empty file at ``path``, created new (never through a link); where the cache cannot be written, nothing:
    the check runs again next time."""
    import os

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644))
    except OSError:
        pass


def _known_config(config: PretrainedConfig | dict) -> PretrainedConfig | None:
    """``config`` as a transformers config, or None for a model type transformers does not know (its code ships
    with the model, and nothing here runs it)."""
    from transformers import CONFIG_MAPPING, AutoConfig

    model_type = config.get("model_type") if isinstance(config, dict) else config.model_type
    if model_type not in CONFIG_MAPPING:
        return None
    if isinstance(config, dict):
        return AutoConfig.for_model(**config)  # model_type and the rest of config.json, as from_pretrained reads it
    return config


def _empty_layer(config: PretrainedConfig, layers: str | None) -> nn.Module:
    """The top transformer layer of the model ``config`` describes, built without weights (on torch's meta device:
    shapes only, no memory, nothing read), so that settings are checked before anything is loaded."""
    import torch
    import transformers

    from layertune.layer_stack import layer_stack

    with torch.device("meta"):
        model = transformers.AutoModel.from_config(config)
    stack, _ = layer_stack(model, layers)
    return model.get_submodule(stack)[-1]
