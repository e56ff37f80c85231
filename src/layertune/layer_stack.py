"""Where a Hugging Face encoder keeps its transformer layers and its input embeddings, found generically (no table of
architectures): the layer stack is the longest `ModuleList` of identical blocks, unless the caller names it."""

from __future__ import annotations

from torch import nn

from layertune.errors import choices_hint


def encoder_layers(model: nn.Module) -> nn.ModuleList:
    """The stack of transformer layers: the longest `ModuleList` of identical blocks in ``model``."""
    name, _ = find_layer_stack(model)
    return model.get_submodule(name)


def layer_stack(model: nn.Module, path: str | None) -> tuple[str, int]:
    """The layer stack's name and length: the one at the dotted ``path``, or the generic guess."""
    if path is None:
        return find_layer_stack(model)
    try:
        stack = model.get_submodule(path) if isinstance(path, str) and path else None
    except AttributeError:
        stack = None
    if not isinstance(stack, nn.ModuleList) or len(stack) == 0:
        lists = [name for name, module in model.named_modules() if isinstance(module, nn.ModuleList) and len(module)]
        found = choices_hint(path, lists) if lists else " It has no ModuleList."
        raise ValueError(f"layers={path!r} is not a ModuleList of layers in {type(model).__name__}: give the dotted "
                         f"path of its transformer layer stack.{found}")
    return path, len(stack)


def find_layer_stack(model: nn.Module) -> tuple[str, int]:
    candidates = [
        (name, len(module))
        for name, module in model.named_modules()
        if isinstance(module, nn.ModuleList) and len(module) > 0 and len({type(m) for m in module}) == 1
    ]
    if not candidates:
        raise ValueError(f"Cannot find a stack of transformer layers in {type(model).__name__}.")
    # The main stack is the longest; ties go to the shallowest (e.g. `encoder.layer` over per-layer sub-lists).
    return max(candidates, key=lambda c: (c[1], -c[0].count(".")))


def embeddings_name(model: nn.Module) -> str:
    """Name of the module holding the input embeddings (word + position + type + norm), whatever it is called."""
    word_embeddings = model.get_input_embeddings()
    for name, module in model.named_modules():
        if any(child is word_embeddings for child in module.children()):
            return name
    raise ValueError(f"Cannot find the input embeddings of {type(model).__name__}.")
