"""A corpus: train / dev (/ test) splits of one task, plus what the task is and how it is scored."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    import datasets

TaskType = Literal["classification", "regression", "token_classification"]


@dataclass
class Corpus:
    """Splits are `datasets.Dataset`s with the text column(s) and a ``label`` column.

    Classification labels are ints in ``range(num_classes)``, regression labels floats; token classification
    corpora have a ``tokens`` column (list of words) and ``tags`` (list of ints into ``label_names``).
    """

    name: str
    train: datasets.Dataset
    dev: datasets.Dataset
    text_columns: tuple[str, ...]
    task_type: TaskType
    metrics: tuple[str, ...]
    main_metric: str
    label_names: tuple[str, ...] = ()
    test: datasets.Dataset | None = None
    notes: list[str] = field(default_factory=list)
    # Default truncation length for tokenization; None lets the tokenizer decide (see layertune.tokenization).
    max_length: int | None = None

    @property
    def num_classes(self) -> int:
        """Output size of the head: the number of labels, or 1 for regression."""
        return 1 if self.task_type == "regression" else len(self.label_names)

    @property
    def fingerprint(self) -> str:
        """Hash of the name and every split's ``datasets`` fingerprint: equal for identical loads."""
        parts = [self.name] + [f"{k}={v._fingerprint}" for k, v in self.splits().items()]
        return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]

    def splits(self) -> dict[str, datasets.Dataset]:
        named = {"train": self.train, "dev": self.dev, "test": self.test}
        return {k: v for k, v in named.items() if v is not None}

    def __str__(self) -> str:
        sizes = ", ".join(f"{k} {len(v):,}" for k, v in self.splits().items())
        labels = f"labels {list(self.label_names)}" if self.label_names else "regression target"
        lines = [
            f"Corpus {self.name!r} ({self.task_type}): {sizes}",
            f"  text: {', '.join(self.text_columns)}; {labels}",
            f"  metrics: {', '.join(self.metrics)} (model selection by {self.main_metric})",
        ]
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)
