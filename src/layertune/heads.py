"""Task models: an encoder with a classification or regression head, saved as safetensors + JSON."""

from __future__ import annotations

import json
from pathlib import Path
from typing import ClassVar, Literal

import safetensors.torch
import torch
from torch import nn

from layertune.errors import choices_hint
from layertune.io import atomic_directory, write_json
from layertune.language_model import LanguageModel

HEAD_TYPES = ("linear", "mlp")
_MODEL_CLASSES: dict[str, type[TaskModel]] = {}


class TaskModel(nn.Module):
    """An encoder (`LanguageModel` or `MultiEncoder`) plus a head. Subclasses define the head and the loss."""

    task_type: ClassVar[str]

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        _MODEL_CLASSES[cls.__name__] = cls

    def __init__(self, encoder: nn.Module, num_outputs: int, head: str, head_hidden_size: int | None,
                 head_dropout: float) -> None:
        super().__init__()
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
        combination = getattr(self.encoder, "combination_parameters", None)
        return list(self.head.parameters()) + (combination() if combination else [])

    # ----------------------------------------------------------------------------------------------------------

    @torch.no_grad()
    def predict(self, sentences: list[str] | list[tuple[str, str]], batch_size: int = 32) -> list:
        """Predictions for raw sentences (or sentence pairs), tokenized with the encoder's own tokenizer."""
        self.eval()
        device = next(self.parameters()).device
        results = []
        for start in range(0, len(sentences), batch_size):
            batch = self.encoder.tokenize(sentences[start : start + batch_size])
            batch = {k: v.to(device) for k, v in batch.items()}
            results += self.decode(self.predictions(self(batch)))
        return results

    def decode(self, predictions: torch.Tensor) -> list:
        return predictions.tolist()

    def predict_with_attention(self, sentences: list[str] | list[tuple[str, str]],
                               batch_size: int = 32) -> tuple[list, list[list[float]]]:
        """Predictions, and per example the weight a dme `MultiEncoder` gave each encoder (each row sums to 1)."""
        method = getattr(self.encoder, "combine_method", None)
        if method != "dme":
            why = (f"this model's MultiEncoder uses combine_method={method!r}, which has no attention" if method
                   else f"this model's encoder is a single {type(self.encoder).__name__}, with nothing to weigh")
            raise ValueError(f"predict_with_attention needs a MultiEncoder with combine_method='dme'; {why}.")
        predictions, attention = [], []
        for start in range(0, len(sentences), batch_size):
            chunk = sentences[start : start + batch_size]
            predictions += self.predict(chunk, batch_size=len(chunk))
            attention += self.encoder.last_attention.float().tolist()
        return predictions, attention

    # ----------------------------------------------------------------------------------------------------------
    # Persistence: safetensors for weights, JSON for settings; never pickle.

    def config(self) -> dict:
        return {"class": type(self).__name__, "encoder": self.encoder.settings(), **self.head_settings,
                **self.extra_config()}

    def extra_config(self) -> dict:
        return {}

    def save(self, directory: str | Path) -> Path:
        """Write ``config.json``, ``model.safetensors`` and the encoder's config + tokenizer; all or nothing."""
        with atomic_directory(directory) as staging:
            self.encoder.save_config(staging / "encoder")
            state = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
            safetensors.torch.save_file(state, staging / "model.safetensors")
            write_json(staging / "config.json", self.config())
        return Path(directory)

    @classmethod
    def from_pretrained(cls, directory: str | Path) -> TaskModel:
        """Load a model written by `save`; the class is read from its config (works on the base class too)."""
        directory = Path(directory)
        missing = [f for f in ("config.json", "model.safetensors", "encoder") if not (directory / f).exists()]
        if missing:
            raise ValueError(f"{directory} is not a complete saved layertune model: missing {', '.join(missing)}.")
        import layertune.token_classification  # noqa: F401  (registers TokenClassifier for the lookup below)

        try:
            config = json.loads((directory / "config.json").read_text())
            model_class = _MODEL_CLASSES[config["class"]]
        except (json.JSONDecodeError, KeyError) as error:
            raise ValueError(f"{directory}/config.json is corrupt or not a layertune model config ({error}).") from None
        if cls is not TaskModel and not issubclass(model_class, cls):
            raise ValueError(f"{directory} holds a {config['class']}, not a {cls.__name__}.")
        model = model_class._from_config(directory, config)
        try:
            state = safetensors.torch.load_file(directory / "model.safetensors")
        except Exception as error:  # safetensors raises its own error types for truncated/corrupt files
            raise ValueError(f"{directory}/model.safetensors is corrupt or partial ({error}).") from None
        model.load_state_dict(state)
        model.eval()
        return model

    @classmethod
    def _from_config(cls, directory: Path, config: dict) -> TaskModel:
        raise NotImplementedError


def load_encoder(directory: Path, settings: dict) -> nn.Module:
    """Rebuild a saved encoder (single or multi) from its settings, without downloading any weights."""
    if "language_models" in settings:
        from layertune.multi_encoder import MultiEncoder

        return MultiEncoder.from_config(directory, settings)
    return LanguageModel.from_config(directory, settings)


class TextClassifier(TaskModel):
    """Sentence (pair) classification: a linear or MLP head on the pooled encoder output."""

    task_type = "classification"

    def __init__(self, encoder: nn.Module, num_classes: int, *, label_names: list[str] | None = None,
                 head: Literal["linear", "mlp"] = "linear", head_hidden_size: int | None = None,
                 head_dropout: float = 0.1) -> None:
        if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 2:
            raise ValueError(f"num_classes must be an int >= 2; got {num_classes!r}. For a score use TextRegressor.")
        super().__init__(encoder, num_classes, head, head_hidden_size, head_dropout)
        self.num_classes = num_classes
        self.label_names = list(label_names) if label_names else None

    def loss(self, outputs, labels):
        return nn.functional.cross_entropy(outputs, labels)

    def predictions(self, outputs):
        return outputs.argmax(-1)

    def decode(self, predictions):
        ids = predictions.tolist()
        return [self.label_names[i] for i in ids] if self.label_names else ids

    def extra_config(self):
        return {"num_classes": self.num_classes, "label_names": self.label_names}

    @classmethod
    def _from_config(cls, directory, config):
        encoder = load_encoder(directory / "encoder", config["encoder"])
        return cls(encoder, config["num_classes"], label_names=config["label_names"], head=config["head"],
                   head_hidden_size=config["head_hidden_size"], head_dropout=config["head_dropout"])


class TextRegressor(TaskModel):
    """Sentence (pair) regression, e.g. STS-B similarity: one output, mean squared error."""

    task_type = "regression"

    def __init__(self, encoder: nn.Module, *, head: Literal["linear", "mlp"] = "linear",
                 head_hidden_size: int | None = None, head_dropout: float = 0.1) -> None:
        super().__init__(encoder, 1, head, head_hidden_size, head_dropout)

    def loss(self, outputs, labels):
        return nn.functional.mse_loss(outputs.squeeze(-1), labels.to(outputs.dtype))

    def predictions(self, outputs):
        return outputs.squeeze(-1)

    @classmethod
    def _from_config(cls, directory, config):
        encoder = load_encoder(directory / "encoder", config["encoder"])
        return cls(encoder, head=config["head"], head_hidden_size=config["head_hidden_size"],
                   head_dropout=config["head_dropout"])
