"""One cell trained → a folder of results, and read back.

`train_cell` is the one way to train a cell (`layertune.specs.CellSpec`, the recipe): the command line, the study
pipeline and your own code all go through it. `CellFolder` reads a saved cell's files.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from layertune.specs import CellSpec

if TYPE_CHECKING:
    from layertune.corpus import Corpus
    from layertune.heads import TaskModel
    from layertune.trainer import TrainingResult


@dataclass
class TrainedCell:
    """A trained cell: its spec, what training measured, and the model at its best epoch."""

    spec: CellSpec
    result: TrainingResult
    model: TaskModel

    def save(self, directory: str | Path, *, overwrite: bool = False,
             extra: Mapping[str, Any | Callable[[Path], Any]] | None = None) -> Path:
        """The cell's folder, written all at once (an interrupted save leaves the old folder, or nothing):
        ``cell.json`` (the spec) and the files of `TrainingResult.save`, model included, and ``extra``'s JSON files
        (``{file name: data}``: what the caller records with the cell, e.g. what it was built from; data that is a
        function is called with the folder being written once every other file is in it, so that it can record
        them, e.g. their digests: `layertune.io.file_digests`). An existing folder is replaced only if empty, a
        previous output, or with ``overwrite`` (`layertune.io.check_output_directory`)."""
        from layertune import timing
        from layertune.io import output_directory, write_json

        extra = extra or {}
        with timing.compute("saving"), output_directory(directory, overwrite=overwrite,
                                                        written_by="train_cell") as staging:
            (staging / "cell.json").write_text(self.spec.model_dump_json(indent=2) + "\n")
            self.result.save(staging, self.model)
            for name, data in sorted(extra.items(), key=lambda item: callable(item[1])):  # records of the rest last
                write_json(staging / name, data(staging) if callable(data) else data)
        return Path(directory)


def train_cell(spec: CellSpec, output_dir: str | Path | None = None, *, corpus: Corpus | None = None,
               cache_dir: str | Path | None = None, data_mirror: str | os.PathLike | None = None,
               progress: bool = True, overwrite: bool = False) -> TrainedCell:
    """Train one cell, and write its folder to ``output_dir`` if given (checked before training: a folder holding
    files layertune did not write is replaced only with ``overwrite``, see `layertune.io.check_output_directory`).

    ``corpus`` is the cell's data when already loaded (the pipeline's prepared splits); otherwise it is loaded from
    ``spec.corpus``. ``cache_dir`` holds the tokenized splits and frozen-prefix states (see `layertune.frozen_prefix`).
    """
    from layertune.distributed import is_main_process
    from layertune.io import check_output_directory
    from layertune.model_paths import require_safe_weights
    from layertune.trainer import ModelTrainer

    if output_dir is not None:
        check_output_directory(output_dir, overwrite=overwrite)
    for encoder in spec.encoders:  # before the data loads (LanguageModel checks again, for its own callers)
        require_safe_weights(encoder.model)
    corpus = corpus if corpus is not None else spec.corpus.load(data_mirror)
    model = spec.build_model(corpus)
    trainer = ModelTrainer(model, corpus, cache_dir=cache_dir)
    trained = TrainedCell(spec, trainer.train(args=spec.training, progress=progress), trainer.model)
    if output_dir is not None and is_main_process():  # one folder, whatever the number of processes
        trained.save(output_dir, overwrite=overwrite)
    return trained


@dataclass(frozen=True)
class CellFolder:
    """Read access to a saved cell folder: each file is read when asked for."""

    path: Path

    def spec(self) -> CellSpec:
        return CellSpec.model_validate_json((self.path / "cell.json").read_text())

    def metrics(self) -> dict:
        return json.loads((self.path / "metrics.json").read_text())

    def history(self) -> list[dict]:
        return json.loads((self.path / "history.json").read_text())

    def run_info(self) -> dict:
        """What ran: the frozen-prefix cache's decision, why, and the estimates behind it."""
        path = self.path / "run_info.json"
        return json.loads(path.read_text()) if path.is_file() else {}

    def predictions(self) -> dict[str, dict[str, list]]:
        return json.loads((self.path / "predictions.json").read_text())

    def drift(self):
        import pandas as pd

        return pd.read_csv(self.path / "drift.csv")

    def model(self, *, trust_remote_code: bool = False) -> TaskModel:
        from layertune.heads import TaskModel

        return TaskModel.from_pretrained(self.path / "model", trust_remote_code=trust_remote_code)

    def predict(self, corpus: Corpus, *, cache_dir: str | Path | None = None) -> dict[str, dict[str, list]]:
        """The saved model's predictions and the references on ``corpus``'s scored splits (dev, test), computed as
        its training scored dev: with its own training settings, from the frozen-prefix cache in ``cache_dir``
        where it has a frozen prefix (cells of one boundary share the entries)."""
        from layertune.trainer import ModelTrainer

        return ModelTrainer(self.model(), corpus, cache_dir=cache_dir).predict(args=self.spec().training)
