"""`MultiEncoder`: several language models tuned together, their pooled vectors concatenated or mixed by DME.

Each `LanguageModel` keeps its own tokenizer, ``tunable_layers``, ``hidden_dropout_prob`` and learning rate. A text
is tokenized once per encoder (each with its own tokenization and frozen-prefix cache); a batch holds every encoder's
features under an ``lm<i>.`` prefix, so the training loop and `TaskModel.predict` see one flat dict of tensors.

Combination:

- ``concat``: the pooled vectors side by side (width = sum of the encoders' hidden sizes); no parameters.
- ``dme``: dynamic meta-embeddings (Kiela, Wang & Cho, 2018): each pooled vector is projected to a common size,
  scored by one shared linear attention, the scores are soft-maxed over encoders per example, and the projections
  are summed with those weights. The last weights stay in `last_attention` for inspection.

The combination layer is new, task-specific weights like the head, so it trains at the head's learning rate, not at
its language models' own: `combination_parameters` hands it to the trainer, and `TaskModel.head_parameters` includes
it.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Literal

import torch
from torch import nn
from torch.utils.data import Dataset

from layertune.batching import Examples
from layertune.errors import choices_hint
from layertune.language_model import LanguageModel

if TYPE_CHECKING:
    from layertune.training_config import TrainingConfig

CombineMethod = Literal["concat", "dme"]
COMBINE_METHODS = ("concat", "dme")


class Concatenation(nn.Module):
    """The pooled vectors side by side. No weights, so no attention either."""

    def __init__(self, sizes: list[int]) -> None:
        super().__init__()
        self.output_size = sum(sizes)

    def forward(self, vectors: list[torch.Tensor]) -> tuple[torch.Tensor, None]:
        return torch.cat(vectors, dim=-1), None


class DynamicMetaEmbedding(nn.Module):
    """Project each vector to ``output_size``, weigh the projections by a softmax over encoders, sum them."""

    def __init__(self, sizes: list[int], output_size: int) -> None:
        super().__init__()
        self.output_size = output_size
        self.projections = nn.ModuleList(nn.Linear(size, output_size) for size in sizes)
        # One scorer shared by all encoders, as in the paper. No bias: a bias shared by every score cancels in the
        # softmax, so it would never receive a gradient.
        self.attention = nn.Linear(output_size, 1, bias=False)

    def forward(self, vectors: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        projected = torch.stack([p(v) for p, v in zip(self.projections, vectors)], dim=1)  # (batch, encoders, size)
        weights = torch.softmax(self.attention(projected).squeeze(-1), dim=-1)  # (batch, encoders)
        return (weights.unsqueeze(-1) * projected).sum(dim=1), weights


class MultiExamples(Dataset):
    """The same examples tokenized once per encoder; a batch holds each encoder's part under its prefix."""

    def __init__(self, parts: list[Examples], prefixes: list[str]) -> None:
        _check_aligned(parts)
        self.parts, self.prefixes = parts, prefixes
        # Batch cost follows the longest tokenization, so length grouping goes by that.
        self.lengths = [max(lengths) for lengths in zip(*(part.lengths for part in parts))]

    def __len__(self) -> int:
        return len(self.lengths)

    def batch(self, indices) -> dict:
        batch = {}
        for part, prefix in zip(self.parts, self.prefixes):
            padded = part.batch(indices)
            labels = padded.pop("labels", None)  # identical in every part (checked in __init__)
            batch.update({f"{prefix}{key}": value for key, value in padded.items()})
        if labels is not None:
            batch["labels"] = labels
        return batch

    __getitems__ = batch

    @property
    def host_batches_for(self) -> torch.device | None:
        """The GPU that batches are gathered on the host for, when every encoder's part is (see `make_loader`). A
        loader pins every tensor of a batch, and a part resident on the GPU cannot be pinned: in a mixed batch the
        host parts are copied unpinned."""
        devices = [part.host_batches_for for part in self.parts]
        return None if None in devices else devices[0]


def _check_aligned(parts: list[Examples]) -> None:
    """Every encoder must see the same examples in the same order; the labels prove it cheaply."""
    sizes = {len(part) for part in parts}
    if len(sizes) != 1:
        raise ValueError(f"The encoders' tokenized splits differ in size: {[len(part) for part in parts]}.")
    labels = [part.labels if part.labels is not None else part.tokens.get("labels") for part in parts]
    if any(not torch.equal(labels[0].cpu(), other.cpu()) for other in labels[1:] if other is not None):
        raise ValueError("The encoders' tokenized splits hold different labels: their examples are not aligned.")


class MultiEncoder(nn.Module):
    """Several `LanguageModel` s as one encoder: ``TextClassifier(MultiEncoder([lm_a, lm_b], "dme"), 2)``.

    ``dropout`` applies to the combined vector. ``projection_size`` (dme only) is the common size the pooled vectors
    are projected to; by default the largest encoder hidden size.
    """

    def __init__(self, language_models: list[LanguageModel], combine_method: CombineMethod = "concat",
                 dropout: float = 0.0, projection_size: int | None = None) -> None:
        super().__init__()
        _check_language_models(language_models)
        _check_combination(combine_method, dropout, projection_size)
        self.language_models = nn.ModuleList(language_models)
        self.combine_method = combine_method
        sizes = [lm.hidden_size for lm in language_models]
        if combine_method == "dme":
            self.projection_size = projection_size or max(sizes)
            self.combine = DynamicMetaEmbedding(sizes, self.projection_size)
        else:
            self.projection_size = None
            self.combine = Concatenation(sizes)
        self.dropout = nn.Dropout(dropout)
        self.last_attention: torch.Tensor | None = None

    @property
    def prefixes(self) -> list[str]:
        """Batch-key prefix of each encoder's features: ``lm0.``, ``lm1.`` …"""
        return [f"lm{index}." for index in range(len(self.language_models))]

    @property
    def hidden_size(self) -> int:
        return self.combine.output_size

    @property
    def tokenizers(self) -> list:
        """One tokenizer per encoder (there is no single ``tokenizer``: vocabularies differ)."""
        return [lm.tokenizer for lm in self.language_models]

    def __repr__(self) -> str:
        inner = ",\n  ".join(repr(lm) for lm in self.language_models)
        size = f", projection_size={self.projection_size}" if self.projection_size else ""
        return f"MultiEncoder([\n  {inner}\n], combine_method={self.combine_method!r}{size}, dropout={self.dropout.p})"

    # ----------------------------------------------------------------------------------------------------------
    # Forward

    def tokenize(self, texts: list[str] | list[tuple[str, str]], max_length: int | None = None) -> dict:
        """Padded inputs of every encoder for raw sentences or pairs, keys prefixed per encoder."""
        batch = {}
        for prefix, lm in zip(self.prefixes, self.language_models):
            batch.update({f"{prefix}{key}": value for key, value in lm.tokenize(texts, max_length).items()})
        return batch

    def forward(self, batch: dict) -> torch.Tensor:
        """One combined vector per example (batch, hidden_size); dme weights are kept in `last_attention`."""
        vectors = [lm(_features(batch, prefix)) for prefix, lm in zip(self.prefixes, self.language_models)]
        combined, weights = self.combine(vectors)
        self.last_attention = None if weights is None else weights.detach()
        return self.dropout(combined)

    def prepare_examples(self, corpus, args: TrainingConfig | None = None, *, cache_dir=None, device: torch.device | str = "cpu",
                         autocast: torch.dtype | None = None) -> tuple[dict[str, MultiExamples], dict]:
        """Each encoder prepares its own examples (tokenization and frozen-prefix cache); they are zipped per split.

        The returned info has ``used`` (any encoder uses the cache), ``reason``, and each encoder's own info
        under ``lm0``, ``lm1`` ….
        """
        parts, info = [], {}
        for prefix, lm in zip(self.prefixes, self.language_models):
            try:
                splits, info[prefix[:-1]] = lm.prepare_examples(corpus, args, cache_dir=cache_dir, device=device,
                                                                autocast=autocast)
            except ValueError as error:
                raise ValueError(f"{prefix[:-1]} ({lm.name}): {error}") from None
            parts.append(splits)
        info["used"] = any(info[p[:-1]]["used"] for p in self.prefixes)
        info["reason"] = "; ".join(f"{p[:-1]}: {info[p[:-1]]['reason']}" for p in self.prefixes)
        return {split: MultiExamples([part[split] for part in parts], self.prefixes) for split in parts[0]}, info

    # ----------------------------------------------------------------------------------------------------------
    # Training

    def base_tensors(self) -> set[str]:
        """Tensors provided by the encoders' checkpoints (see `LanguageModel.base_tensors`)."""
        return {f"language_models.{index}.{name}" for index, lm in enumerate(self.language_models)
                for name in lm.base_tensors()}

    def combination_parameters(self) -> list[nn.Parameter]:
        """The projections and attention of dme (none for concat): new weights, trained at the head's rate."""
        return list(self.combine.parameters())

    def parameter_parts(self) -> dict[str, str]:
        """Parameter name → part: ``lm0/embeddings``, ``lm1/layer.3`` … and ``combine`` for dme's own weights."""
        parts = {}
        for index, lm in enumerate(self.language_models):
            parts.update({f"language_models.{index}.{name}": f"lm{index}/{part}"
                          for name, part in lm.parameter_parts().items()})
        return {name: parts.get(name, "combine") for name, _ in self.named_parameters()}

    # ----------------------------------------------------------------------------------------------------------
    # Persistence: each encoder's HF config + tokenizer in its own subfolder lm0/, lm1/ …

    def save_config(self, directory: str | Path, tokenizer: bool = True) -> None:
        for prefix, lm in zip(self.prefixes, self.language_models):
            lm.save_config(Path(directory) / prefix[:-1], tokenizer)


    @classmethod
    def from_saved(cls, directory: str | Path, specs: list, combine, pooling_sources: list[str], *,
                   trust_remote_code: bool = False, pretrained: bool = False) -> MultiEncoder:
        """Rebuild from `save_config`'s folders and the specs saved beside them: an `EncoderSpec` per language model
        (see `LanguageModel.from_saved`) and the `CombineSpec`."""
        language_models = [LanguageModel.from_saved(Path(directory) / f"lm{index}", spec, source,
                                                    trust_remote_code=trust_remote_code, pretrained=pretrained)
                           for index, (spec, source) in enumerate(zip(specs, pooling_sources))]
        return cls(language_models, combine.method, combine.dropout, combine.projection_size)


def _features(batch: dict, prefix: str) -> dict:
    """One encoder's share of a multi-encoder batch, prefix removed."""
    return {key[len(prefix):]: value for key, value in batch.items() if key.startswith(prefix)}


def _check_language_models(language_models) -> None:
    if not isinstance(language_models, (list, tuple)):
        raise TypeError(f"language_models must be a list of LanguageModel; got {type(language_models).__name__}.")
    if len(language_models) < 2:
        raise ValueError(
            f"A MultiEncoder combines at least two language models; got {len(language_models)}. For one encoder, "
            "use the LanguageModel itself: TextClassifier(encoder=LanguageModel(...), num_classes=...)."
        )
    for index, lm in enumerate(language_models):
        if not isinstance(lm, LanguageModel):
            raise TypeError(
                f"language_models[{index}] is a {type(lm).__name__}, not a LanguageModel: a MultiEncoder combines "
                "LanguageModel instances (nested MultiEncoders are not supported; list all the encoders instead)."
            )
    _check_no_shared_weights(language_models)


def _check_no_shared_weights(language_models: list[LanguageModel]) -> None:
    """A weight in two encoders would get two learning rates and be stepped twice: ask for separate copies."""
    owner = {}
    for index, lm in enumerate(language_models):
        for parameter in lm.parameters():
            first = owner.setdefault(id(parameter), index)
            if first != index:
                raise ValueError(
                    f"language_models[{first}] and language_models[{index}] share weights (the same LanguageModel "
                    "object twice?). Create a separate LanguageModel for each position, even of one checkpoint."
                )


def _check_combination(combine_method: str, dropout: float, projection_size: int | None) -> None:
    if combine_method not in COMBINE_METHODS:
        raise ValueError(f"Unknown combine_method {combine_method!r}.{choices_hint(combine_method, COMBINE_METHODS)}")
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
        raise ValueError(f"dropout must be a probability in [0, 1); got {dropout!r}.")
    if projection_size is None:
        return
    if combine_method != "dme":
        raise ValueError(f"projection_size applies to combine_method='dme' only; {combine_method!r} does not project.")
    if isinstance(projection_size, bool) or not isinstance(projection_size, int) or projection_size < 1:
        raise ValueError(f"projection_size must be a positive int; got {projection_size!r}.")
