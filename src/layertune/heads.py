"""Task models: an encoder with a classification, regression or tagging head (saved by `layertune.persistence`).

`TextClassifier` and `TextRegressor` put their head on one pooled vector per text; `TokenClassifier` (named-entity
recognition) puts it on every token state and reads each word's tag from its first word piece, the convention of
BERT's CoNLL-2003 experiments (later pieces carry label -100, see `layertune.tokenization`).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import ClassVar, Literal

import torch
from torch import nn

from layertune import initialization, persistence
from layertune.batching import IGNORE_INDEX
from layertune.encoder import Encoder, TokenEncoder, require
from layertune.errors import choices_hint
from layertune.model_specs import CombineSpec, EncoderSpec, HeadSpec
from layertune.multi_encoder import MultiEncoder

logger = logging.getLogger(__name__)

HEAD_TYPES = ("linear", "mlp")


class TaskModel(nn.Module):
    """An encoder (`LanguageModel` or `MultiEncoder`) plus a head. Subclasses define the head's use and the loss."""

    task_type: ClassVar[str]

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        persistence.register(cls)

    def __init__(self, encoder: Encoder, num_outputs: int, head: str, head_hidden_size: int | None,
                 head_dropout: float) -> None:
        super().__init__()
        require(encoder, Encoder, f"{type(self).__name__} needs an encoder (a LanguageModel or MultiEncoder)")
        if head not in HEAD_TYPES:
            raise ValueError(f"Unknown head {head!r}.{choices_hint(head, HEAD_TYPES)}")
        self.encoder = encoder
        self.head_settings = {"head": head, "head_hidden_size": head_hidden_size, "head_dropout": head_dropout}
        width = encoder.hidden_size
        if head == "linear":
            self.head = nn.Sequential(nn.Dropout(head_dropout), nn.Linear(width, num_outputs))
        else:
            hidden = head_hidden_size or width
            self.head = nn.Sequential(
                nn.Dropout(head_dropout), nn.Linear(width, hidden), nn.ReLU(), nn.Dropout(head_dropout),
                nn.Linear(hidden, num_outputs),
            )
        # The new parts' content hash as built or drawn (None: loaded): changed, they trained (see `begin_training`).
        self._initial_digest: str | None = initialization.new_parts_digest(self)

    def forward(self, batch: dict) -> torch.Tensor:
        return self.head(self.encoder(batch))

    def loss(self, outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def loss_terms(self, labels: torch.Tensor) -> int:
        """How many terms `loss` averages over: one per example here (one per labelled piece for tagging)."""
        return len(labels)

    def predictions(self, outputs: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def metric_inputs(self, outputs: torch.Tensor, labels: torch.Tensor) -> tuple[list, list]:
        """Predictions and references of a batch in the form the task's metrics take."""
        return self.predictions(outputs).tolist(), labels.tolist()

    def parameter_parts(self) -> dict[str, str]:
        """Every parameter name → the part it belongs to (``head``, ``embeddings``, ``layer.3`` …)."""
        parts = {f"encoder.{name}": part for name, part in self.encoder.parameter_parts().items()}
        return {name: parts.get(name, "head") for name, _ in self.named_parameters()}

    def head_parameters(self) -> list[nn.Parameter]:
        """Parameters that are not the encoder's: these get the head learning rate."""
        # A MultiEncoder's combination layer (dme projections + attention) is new and task-specific like the head.
        return list(self.head.parameters()) + self.encoder.combination_parameters()

    @property
    def trained(self) -> bool:
        """Whether the new parts are the model's own: loaded with `from_pretrained`, or changed (by any training)
        since they were built or drawn."""
        return self._initial_digest is None or initialization.new_parts_digest(self) != self._initial_digest

    def mark_trained(self) -> None:
        """Keep the present weights from now on (`from_pretrained` calls this): `begin_training` draws nothing."""
        self._initial_digest = None

    def begin_training(self, seed: int, targets=None) -> None:
        """Before training (`ModelTrainer.train` calls this once its settings are checked, before its data is
        prepared): draw every new part, not from a checkpoint, from ``seed`` (`layertune.initialization`), unless
        the model has trained or was loaded. Built weights otherwise depend on what the process drew before; drawn
        from the seed, the same call trains alike in any process. A trained model's weights are its own: a later
        `train` continues from them. ``targets``: the training labels, which a head may start from
        (`TextRegressor`: their mean)."""
        if self.trained:
            return
        initialization.draw_new_parts(self, seed)
        if targets is not None:
            self.start_from_targets(targets)
        self._initial_digest = initialization.new_parts_digest(self)

    def start_from_targets(self, targets) -> None:
        """Set the new head's starting point from the training labels (nothing to set for most heads)."""

    # ----------------------------------------------------------------------------------------------------------

    @torch.no_grad()
    def predict(self, sentences: list[str] | list[tuple[str, str]], batch_size: int = 32, *,
                return_ids: bool = False) -> list:
        """Predictions for raw sentences (or sentence pairs), tokenized with the encoder's own tokenizer: label
        names where the model has them (``return_ids=True``: class ids), scores for a regressor."""
        _check_sentences(sentences)
        self.eval()
        device = next(self.parameters()).device
        results = []
        for start in range(0, len(sentences), batch_size):
            batch = self.encoder.tokenize(sentences[start : start + batch_size])
            batch = {k: v.to(device) for k, v in batch.items()}
            predicted = self.predictions(self(batch)).tolist()
            results += predicted if return_ids else self.decode(predicted)
        return results

    def decode(self, predictions: list) -> list:
        return predictions

    def predict_with_attention(self, sentences: list[str] | list[tuple[str, str]], batch_size: int = 32, *,
                               return_ids: bool = False) -> tuple[list, list[list[float]]]:
        """Predictions as `predict` gives them (label names where the model has them; ``return_ids=True``: class
        ids), and per example the weight a dme `MultiEncoder` gave each encoder (each row sums to 1)."""
        method = self.encoder.combine_method if isinstance(self.encoder, MultiEncoder) else None
        if method != "dme":
            why = (f"this model's MultiEncoder uses combine_method={method!r}, which has no attention" if method
                   else f"this model's encoder is a single {type(self.encoder).__name__}, with nothing to weigh")
            raise ValueError(f"predict_with_attention needs a MultiEncoder with combine_method='dme'; {why}.")
        _check_sentences(sentences)
        predictions, attention = [], []
        for start in range(0, len(sentences), batch_size):
            chunk = sentences[start : start + batch_size]
            predictions += self.predict(chunk, batch_size=len(chunk), return_ids=return_ids)
            attention += self.encoder.last_attention.float().tolist()
        return predictions, attention

    # ----------------------------------------------------------------------------------------------------------
    # Persistence (see `layertune.persistence`)

    def config(self) -> dict:
        """What ``config.json`` holds: the specs that build this model, as peft saves its config classes (an
        `EncoderSpec` per language model, the `CombineSpec` of a `MultiEncoder`, the `HeadSpec`), each language
        model's `pooling_source`, and what the task adds (its classes)."""
        lms = self.encoder.language_models
        combine = CombineSpec.of(self.encoder) if isinstance(self.encoder, MultiEncoder) else None
        return {"class": type(self).__name__, "encoders": [EncoderSpec.of(lm).model_dump(mode="json") for lm in lms],
                "combine": combine and combine.model_dump(mode="json"),
                "head": HeadSpec(**self.head_settings).model_dump(mode="json"),
                "pooling_source": [lm.pooling_source for lm in lms], **self.extra_config()}

    def extra_config(self) -> dict:
        return {}

    def save(self, directory: str | Path) -> Path:
        """Write ``config.json``, ``model.safetensors`` and the encoder's config; all or nothing.

        A model that kept at least a tenth of its weights frozen stores only what it trained (tunable layers, head,
        combination): the frozen rest is the base model's, which `from_pretrained` loads again by name and checks
        against a content hash recorded here. A model that trained (nearly) everything stores everything, tokenizer
        included, and needs no base."""
        return persistence.save_task_model(self, directory)

    @classmethod
    def from_pretrained(cls, directory: str | Path, *, trust_remote_code: bool = False) -> TaskModel:
        """Load a model written by `save`; the class is read from its config (works on the base class too).

        ``trust_remote_code`` comes from the caller only, never from the folder: a saved folder cannot make its
        loader run code that ships with it. A model that stored only what it trained is rebuilt on its base model;
        if those base weights differ from the ones it was trained on, that is an error, not a silent mix.
        """
        return persistence.load_task_model(cls, directory, trust_remote_code=trust_remote_code)

    def merge(self) -> TaskModel:
        """Fold each language model's adapters (LoRA, IA3) into plain weights (`LanguageModel.merge`), in place, and
        return this model: it predicts the same (up to float rounding) without peft, and saves as a top-K model
        (only the top K layers, or everything with tunable_layers='all'). ``copy.deepcopy`` it first to keep the
        adapters too."""
        for lm in self.encoder.language_models:
            lm.merge()
        return self

    @classmethod
    def _from_config(cls, encoder: Encoder, config: dict) -> TaskModel:
        raise NotImplementedError


def _check_sentences(sentences) -> None:
    if isinstance(sentences, (str, tuple)):
        raise TypeError(f"predict takes a list of sentences (or of sentence pairs), not one {type(sentences).__name__}"
                        f": wrap it in a list, e.g. predict([{sentences!r}]).")


def _head_arguments(config: dict) -> dict:
    return HeadSpec.model_validate(config["head"]).model_dump()


class TextClassifier(TaskModel):
    """Sentence (pair) classification: a linear or MLP head on the pooled encoder output."""

    task_type = "classification"

    def __init__(self, encoder: Encoder, num_classes: int, *, label_names: list[str] | None = None,
                 head: Literal["linear", "mlp"] = "linear", head_hidden_size: int | None = None,
                 head_dropout: float = 0.1) -> None:
        if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 2:
            raise ValueError(f"num_classes must be an int >= 2; got {num_classes!r}: a classifier needs at least two "
                             f"classes to choose from (a corpus whose labels are all one class cannot train one).")
        if label_names is not None and len(label_names) != num_classes:
            raise ValueError(f"{len(label_names)} label_names {list(label_names)} for num_classes={num_classes}.")
        super().__init__(encoder, num_classes, head, head_hidden_size, head_dropout)
        self.num_classes = num_classes
        self.label_names = list(label_names) if label_names else None

    def loss(self, outputs, labels):
        return nn.functional.cross_entropy(outputs, labels)

    def predictions(self, outputs):
        return outputs.argmax(-1)

    def decode(self, predictions: list) -> list:
        return [self.label_names[i] for i in predictions] if self.label_names else predictions

    def extra_config(self):
        return {"num_classes": self.num_classes, "label_names": self.label_names}

    @classmethod
    def _from_config(cls, encoder, config):
        return cls(encoder, config["num_classes"], label_names=config["label_names"], **_head_arguments(config))


class TextRegressor(TaskModel):
    """Sentence (pair) regression, e.g. STS-B similarity: one output, mean squared error."""

    task_type = "regression"
    num_classes = 1

    def __init__(self, encoder: Encoder, *, head: Literal["linear", "mlp"] = "linear",
                 head_hidden_size: int | None = None, head_dropout: float = 0.1) -> None:
        super().__init__(encoder, 1, head, head_hidden_size, head_dropout)

    def loss(self, outputs, labels):
        # In float32: under bf16 the outputs are bf16, and the targets rounded to them would move the loss
        return nn.functional.mse_loss(outputs.squeeze(-1).float(), labels.float())

    def predictions(self, outputs):
        return outputs.squeeze(-1)

    @torch.no_grad()
    def start_from_targets(self, targets) -> None:
        """The output layer's bias starts at the mean training target, as a least-squares fit with no features
        would: from 0, against STS-B's mean of 2.7 (variance 2.1), most of a short budget went into learning the
        mean."""
        self.head[-1].bias.fill_(float(torch.as_tensor(targets, dtype=torch.float64).mean()))

    @classmethod
    def _from_config(cls, encoder, config):
        return cls(encoder, **_head_arguments(config))


class TokenClassifier(TaskModel):
    """One tag per word: a linear (or MLP) head on every token state, cross-entropy over first word pieces.

    ``label_names`` are the tags (IOB2, e.g. ``O``, ``B-PER``, ``I-PER``) in id order; scoring and `predict`
    need them, so give them unless the model is only trained on raw ids.
    """

    task_type = "token_classification"

    def __init__(self, encoder: TokenEncoder, num_labels: int, *,
                 label_names: list[str] | tuple[str, ...] | None = None, head: Literal["linear", "mlp"] = "linear",
                 head_hidden_size: int | None = None, head_dropout: float = 0.1) -> None:
        if isinstance(num_labels, bool) or not isinstance(num_labels, int) or num_labels < 2:
            raise ValueError(f"num_labels must be an int >= 2; got {num_labels!r}.")
        require(encoder, TokenEncoder, "TokenClassifier needs an encoder with per-token states (a LanguageModel)")
        if label_names is not None and len(label_names) != num_labels:
            raise ValueError(f"{len(label_names)} label_names {list(label_names)} for num_labels={num_labels}.")
        super().__init__(encoder, num_labels, head, head_hidden_size, head_dropout)
        self.num_labels = num_labels
        self.label_names = list(label_names) if label_names is not None else None

    @property
    def num_classes(self) -> int:
        """The trainer's name for the head's output size."""
        return self.num_labels

    def forward(self, batch: dict) -> torch.Tensor:
        """Tag scores per word piece (batch, tokens, num_labels)."""
        return self.head(self.encoder.token_states(batch))

    def loss(self, outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if not (labels != IGNORE_INDEX).any():
            # Cross-entropy over zero labelled pieces is 0/0 = NaN, which would poison every weight it reaches.
            return outputs.sum() * 0.0
        return nn.functional.cross_entropy(outputs.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX)

    def loss_terms(self, labels: torch.Tensor) -> int:
        return int((labels != IGNORE_INDEX).sum())

    def predictions(self, outputs: torch.Tensor) -> torch.Tensor:
        return outputs.argmax(-1)

    def metric_inputs(self, outputs: torch.Tensor, labels: torch.Tensor) -> tuple[list, list]:
        """Predicted and gold tag strings per sentence, over the labelled (first) pieces only, for seqeval."""
        names = self._tag_names()
        predicted, gold = self.predictions(outputs).tolist(), labels.tolist()
        predictions, references = [], []
        for predicted_row, gold_row in zip(predicted, gold):
            scored = [i for i, label in enumerate(gold_row) if label != IGNORE_INDEX]
            predictions.append([names[predicted_row[i]] for i in scored])
            references.append([names[gold_row[i]] for i in scored])
        return predictions, references

    def _tag_names(self) -> list[str]:
        if self.label_names is None:
            raise ValueError("This TokenClassifier has no label_names, so its predictions cannot be turned into "
                             "tags or scored; build it with label_names=corpus.label_names.")
        return self.label_names

    @torch.no_grad()
    def predict(self, sentences: list[list[str]], batch_size: int = 32, *, return_ids: bool = False) -> list[list]:
        """One tag per word for each sentence (a list of words); ``return_ids=True``: tag ids. Words beyond the
        model's length get ``O``."""
        if isinstance(sentences, str) or any(isinstance(s, str) for s in sentences):
            raise TypeError("predict takes a list of sentences, each a list of words, e.g. [['EU', 'rejects', "
                            "'German', 'call']]; split raw text into words first.")
        names = self._tag_names()
        self.eval()
        device = next(self.parameters()).device
        tokenizer, results, cut = self.encoder.tokenizer, [], 0
        for start in range(0, len(sentences), batch_size):
            chunk = [list(s) for s in sentences[start : start + batch_size]]
            encoded = tokenizer(chunk, is_split_into_words=True, truncation=True, max_length=self.encoder.max_length,
                                padding=True, return_tensors="pt")
            batch = {k: v.to(device) for k, v in self.encoder.model_inputs(encoded).items()}
            predicted = self.predictions(self(batch)).tolist()
            for row, words in enumerate(chunk):
                tags, missing = word_tags(encoded.word_ids(row), predicted[row], len(words), names)
                results.append([names.index(tag) for tag in tags] if return_ids else tags)
                cut += missing
        if cut:
            logger.warning("%d words had no word piece within max_length=%d (or none at all) and were tagged 'O'.",
                           cut, self.encoder.max_length)
        return results

    def extra_config(self) -> dict:
        return {"num_labels": self.num_labels, "label_names": self.label_names}

    @classmethod
    def _from_config(cls, encoder, config) -> TokenClassifier:
        return cls(encoder, config["num_labels"], label_names=config["label_names"], **_head_arguments(config))


def word_tags(word_ids: list[int | None], piece_predictions: list[int], num_words: int,
              names: list[str]) -> tuple[list[str], int]:
    """Each word's tag from its first piece, ``O`` for words without a piece; and how many had none."""
    tags: list[str | None] = [None] * num_words
    for position, word in enumerate(word_ids):
        if word is not None and tags[word] is None:
            tags[word] = names[piece_predictions[position]]
    missing = sum(tag is None for tag in tags)
    return [tag or "O" for tag in tags], missing


def build_model(encoder: Encoder, corpus, head: Literal["linear", "mlp"] = "linear",
                head_hidden_size: int | None = None, head_dropout: float = 0.1) -> TaskModel:
    """The head that fits the corpus's task type, with the corpus's label names."""
    arguments = {"head": head, "head_hidden_size": head_hidden_size, "head_dropout": head_dropout}
    if corpus.task_type == "regression":
        return TextRegressor(encoder, **arguments)
    if corpus.task_type == "token_classification":
        return TokenClassifier(encoder, len(corpus.label_names), label_names=list(corpus.label_names), **arguments)
    return TextClassifier(encoder, corpus.num_classes, label_names=list(corpus.label_names), **arguments)
