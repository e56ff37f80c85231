"""Kedro datasets for what the stages exchange: corpora, the feature cache, task models, JSON/CSV/text files, and
folders of many such files. Each writes atomically or sorted, so equal data gives equal bytes."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import pandas as pd
from kedro.io import AbstractDataset, DatasetError

from layertune.io import atomic_directory, write_json


class CorporaDataset(AbstractDataset[dict, dict]):
    """``{task: Corpus}`` saved as ``<path>/<task>/<split>.parquet``.

    Loading gives ``{task: loader}``: ``loader(**options)`` calls `layertune.corpora.load_corpus` on the files, so a
    node can subsample (``loader(train_size=500, seed=1)``) or take the corpus as it is (``loader()``).
    """

    def __init__(self, path: str) -> None:
        self._path = Path(path)

    def load(self) -> dict:
        from layertune.corpora import load_corpus

        if not self._path.is_dir():
            raise DatasetError(f"No corpora in {self._path}: run the stage that writes it first.")
        return {
            folder.name: functools.partial(load_corpus, folder.name,
                                           data_files={f.stem: str(f) for f in sorted(folder.glob("*.parquet"))})
            for folder in sorted(self._path.iterdir()) if folder.is_dir() and not folder.name.startswith(".")
        }

    def save(self, data: dict) -> None:
        self._path.mkdir(parents=True, exist_ok=True)
        for task, corpus in data.items():
            with atomic_directory(self._path / task) as staging:
                for split, dataset in corpus.splits().items():
                    # One row group and no index: the same rows always give the same bytes.
                    dataset.to_parquet(staging / f"{split}.parquet", batch_size=len(dataset) or 1)

    def _exists(self) -> bool:
        return self._path.is_dir()

    def _describe(self) -> dict[str, Any]:
        return {"path": str(self._path)}


class FeatureCacheDataset(AbstractDataset[None, Path]):
    """A folder that `layertune` fills as a cache (tokenized splits, frozen-prefix states): loading gives its path.

    Its layout belongs to the library; nodes pass the path on and never save through this dataset.
    """

    def __init__(self, path: str) -> None:
        self._path = Path(path)

    def load(self) -> Path:
        return self._path

    def save(self, data: None) -> None:
        raise DatasetError(f"{self._path} is filled by layertune's caches; nothing is saved through the catalog.")

    def _exists(self) -> bool:
        return self._path.is_dir()

    def _describe(self) -> dict[str, Any]:
        return {"path": str(self._path)}


class TaskModelsDataset(AbstractDataset[None, dict]):
    """Every saved `TaskModel` below ``path`` (a folder holding ``<name>/config.json``), keyed by the folder that
    holds it, relative to ``path``: ``{"layers-2/seed-1": loader}``; ``loader()`` reads the model."""

    def __init__(self, path: str, name: str = "model") -> None:
        self._path = Path(path)
        self._name = name

    def load(self) -> dict:
        from layertune.heads import TaskModel

        return {str(config.parent.parent.relative_to(self._path)): functools.partial(TaskModel.from_pretrained,
                                                                                      config.parent)
                for config in sorted(self._path.rglob(f"{self._name}/config.json"))
                if not any(part.startswith(".") for part in config.relative_to(self._path).parts)}

    def save(self, data: None) -> None:
        raise DatasetError(f"Models are saved one by one (TaskModelDataset), not through {self._path}.")

    def _exists(self) -> bool:
        return self._path.is_dir()

    def _describe(self) -> dict[str, Any]:
        return {"path": str(self._path), "name": self._name}


class TaskModelDataset(AbstractDataset[Any, Any]):
    """A `layertune.heads.TaskModel` folder (safetensors + JSON), written all at once."""

    def __init__(self, path: str) -> None:
        self._path = Path(path)

    def load(self) -> Any:
        from layertune.heads import TaskModel

        return TaskModel.from_pretrained(self._path)

    def save(self, data: Any) -> None:
        data.save(self._path)

    def _exists(self) -> bool:
        return (self._path / "config.json").is_file()

    def _describe(self) -> dict[str, Any]:
        return {"path": str(self._path)}


def _read(path: Path) -> Any:
    if path.suffix == ".json":
        return json.loads(path.read_text())
    if path.suffix == ".csv":
        return pd.read_csv(path)
    return path.read_text()


def _write(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".json":
        write_json(path, data)
    elif path.suffix == ".csv":
        data.to_csv(path, index=False, lineterminator="\n")
    elif path.suffix == ".png":
        import matplotlib.pyplot as plt

        # No timestamp or software version in the file: a figure of the same data is the same bytes.
        data.savefig(path, dpi=110, bbox_inches="tight", metadata={"Software": None})
        plt.close(data)
    else:
        path.write_text(data)


class FileDataset(AbstractDataset[Any, Any]):
    """One file whose format follows its suffix: ``.json`` (dict/list, sorted keys), ``.csv`` (DataFrame, no
    index), ``.png`` (matplotlib figure), anything else text."""

    def __init__(self, filepath: str) -> None:
        self._path = Path(filepath)

    def load(self) -> Any:
        return _read(self._path)

    def save(self, data: Any) -> None:
        _write(self._path, data)

    def _exists(self) -> bool:
        return self._path.is_file()

    def _describe(self) -> dict[str, Any]:
        return {"filepath": str(self._path)}


class FileTreeDataset(AbstractDataset[dict, dict]):
    """Many files called ``name`` below ``path``, keyed by their folder relative to ``path``.

    ``FileTreeDataset("data/04_models", "metrics.json").load()`` gives ``{"sst2/m/layers-2/seed-1": {...}, ...}``;
    saving ``{"quality/sst2": df}`` with ``name=".csv"`` writes ``<path>/quality/sst2.csv`` (a leading dot makes
    ``name`` a suffix). Saving writes (or overwrites) just those files: several trees may share a folder.
    """

    def __init__(self, path: str, name: str) -> None:
        self._path = Path(path)
        self._filename = name

    def _file(self, key: str) -> Path:
        if self._filename.startswith("."):
            return self._path / f"{key}{self._filename}"
        return self._path / key / self._filename

    def load(self) -> dict:
        pattern = f"*{self._filename}" if self._filename.startswith(".") else self._filename
        found = {}
        for file in sorted(self._path.rglob(pattern)):
            relative = file.relative_to(self._path)
            if any(part.startswith(".") for part in relative.parts):  # staging folders of unfinished writes
                continue
            key = str(relative)[: -len(self._filename)] if self._filename.startswith(".") else str(relative.parent)
            found[key] = _read(file)
        return found

    def save(self, data: dict) -> None:
        for key, value in data.items():
            _write(self._file(key), value)

    def _exists(self) -> bool:
        return self._path.is_dir()

    def _describe(self) -> dict[str, Any]:
        return {"path": str(self._path), "name": self._filename}
