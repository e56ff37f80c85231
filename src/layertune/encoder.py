"""What a task model, the trainer, the drift table and persistence ask of an encoder: the `Encoder` protocol.

`LanguageModel` and `MultiEncoder` both satisfy `Encoder`; only a `LanguageModel` also satisfies `TokenEncoder`
(per-token states, which a tagger needs). Code that needs a capability checks the protocol with `require`, which
names the encoder's class and the members it lacks, rather than probing single attributes; `lacks` answers
without raising.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch
    from torch import nn

    from layertune.language_model import LanguageModel
    from layertune.training_config import TrainingConfig


@runtime_checkable
class HasParameterParts(Protocol):
    """A module that names the part (``embeddings``, ``layer.3``, ``head`` …) each of its parameters belongs to."""

    def parameter_parts(self) -> dict[str, str]: ...


@runtime_checkable
class Encoder(HasParameterParts, Protocol):
    """An encoder a `TaskModel` puts its head on: one vector of ``hidden_size`` per example."""

    # The language models inside: ``[self]`` for a `LanguageModel`, each of them for a `MultiEncoder`; each trains at
    # its own rate (`TrainingConfig.learning_rates`).
    language_models: Sequence[LanguageModel]

    @property
    def hidden_size(self) -> int: ...

    def forward(self, batch: dict) -> torch.Tensor: ...

    def tokenize(self, texts: list[str] | list[tuple[str, str]], max_length: int | None = None) -> dict: ...

    def prepare_examples(self, corpus, args: TrainingConfig | None = None, *, cache_dir=None, device: torch.device | str = "cpu",
                         autocast: torch.dtype | None = None) -> tuple[dict, dict]: ...

    def combination_parameters(self) -> list[nn.Parameter]: ...

    def base_tensors(self) -> set[str]: ...

    def save_config(self, directory: str | Path, tokenizer: bool = True) -> None: ...


@runtime_checkable
class TokenEncoder(Encoder, Protocol):
    """An encoder with one state per word piece, and the tokenizer that made the pieces."""

    tokenizer: Any
    max_length: int

    def token_states(self, batch: dict) -> torch.Tensor: ...

    def model_inputs(self, batch: dict) -> dict: ...


def require(encoder: object, protocol: type, purpose: str) -> None:
    """A TypeError that says ``purpose`` and which members ``encoder``'s class lacks, unless it has them all.

    Asked with ``hasattr``, not ``isinstance``: from Python 3.12 on, ``isinstance`` with a runtime-checkable protocol
    looks members up statically, and misses those a `torch.nn.Module` serves from ``__getattr__`` (its submodules,
    such as a `MultiEncoder`'s ``language_models``)."""
    if missing := lacks(encoder, protocol):
        raise TypeError(f"{purpose}; {type(encoder).__name__} has no {', '.join(missing)}.")


def lacks(encoder: object, protocol: type) -> list[str]:
    """The members of ``protocol`` that ``encoder`` lacks (none: it satisfies the protocol)."""
    return [name for name in members(protocol) if not hasattr(encoder, name)]


def members(protocol: type) -> list[str]:
    """The public members a protocol asks for, in the order they are declared (bases first)."""
    names: list[str] = []
    for cls in reversed(protocol.__mro__):
        if getattr(cls, "_is_protocol", False) and cls is not Protocol:
            names += [name for name in (*vars(cls).get("__annotations__", {}), *vars(cls)) if not name.startswith("_")]
    return list(dict.fromkeys(names))
