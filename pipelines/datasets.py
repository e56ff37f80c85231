"""Kedro datasets for what the stages exchange: corpora, the feature cache, trained cells, and files (one, or a tree
of them): JSON, typed plans (pydantic models as JSON), CSV, text, PNG. Each write is atomic (`layertune.io.atomic_file`,
`atomic_directory`), and sorted where order is free, so equal data gives equal bytes.

Why not kedro-datasets' JSON, CSV, Matplotlib and Partitioned datasets: they write through fsspec in place (an
interrupted stage leaves a half-written file that DVC would then cache), they know nothing of pydantic specs, and
their JSON/PNG bytes differ from ours, which the byte-for-byte reproduction check relies on.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
from kedro.io import AbstractDataset, DatasetError
from kedro.utils import load_obj

from layertune.io import atomic_directory, atomic_file, write_json


class Located:
    """A dataset at one path, ``path`` (public: what hooks and checks read); Kedro's `_exists` and `_describe`
    (for its listing) follow."""

    _path: Path

    @property
    def path(self) -> Path:
        return self._path

    def _exists(self) -> bool:
        return self._path.exists()

    def _describe(self) -> dict[str, Any]:
        return dict(self._init_args)  # the constructor's arguments, as Kedro keeps them


class SplitFilesDataset(Located, AbstractDataset[dict, dict]):
    """Downloaded data as it came, ``{name: {split: datasets.Dataset}}`` saved as ``<path>/<name>/<split>.parquet``.

    Loading gives ``{name: {split: path}}``: the files that `layertune.specs.CorpusSpec.load` reads in place of
    the mirror or the hub (``files=``).
    """

    def __init__(self, path: str) -> None:
        self._path = Path(path)

    def load(self) -> dict:
        if not self._path.is_dir():
            raise DatasetError(f"No downloaded data in {self._path}: run the stage that writes it first.")
        return {folder.name: {f.stem: str(f) for f in sorted(folder.glob("*.parquet"))}
                for folder in sorted(self._path.iterdir()) if folder.is_dir() and not folder.name.startswith(".")}

    def save(self, data: dict) -> None:
        self._path.mkdir(parents=True, exist_ok=True)
        for name, splits in data.items():
            with atomic_directory(self._path / name) as staging:
                for split, dataset in splits.items():
                    # One row group and no index: the same rows always give the same bytes.
                    dataset.to_parquet(staging / f"{split}.parquet", batch_size=len(dataset) or 1)


@dataclass(frozen=True)
class SavedCorpus:
    """A corpus saved by `Corpus.save_to_disk` at ``path``; calling it reads the corpus back
    (`Corpus.load_from_disk`). Picklable and hashable: what a worker process is sent, and a key for loading it once."""

    path: Path

    def __call__(self):
        from layertune.corpus import Corpus

        return Corpus.load_from_disk(self.path)


class CorporaDataset(Located, AbstractDataset[dict, dict]):
    """``{task: Corpus}``, each saved by `Corpus.save_to_disk` as ``<path>/<task>/`` (split files and corpus.json).

    Loading gives ``{task: SavedCorpus}``: a node reads only the tasks it needs, by calling it.
    """

    def __init__(self, path: str) -> None:
        self._path = Path(path)

    def load(self) -> dict:
        if not self._path.is_dir():
            raise DatasetError(f"No corpora in {self._path}: run the stage that writes it first.")
        return {folder.name: SavedCorpus(folder)
                for folder in sorted(self._path.iterdir()) if folder.is_dir() and not folder.name.startswith(".")}

    def save(self, data: dict) -> None:
        self._path.mkdir(parents=True, exist_ok=True)
        for task, corpus in data.items():
            with atomic_directory(self._path / task) as staging:
                corpus.save_to_disk(staging)


class FolderDataset(Located, AbstractDataset[None, Path]):
    """A folder that `layertune` fills itself (the content-addressed feature cache): loading gives its path.

    Its layout belongs to the library; nodes pass the path on and never save through this dataset.
    """

    def __init__(self, path: str) -> None:
        self._path = Path(path)

    def load(self) -> Path:
        return self._path

    def save(self, data: None) -> None:
        raise DatasetError(f"{self._path} is filled by layertune itself; nothing is saved through the catalog.")


class TrainedCellsDataset(Located, AbstractDataset[None, Any]):
    """A study's cell folders below ``path`` (the train stage's output), and ``retired``, where the folders of cells
    no longer planned are kept aside: loads as `pipelines.trained_cells.TrainedCells`, through which the train
    stage writes each cell as it ends (an incremental build cannot wait for a node's return) and later stages read
    them."""

    def __init__(self, path: str, retired: str) -> None:
        self._path, self._retired = Path(path), Path(retired)

    def load(self) -> Any:
        from pipelines.trained_cells import TrainedCells

        return TrainedCells(self._path, self._retired)

    def save(self, data: None) -> None:
        raise DatasetError(f"Cells are written one by one as they end (TrainedCells.write), not through {self._path}.")


def _read(path: Path, spec: str | None = None) -> Any:
    if spec is not None:  # a plan: the plan stage writes it (a study's plan for every later stage of the study)
        if not path.is_file():
            raise DatasetError(f"No plan at {path}: after editing params.yaml, run the plan stage first (dvc repro "
                               "plan).")
        return load_obj(spec).model_validate_json(path.read_text())
    if path.suffix == ".json":
        return json.loads(path.read_text())
    if path.suffix == ".csv":
        return pd.read_csv(path)
    return path.read_text()


def _write(path: Path, data: Any, spec: str | None = None) -> None:
    if path.suffix == ".json" and spec is None:
        write_json(path, data)  # atomic itself, and refuses NaN before writing anything
        return
    with atomic_file(path) as staging:
        if spec is not None:
            staging.write_text(data.model_dump_json(indent=2) + "\n")
        elif path.suffix == ".csv":
            data.to_csv(staging, index=False, lineterminator="\n")
        elif path.suffix == ".png":
            import matplotlib.pyplot as plt

            # No timestamp or software version in the file: a figure of the same data is the same bytes.
            try:
                data.savefig(staging, dpi=110, bbox_inches="tight", metadata={"Software": None})
            finally:
                plt.close(data)
        else:
            staging.write_text(data)


def _files(root: Path, suffix: str) -> Iterator[tuple[str, Path]]:
    """``(key, file)`` for every file below ``root`` named ``<key><suffix>``, in order; what an unfinished write
    stages (dot-named) is not one."""
    for file in sorted(root.rglob(f"*{suffix}")):
        relative = file.relative_to(root)
        if not any(part.startswith(".") for part in relative.parts):
            yield str(relative)[: -len(suffix)], file


class FileDataset(Located, AbstractDataset[Any, Any]):
    """One file whose format follows its suffix: ``.json`` (dict/list, sorted keys; with ``spec``, a dotted class
    name, that pydantic model: the typed plans), ``.csv`` (DataFrame, no index), ``.png`` (matplotlib figure),
    anything else text."""

    def __init__(self, filepath: str, spec: str | None = None) -> None:
        self._path, self._spec = Path(filepath), spec

    def load(self) -> Any:
        return _read(self._path, self._spec)

    def save(self, data: Any) -> None:
        _write(self._path, data, self._spec)


class FileTreeDataset(Located, AbstractDataset[dict, dict]):
    """Many files below ``path`` keyed by their path relative to it, less ``suffix`` (each as a `FileDataset`):
    saving ``{"a/b": df}`` with ``suffix=".csv"`` writes ``<path>/a/b.csv``, and just those files."""

    def __init__(self, path: str, suffix: str, spec: str | None = None) -> None:
        self._path, self._suffix, self._spec = Path(path), suffix, spec

    def load(self) -> dict:
        return {key: _read(file, self._spec) for key, file in _files(self._path, self._suffix)}

    def save(self, data: dict) -> None:
        for key, value in data.items():
            _write(self._path / f"{key}{self._suffix}", value, self._spec)
