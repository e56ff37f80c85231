"""`TokenClassifier`: one tag per word (named-entity recognition), from the encoder's per-token states.

Words are split into word pieces; a word's tag is read from, and trained on, its first piece only (labels -100 on the
other pieces, see `layertune.tokenization`), the convention of BERT's CoNLL-2003 experiments.
"""

from __future__ import annotations

import logging
from typing import Literal

import torch
from torch import nn

from layertune.batching import IGNORE_INDEX
from layertune.heads import TaskModel, load_encoder

logger = logging.getLogger(__name__)


class TokenClassifier(TaskModel):
    """A linear (or MLP) head on every token state; cross-entropy over first word pieces.

    ``label_names`` are the tags (IOB2, e.g. ``O``, ``B-PER``, ``I-PER``) in id order; scoring and `predict`
    need them, so give them unless the model is only trained on raw ids.
    """

    task_type = "token_classification"

    def __init__(self, encoder: nn.Module, num_labels: int, *, label_names: list[str] | tuple[str, ...] | None = None,
                 head: Literal["linear", "mlp"] = "linear", head_hidden_size: int | None = None,
                 head_dropout: float = 0.1) -> None:
        if isinstance(num_labels, bool) or not isinstance(num_labels, int) or num_labels < 2:
            raise ValueError(f"num_labels must be an int >= 2; got {num_labels!r}.")
        if not hasattr(encoder, "token_states"):
            raise TypeError(f"TokenClassifier needs an encoder with per-token states (a LanguageModel); "
                            f"{type(encoder).__name__} has no token_states.")
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

    # ----------------------------------------------------------------------------------------------------------

    @torch.no_grad()
    def predict(self, sentences: list[list[str]], batch_size: int = 32) -> list[list[str]]:
        """One tag per word for each sentence (a list of words). Words beyond the model's length get ``O``."""
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
                results.append(tags)
                cut += missing
        if cut:
            logger.warning("%d words had no word piece within max_length=%d (or none at all) and were tagged 'O'.",
                           cut, self.encoder.max_length)
        return results

    # ----------------------------------------------------------------------------------------------------------

    def extra_config(self) -> dict:
        return {"num_labels": self.num_labels, "label_names": self.label_names}

    @classmethod
    def _from_config(cls, directory, config) -> TokenClassifier:
        encoder = load_encoder(directory / "encoder", config["encoder"])
        return cls(encoder, config["num_labels"], label_names=config["label_names"], head=config["head"],
                   head_hidden_size=config["head_hidden_size"], head_dropout=config["head_dropout"])


def word_tags(word_ids: list[int | None], piece_predictions: list[int], num_words: int,
              names: list[str]) -> tuple[list[str], int]:
    """Each word's tag from its first piece, ``O`` for words without a piece; and how many had none."""
    tags: list[str | None] = [None] * num_words
    for position, word in enumerate(word_ids):
        if word is not None and tags[word] is None:
            tags[word] = names[piece_predictions[position]]
    missing = sum(tag is None for tag in tags)
    return [tag or "O" for tag in tags], missing
