"""Drawing a task model's new parts from a seed, so that `ModelTrainer.train(seed=s)` starts from the same weights in
any process, whatever that process built, trained or drew before.

New parts are what no checkpoint provides. They are drawn as building the model right after seeding torch's generator
with the seed draws them (how a cell's model was built before the seed was applied at one place, so that cells keep
their numbers), in that order: in each language model (in order), the tensors its checkpoint lacked (a pooler, say),
then its tuning method's adapters (LoRA, IA3); then a `MultiEncoder`'s combination layer (dme); then the head. Each is
drawn by the rule its owner uses when it builds it: Hugging Face's for a checkpoint's gaps (normal with the config's
``initializer_range``, biases zero, norms one), the method's for its adapters (peft's, draws it then overwrites
included: `layertune.tuning_methods`), torch's for a linear layer (Kaiming-uniform, bias uniform in ±1/√fan_in). All
come from one CPU generator in float32, copied into place: the values depend on the seed alone, not on the device,
the dtype's rounding aside, or the global generator.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import nn

from layertune.io import tensors_digest
from layertune.multi_encoder import MultiEncoder

if TYPE_CHECKING:
    from layertune.language_model import LanguageModel


def draw_new_parts(model: nn.Module, seed: int) -> None:
    """Overwrite every new part of the task model ``model`` with values drawn from ``seed`` (see the module's
    docstring)."""
    generator = torch.Generator().manual_seed(seed)
    for lm in model.encoder.language_models:
        _draw_language_model(lm, generator)
    if isinstance(model.encoder, MultiEncoder):
        _draw_torch_layers(model.encoder.combine, generator)
    _draw_torch_layers(model.head, generator)


def new_parts_digest(model: nn.Module) -> str:
    """A content hash of every new part of the task model ``model``: it changes when anything trains them."""
    parts = [*(p for lm in model.encoder.language_models for _, p in _new_parameters(lm)),
             *model.encoder.combination_parameters(), *model.head.parameters()]
    return tensors_digest({str(index): parameter for index, parameter in enumerate(parts)})


def _new_parameters(lm: LanguageModel) -> list[tuple[str, nn.Parameter]]:
    """The parameters of ``lm`` that its checkpoint did not provide: gaps and adapters, in parameter order."""
    provided = lm.base_tensors()
    return [(name, parameter) for name, parameter in lm.named_parameters() if name not in provided]


def _draw_language_model(lm: LanguageModel, generator: torch.Generator) -> None:
    """The checkpoint's gaps first (Hugging Face fills them as it loads the weights), then the method's adapters
    (added once the model is loaded)."""
    std = getattr(lm.model.config, "initializer_range", 0.02)
    new = _new_parameters(lm)
    # peft moves an adapted module's own weights one level down: query.weight → query.base_layer.weight.
    gaps = {name for name, _ in new if name.removeprefix("model.").replace(".base_layer.", ".") in lm.initialized}
    for name, parameter in new:
        if name in gaps:
            _assign(parameter, _checkpoint_gap(name, parameter.shape, std, generator))
    adapters = {name: parameter for name, parameter in new if name not in gaps}
    drawn = lm.method.initial_adapters({name: parameter.shape for name, parameter in adapters.items()}, generator)
    for name, parameter in adapters.items():
        _assign(parameter, drawn[name])


def _checkpoint_gap(name: str, shape: torch.Size, std: float, generator: torch.Generator) -> torch.Tensor:
    """Hugging Face's initialisation of an encoder tensor: weights normal(0, initializer_range), biases zero, the
    1-D weights of norms one."""
    if len(shape) >= 2:
        return nn.init.normal_(torch.empty(shape), 0.0, std, generator=generator)
    return torch.zeros(shape) if name.endswith("bias") else torch.ones(shape)


def _draw_torch_layers(module: nn.Module, generator: torch.Generator) -> None:
    """torch's own initialisation of each linear layer in ``module`` (`nn.Linear.reset_parameters`)."""
    for layer in module.modules():
        if not any(True for _ in layer.parameters(recurse=False)):
            continue  # dropout, activations, containers
        if not isinstance(layer, nn.Linear):
            raise TypeError(f"Cannot draw the initial weights of a {type(layer).__name__} in {type(module).__name__}: "
                            "new parts of a task model are linear layers.")
        weight = nn.init.kaiming_uniform_(torch.empty(layer.weight.shape), a=math.sqrt(5), generator=generator)
        _assign(layer.weight, weight)
        if layer.bias is not None:
            bound = 1 / math.sqrt(layer.in_features) if layer.in_features else 0.0
            _assign(layer.bias, nn.init.uniform_(torch.empty(layer.bias.shape), -bound, bound, generator=generator))


@torch.no_grad()
def _assign(parameter: nn.Parameter, values: torch.Tensor) -> None:
    parameter.copy_(values)
