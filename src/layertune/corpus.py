"""A corpus: train / dev (/ test) splits of one task, plus what the task is and how it is scored."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    import datasets

TaskType = Literal["classification", "regression", "token_classification"]
CORPUS_FILE = "corpus.json"  # beside a saved corpus's split files: what the task is


@dataclass
class Corpus:
    """Splits are `datasets.Dataset`s with the text column(s) and a ``label`` column.

    Classification labels are ints in ``range(num_classes)``, regression labels floats; token classification
    corpora have a ``tokens`` column (list of words) and ``tags`` (list of ints into ``label_names``).

    ``validation``, where present, is a slice carved from the training data (``validation_size``): what training
    picks its best epoch on and stops early by, so that ``dev`` is scored once, after training, by weights it
    never chose.
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
    validation: datasets.Dataset | None = None
    notes: list[str] = field(default_factory=list)
    # Default truncation length for tokenization; None lets the tokenizer decide (see layertune.tokenization).
    max_length: int | None = None

    @property
    def num_classes(self) -> int:
        """Output size of the head: the number of labels, or 1 for regression."""
        return 1 if self.task_type == "regression" else len(self.label_names)

    @property
    def fingerprint(self) -> str:
        """Hash of the name and every split's content (`layertune.io.dataset_digest`): equal for equal data."""
        from layertune.io import dataset_digest

        parts = [self.name] + [f"{k}={dataset_digest(v)}" for k, v in self.splits().items()]
        return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]

    def splits(self) -> dict[str, datasets.Dataset]:
        named = {"train": self.train, "validation": self.validation, "dev": self.dev, "test": self.test}
        return {k: v for k, v in named.items() if v is not None}

    def save_to_disk(self, directory: str | Path) -> None:
        """Each split as ``<split>.parquet`` (one row group, no index: the same rows always give the same bytes) and
        what the task is as ``corpus.json``, so `load_from_disk` gives this corpus back without inferring anything."""
        import json

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        for split, dataset in self.splits().items():
            dataset.to_parquet(directory / f"{split}.parquet", batch_size=len(dataset) or 1)
        about = {"name": self.name, "task_type": self.task_type, "text_columns": list(self.text_columns),
                 "label_names": list(self.label_names), "metrics": list(self.metrics),
                 "main_metric": self.main_metric, "max_length": self.max_length, "notes": self.notes}
        (directory / CORPUS_FILE).write_text(json.dumps(about, indent=2, ensure_ascii=False) + "\n")

    @classmethod
    def load_from_disk(cls, directory: str | Path) -> Corpus:
        """The corpus `save_to_disk` wrote (splits read into memory; their features from the files' metadata)."""
        import json

        import datasets
        import pyarrow.parquet as pq
        from datasets.table import InMemoryTable

        directory = Path(directory)
        about = json.loads((directory / CORPUS_FILE).read_text())
        splits = {split: datasets.Dataset(InMemoryTable(pq.read_table(directory / f"{split}.parquet")))
                  for split in ("train", "validation", "dev", "test") if (directory / f"{split}.parquet").is_file()}
        return cls(name=about["name"], train=splits["train"], dev=splits["dev"], test=splits.get("test"),
                   validation=splits.get("validation"),
                   text_columns=tuple(about["text_columns"]), task_type=about["task_type"],
                   metrics=tuple(about["metrics"]), main_metric=about["main_metric"],
                   label_names=tuple(about["label_names"]), notes=about["notes"], max_length=about["max_length"])

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
