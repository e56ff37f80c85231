"""`LanguageModel`: any Hugging Face encoder with only its top K layers trainable, whole or through a tuning method
(LoRA, IA3, BitFit: `layertune.tuning_methods`).

It loads, freezes, tokenizes and runs the model, from the embeddings or from given states entering a layer; which
states to cache and when is `layertune.frozen_prefix`'s business.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import pandas as pd
import torch
import transformers
from torch import nn

from layertune import frozen_prefix
from layertune.batching import Examples
from layertune.errors import choices_hint
from layertune.layer_stack import embeddings_name, layer_stack
from layertune.model_loading import load_base_model, load_config, load_tokenizer, load_weights, set_hidden_dropout
from layertune.model_paths import default_pooling, resolve_model_path
from layertune.tuning_methods import TopK, TuningMethod, tuning_method

if TYPE_CHECKING:
    from layertune.training_config import TrainingConfig

logger = logging.getLogger(__name__)

Pooling = Literal["cls", "mean", "pooler"]
POOLINGS = ("cls", "mean", "pooler")

class LanguageModel(nn.Module):
    """A pretrained encoder whose top ``tunable_layers`` transformer layers train; the rest is frozen.

    ``tunable_layers="all"`` (the default: full fine-tuning, as in BERT's recipe) trains everything, embeddings
    included (unless ``freeze_embeddings``);
    an int K trains the top K layers (plus the pooler, with ``pooling="pooler"`` and K >= 1); 0 leaves only the
    task head to train.
    ``frozen_layers=N`` is the other common spelling: the bottom N layers frozen, i.e. K = L - N.
    ``layers`` is the dotted path of the transformer layer stack (an ``nn.ModuleList``, e.g. ``"encoder.layer"``)
    for a model whose stack the generic guess (`encoder_layers`) does not find.

    ``method`` is what trains in the tuned layers (`layertune.tuning_methods`): ``"top_k"`` (the default) the layers
    whole; ``Lora(r=8)`` / ``"lora"``, ``IA3()`` / ``"ia3"`` peft adapters in them, ``BitFit()`` / ``"bitfit"`` their
    biases. Whatever the method, the embeddings and the layers below the top K are untouched. `merge` folds adapters
    into plain weights.

    ``pooling`` makes one vector of the last layer's states: ``"cls"`` the first token's, ``"mean"`` the mean over
    the tokens, ``"pooler"`` the model's pooler on the first token. None (the default) is the model's own where it
    declares one (a sentence-transformers model's pooling config: all-MiniLM-L6-v2 was trained with mean pooling),
    else ``"cls"``; `pooling_source` says which and why, and a saved model keeps both.

    Frozen layers are constants, so by default they run in eval mode (no dropout) even while training.
    ``frozen_dropout=True`` keeps train-mode dropout in them, as a plain ``requires_grad=False`` recipe does.
    """

    def __init__(
        self,
        name_or_path: str | Path,
        tunable_layers: int | Literal["all"] | None = None,
        *,
        frozen_layers: int | None = None,
        pooling: Pooling | None = None,
        hidden_dropout_prob: float | None = None,
        freeze_embeddings: bool = False,
        frozen_dropout: bool = False,
        trust_remote_code: bool = False,
        revision: str | None = None,
        layers: str | None = None,
        method: TuningMethod | str | dict = "top_k",
    ) -> None:
        super().__init__()
        self.method = _checked_method(method)
        if frozen_layers is None:
            self.method.check_tunable_layers(tunable_layers)  # K=0 with an adapter method: before loading anything
        if pooling is not None and pooling not in POOLINGS:
            raise ValueError(f"Unknown pooling {pooling!r}.{choices_hint(pooling, POOLINGS)}")
        if layers is not None and not isinstance(layers, str):
            raise ValueError(f"layers must be the dotted path of the layer stack, e.g. 'encoder.layer'; got "
                             f"{layers!r}.")
        self.name = str(name_or_path)
        self.layers_path = layers
        self.pooling, self.pooling_source = (pooling, "given") if pooling is not None else \
            default_pooling(name_or_path, revision)
        self.hidden_dropout_prob = hidden_dropout_prob
        self.freeze_embeddings = freeze_embeddings
        self.frozen_dropout = frozen_dropout
        self.trust_remote_code = trust_remote_code
        self.revision = revision
        path = resolve_model_path(name_or_path)
        config = load_config(path, trust_remote_code, revision)
        if hidden_dropout_prob is not None:
            set_hidden_dropout(config, hidden_dropout_prob)
        self.method.check_model(config, layers, self.name)  # target modules, rank: before any weight is read
        # `initialized`: tensors not in the checkpoint, newly (randomly) initialized
        self.model, self.initialized = load_weights(path, config, trust_remote_code, revision)
        self.tokenizer = load_tokenizer(path, trust_remote_code, revision)
        self._init_structure()
        self.tunable_layers = self._resolve_tunable_layers(tunable_layers, frozen_layers)
        if frozen_layers is not None:  # K = L - frozen_layers is known only now (checked above otherwise)
            self.method.check_tunable_layers(self.tunable_layers)
        self._apply_freezing()

    @classmethod
    def from_saved(cls, directory: str | Path, spec, pooling_source: str = "saved with the model", *,
                   trust_remote_code: bool = False, pretrained: bool = False) -> LanguageModel:
        """Rebuild from a saved config folder and the `EncoderSpec` saved beside it (``spec``): with random weights
        (the whole state dict is loaded next), or with ``pretrained`` the base model's weights (``spec.model``), under
        which only trained tensors load.

        ``trust_remote_code`` is the caller's decision alone: nothing in the saved folder can turn it on (the
        spec's own ``trust_remote_code`` is the record of how it was trained, not read)."""
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self.name, self.revision, self.layers_path = spec.model, spec.revision, spec.layers
        self.pooling, self.pooling_source = spec.pooling, pooling_source
        self.hidden_dropout_prob = spec.hidden_dropout_prob  # already in the saved HF config
        self.freeze_embeddings, self.frozen_dropout = spec.freeze_embeddings, spec.frozen_dropout
        self.trust_remote_code = trust_remote_code
        self.method = spec.method
        config = load_config(str(directory), trust_remote_code, None)
        if pretrained:
            self.model, self.tokenizer, self.initialized = load_base_model(self.name, config, trust_remote_code,
                                                                       self.revision)
        else:
            self.model = transformers.AutoModel.from_config(config, trust_remote_code=trust_remote_code)
            self.tokenizer = load_tokenizer(directory, trust_remote_code, None)
            self.initialized = {name for name, _ in self.model.state_dict().items()}
        self._init_structure()
        self.tunable_layers = self._resolve_tunable_layers(spec.tunable_layers, None)
        self._apply_freezing()
        return self

    def base_tensors(self) -> set[str]:
        """Names (in this module's state dict) of the tensors its checkpoint provided: a saved model can leave these
        to its base model. Tensors the checkpoint lacked (a pooler, say) were initialized at random, and a method's
        adapters are new."""
        provided = self._plain_names - self.initialized
        # peft moves an adapted module's own weights one level down: query.weight → query.base_layer.weight.
        return {f"model.{name}" for name in self.model.state_dict() if name.replace(".base_layer.", ".") in provided}

    def save_config(self, directory: str | Path, tokenizer: bool = True) -> None:
        """The HF config (hidden dropout and all), and the tokenizer unless it comes from the base model."""
        self.model.config.save_pretrained(directory)
        if tokenizer:
            self.tokenizer.save_pretrained(directory)

    # ----------------------------------------------------------------------------------------------------------
    # Structure and freezing

    def _init_structure(self) -> None:
        # Submodules are remembered by name: keeping them as attributes would register them twice.
        self._stack_name, self.num_layers = layer_stack(self.model, self.layers_path)
        self._embeddings_name = embeddings_name(self.model)
        self._has_pooler = getattr(self.model, "pooler", None) is not None
        accepted = inspect.signature(self.model.forward).parameters
        self._model_inputs = tuple(k for k in ("input_ids", "attention_mask", "token_type_ids") if k in accepted)

    @property
    def layers(self) -> nn.ModuleList:
        return self.model.get_submodule(self._stack_name)

    @property
    def layers_name(self) -> str:
        """Dotted path of the layer stack in ``model`` (e.g. ``encoder.layer``)."""
        return self._stack_name

    @property
    def tuned_layer_indices(self) -> list[int]:
        """Indices of the layers the method tunes: the top ``tunable_layers``, or every one."""
        first = 0 if self.tunable_layers == "all" else self.num_layers - self.tunable_layers
        return list(range(first, self.num_layers))

    @property
    def embeddings(self) -> nn.Module:
        return self.model.get_submodule(self._embeddings_name)

    @property
    def pooler(self) -> nn.Module | None:
        return self.model.pooler if self._has_pooler else None

    @property
    def hidden_size(self) -> int:
        return self.model.config.hidden_size if hasattr(self.model.config, "hidden_size") else self.model.config.dim

    @property
    def frozen_prefix_layers(self) -> int | None:
        """How many bottom layers are frozen; None when every layer is tuned (``tunable_layers="all"``), whatever
        the method."""
        return None if self.tunable_layers == "all" else self.num_layers - self.tunable_layers

    @property
    def language_models(self) -> list[LanguageModel]:
        """``[self]``: the language models of an encoder, as `MultiEncoder.language_models` lists its own."""
        return [self]

    def _resolve_tunable_layers(self, tunable_layers, frozen_layers) -> int | Literal["all"]:
        limit = self.num_layers
        where = f"{self.name!r} has {limit} layers"
        if frozen_layers is not None:
            if tunable_layers is not None:
                raise ValueError("Give tunable_layers or frozen_layers, not both: they say the same thing.")
            if isinstance(frozen_layers, bool) or not isinstance(frozen_layers, int) or not 0 <= frozen_layers <= limit:
                raise ValueError(f"frozen_layers must be an int from 0 to {limit} ({where}); got {frozen_layers!r}.")
            return limit - frozen_layers
        if tunable_layers is None or tunable_layers == "all":  # None: neither given, so full fine-tuning
            return "all"
        if isinstance(tunable_layers, bool) or not isinstance(tunable_layers, int) or not 0 <= tunable_layers <= limit:
            raise ValueError(
                f"tunable_layers must be 'all' or an int from 0 to {limit} ({where}); got {tunable_layers!r}."
            )
        return tunable_layers

    def _apply_freezing(self) -> None:
        self._plain_names = set(self.model.state_dict())  # before any adapter renames a tensor (`base_tensors`)
        # The peft tuner (None for top-K and BitFit) only points at self.model: kept outside the module tree, so
        # that no parameter is registered twice.
        object.__setattr__(self, "_adapters", self.method.apply(self))

    def merge(self) -> LanguageModel:
        """Fold the method's adapters into plain weights (peft's ``merge_and_unload``), in place, and return this
        model, now top-K tuned with the same ``tunable_layers``: the same predictions (up to float rounding) from
        plain layers, which save as a top-K model does (only the top K layers when K < L). BitFit and top-K have
        nothing to fold."""
        if self._adapters is not None:
            self._adapters.merge_and_unload()
        self.method = TopK()
        self._apply_freezing()
        return self

    def frozen_modules(self) -> list[nn.Module]:
        """Modules whose parameters never change: run them as constants (eval mode) while training."""
        if self.tunable_layers == "all":
            # Frozen embeddings: freeze_embeddings, or a method that adapts the layers only (LoRA, IA3).
            return [] if any(p.requires_grad for p in self.embeddings.parameters()) else [self.embeddings]
        return [self.embeddings, *self.layers[: self.frozen_prefix_layers]]

    def train(self, mode: bool = True) -> LanguageModel:
        super().train(mode)
        if mode and not self.frozen_dropout:
            for module in self.frozen_modules():
                module.eval()
        return self

    def parameter_parts(self) -> dict[str, str]:
        """Parameter name → part: embeddings, layer.0 … layer.L-1, pooler or other."""
        parts = {id(p): "embeddings" for p in self.embeddings.parameters()}
        parts.update({id(p): "pooler" for p in (self.pooler.parameters() if self.pooler is not None else ())})
        for index, layer in enumerate(self.layers):
            parts.update({id(p): f"layer.{index}" for p in layer.parameters()})
        return {name: parts.get(id(p), "other") for name, p in self.named_parameters()}

    def summary(self) -> pd.DataFrame:
        """Trainable and total parameter counts per part (embeddings, layer.0 … layer.L-1, pooler, other)."""
        parts = self.parameter_parts()
        rows = [
            {"part": parts[name], "trainable": p.numel() if p.requires_grad else 0, "total": p.numel()}
            for name, p in self.named_parameters()
        ]
        table = pd.DataFrame(rows).groupby("part", sort=False).sum().reset_index()
        total = pd.DataFrame([{"part": "total", **table[["trainable", "total"]].sum().to_dict()}])
        return pd.concat([table, total], ignore_index=True)

    def __repr__(self) -> str:
        trainable = sum(p.numel() for p in self.parameters() if p.requires_grad)
        total = sum(p.numel() for p in self.parameters())
        method = "" if isinstance(self.method, TopK) else f"method={self.method.label()}, "
        source = "" if self.pooling_source == "given" else f" ({self.pooling_source})"
        return (
            f"LanguageModel({self.name!r}, tunable_layers={self.tunable_layers!r} of {self.num_layers}, {method}"
            f"pooling={self.pooling!r}{source}, trainable {trainable:,} / {total:,} parameters)"
        )

    # ----------------------------------------------------------------------------------------------------------
    # Forward

    @property
    def max_length(self) -> int:
        """The longest input the model takes (tokenizers often report a huge placeholder instead)."""
        limits = [self.tokenizer.model_max_length, getattr(self.model.config, "max_position_embeddings", 512)]
        return min(limits)

    def tokenize(self, texts: list[str] | list[tuple[str, str]], max_length: int | None = None) -> dict:
        """Padded model inputs for raw sentences or sentence pairs."""
        pairs = bool(texts) and isinstance(texts[0], (tuple, list))
        arguments = [list(t) for t in zip(*texts)] if pairs else [list(texts)]
        encoded = self.tokenizer(*arguments, truncation=True, max_length=max_length or self.max_length,
                                 padding=True, return_tensors="pt")
        return self.model_inputs(encoded)

    def combination_parameters(self) -> list[nn.Parameter]:
        """An empty list: one language model has nothing to combine (see `MultiEncoder.combination_parameters`)."""
        return []

    def prepare_examples(self, corpus, args: TrainingConfig | None = None, *, cache_dir=None, device: torch.device | str = "cpu",
                         autocast: torch.dtype | None = None) -> tuple[dict[str, Examples], dict]:
        """Tokenized examples of every split on ``device``, with cached frozen-prefix states where that is exact,
        enabled and cheaper; and what ran (see `layertune.frozen_prefix.prepare_examples`)."""
        return frozen_prefix.prepare_examples(self, corpus, args, cache_dir=cache_dir, device=device, autocast=autocast)

    def cache_features(self, corpus, boundaries: list[int], *, max_length: int | None = None, cache_dir=None,
                       cache_dtype: str = "auto", device: torch.device | str = "cpu",
                       autocast: torch.dtype | None = None) -> dict:
        """Tokenize every split and cache the states entering each of ``boundaries`` (see
        `layertune.frozen_prefix.cache_features`)."""
        return frozen_prefix.cache_features(self, corpus, boundaries, max_length=max_length, cache_dir=cache_dir,
                                            cache_dtype=cache_dtype, device=device, autocast=autocast)

    def check_max_length(self, max_length: int | None) -> None:
        """A ValueError if ``max_length`` is more than the model takes."""
        if max_length is not None and max_length > self.max_length:
            raise ValueError(f"max_length={max_length} is more than {self.name!r} takes: {self.max_length} tokens (its "
                             f"position embeddings and tokenizer). Use max_length <= {self.max_length}.")

    def model_inputs(self, batch: dict) -> dict:
        """The tokenizer outputs this architecture accepts (DistilBERT takes no token_type_ids, say)."""
        return {k: batch[k] for k in self._model_inputs if k in batch}

    def token_states(self, batch: dict) -> torch.Tensor:
        """Last-layer hidden states (batch, tokens, hidden).

        With ``batch["boundary_states"]`` (the cached input of the first tunable layer, or the final states
        when no layer trains) only the tunable top of the network runs.
        """
        cached = batch.get("boundary_states")
        if cached is None:
            return self.model(**self.model_inputs(batch)).last_hidden_state
        if self.frozen_prefix_layers is None:
            raise ValueError("boundary_states were given but every layer of this model trains; nothing is cached.")
        if self.frozen_prefix_layers == self.num_layers:
            return cached
        with self._starting_at_layer(self.frozen_prefix_layers, cached):
            return self.model(**self.model_inputs(batch)).last_hidden_state

    def forward(self, batch: dict) -> torch.Tensor:
        """One pooled vector per example (batch, hidden)."""
        states = self.token_states(batch)
        if self.pooling == "mean":
            mask = batch["attention_mask"].unsqueeze(-1).to(states.dtype)
            return (states * mask).sum(1) / mask.sum(1).clamp(min=1.0)
        if self.pooling == "pooler":
            if self.pooler is None:
                raise ValueError(f"{self.name!r} has no pooler; use pooling='cls' or 'mean'.")
            return self.pooler(states)
        return states[:, 0]

    @contextlib.contextmanager
    def _starting_at_layer(self, index: int, states: torch.Tensor) -> Iterator[None]:
        """Run the model from layer ``index`` on, fed ``states`` instead of the frozen prefix's output.

        The model's own forward still builds attention masks and position biases, which keeps this exact for
        any architecture whose encoder loops over its layer list; the embeddings' output is simply replaced.
        """
        full_stack = self.layers

        def feed_cached_states(module, args, kwargs):
            if args:
                return (states, *args[1:]), kwargs
            return args, {**kwargs, "hidden_states": states}

        owner_name, _, attribute = self._stack_name.rpartition(".")
        owner = self.model.get_submodule(owner_name)
        handle = full_stack[index].register_forward_pre_hook(feed_cached_states, with_kwargs=True)
        setattr(owner, attribute, nn.ModuleList(full_stack[index:]))
        try:
            yield
        finally:
            handle.remove()
            setattr(owner, attribute, full_stack)

    @torch.no_grad()
    def boundary_states(self, batch: dict, boundaries: list[int]) -> dict[int, torch.Tensor]:
        """Hidden states entering layer b for each b in ``boundaries`` (b = L: the final states), in one pass that
        runs no layer above the highest b."""
        captured: dict[int, torch.Tensor] = {}
        highest = max(boundaries)
        handles = []
        for b in boundaries:
            if b < self.num_layers:
                def capture(module, args, kwargs, b=b):
                    captured[b] = args[0] if args else kwargs["hidden_states"]
                    if b == highest:
                        raise _StatesCaptured  # nothing above is needed: stop the forward here
                handles.append(self.layers[b].register_forward_pre_hook(capture, with_kwargs=True))
        # Each module's own mode back afterwards: `train(was_training)` would instead put a freshly loaded model
        # (eval mode inside a train-mode wrapper) into train mode, so a run that built a cache entry would leave
        # the model otherwise than one that read it.
        modes = {module: module.training for module in self.modules()}
        self.eval()
        try:
            captured[self.num_layers] = self.model(**self.model_inputs(batch)).last_hidden_state
        except _StatesCaptured:
            pass
        finally:
            for handle in handles:
                handle.remove()
            for module, training in modes.items():
                module.training = training
        return {b: captured[b] for b in boundaries}


class _StatesCaptured(Exception):
    """Raised by `LanguageModel.boundary_states`'s hook once the highest boundary's states are captured."""


def _checked_method(method) -> TuningMethod:
    """``method`` as a spec; bad settings are one ValueError naming the key (``method.r``) and the valid values."""
    from pydantic import ValidationError

    from layertune.errors import describe_validation_error

    try:
        return tuning_method(method)
    except ValidationError as error:
        raise ValueError("; ".join(describe_validation_error(error, ("method",), TuningMethod))) from None
