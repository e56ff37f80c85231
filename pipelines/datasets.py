"""Kedro datasets for what the stages exchange. Each write is atomic, and sorted where order is free, so equal data
gives equal bytes. Not kedro-datasets': they write in place (an interrupted stage leaves a half-written file that DVC
would cache), know no pydantic specs, and write other JSON and PNG bytes than the byte-for-byte check expects."""

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
    """A dataset at one ``path`` (public: hooks and checks read it), with Kedro's `_exists` and `_describe`."""

    def __init__(self, path: str) -> None:
        self._path = Path(path)

    @property
    def path(self) -> Path:
        return self._path

    def _exists(self) -> bool:
        return self._path.exists()

    def _describe(self) -> dict[str, Any]:
        return dict(self._init_args)  # the constructor's arguments, as Kedro keeps them


class SplitFilesDataset(Located, AbstractDataset[dict, dict]):
    """Downloaded data as it came, ``{name: {split: datasets.Dataset}}`` saved as ``<path>/<name>/<split>.parquet``;
    loads as ``{name: {split: path}}``, the ``files=`` of `layertune.specs.CorpusSpec.load`."""

    def load(self) -> dict:
        if not self._path.is_dir():
            raise DatasetError(f"No downloaded data in {self._path}: run the stage that writes it first.")
        return {folder.name: {f.stem: str(f) for f in sorted(folder.glob("*.parquet"))}
                for folder in sorted(self._path.iterdir()) if folder.is_dir() and not folder.name.startswith(".")}

    def save(self, data: dict) -> None:
        self._path.mkdir(parents=True, exist_ok=True)
        for name, splits in data.items():
            with atomic_directory(self._path / name, needed=lambda: _arrow_bytes(splits.values())) as staging:
                for split, dataset in splits.items():
                    # One row group and no index: the same rows always give the same bytes.
                    dataset.to_parquet(staging / f"{split}.parquet", batch_size=len(dataset) or 1)


@dataclass(frozen=True)
class SavedCorpus:
    """A corpus saved at ``path``; calling it reads the corpus back. Picklable and hashable: what a worker process is
    sent, and a key for loading it once."""

    path: Path

    def __call__(self):
        from layertune.corpus import Corpus

        return Corpus.load_from_disk(self.path)


class CorporaDataset(Located, AbstractDataset[dict, dict]):
    """``{task: Corpus}``, each saved as ``<path>/<task>/``; loads as ``{task: SavedCorpus}``, so that a node reads
    only the tasks it needs."""

    def load(self) -> dict:
        if not self._path.is_dir():
            raise DatasetError(f"No corpora in {self._path}: run the stage that writes it first.")
        return {folder.name: SavedCorpus(folder)
                for folder in sorted(self._path.iterdir()) if folder.is_dir() and not folder.name.startswith(".")}

    def save(self, data: dict) -> None:
        self._path.mkdir(parents=True, exist_ok=True)
        for task, corpus in data.items():
            with atomic_directory(self._path / task, needed=lambda: _arrow_bytes(corpus.splits().values())) as staging:
                corpus.save_to_disk(staging)


def _arrow_bytes(splits) -> int:
    """The bytes of datasets' tables in memory: about what their files take (what a full disk's message names)."""
    return sum(split.data.nbytes for split in splits)


class FolderDataset(Located, AbstractDataset[None, Path]):
    """A folder whose layout belongs to `layertune` (the feature cache): loads as its path; saving is refused."""

    def load(self) -> Path:
        return self._path

    def save(self, data: None) -> None:
        raise DatasetError(f"{self._path} is filled by layertune itself; nothing is saved through the catalog.")


class TrainedCellsDataset(Located, AbstractDataset[None, Any]):
    """A study's cell folders below ``path``, and ``retired`` those of cells no longer planned: loads as
    `pipelines.trained_cells.TrainedCells`, which writes each cell as it ends (a build cannot wait for the node's
    return); saving is refused."""

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
            raise DatasetError(f"No plan at {path}: check the study given to --params (after editing params.yaml, "
                               "run the plan stage first: dvc repro plan).")
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
    payload = _payload(path, data, spec)  # in memory first: a full disk's message names the bytes it needs
    with atomic_file(path, needed=len(payload)) as staging:
        staging.write_bytes(payload)


def _payload(path: Path, data: Any, spec: str | None) -> bytes:
    """The bytes of ``path``'s file for ``data``, by its suffix (see `FileDataset`)."""
    if spec is not None:
        return (data.model_dump_json(indent=2) + "\n").encode()
    if path.suffix == ".csv":
        return data.to_csv(index=False, lineterminator="\n").encode()
    if path.suffix == ".png":
        import io

        import matplotlib.pyplot as plt

        # No timestamp or software version in the file: a figure of the same data is the same bytes.
        buffer = io.BytesIO()
        try:
            data.savefig(buffer, format="png", dpi=110, bbox_inches="tight", metadata={"Software": None})
        finally:
            plt.close(data)
        return buffer.getvalue()
    return data.encode()


def _files(root: Path, suffix: str) -> Iterator[tuple[str, Path]]:
    """``(key, file)`` for every file below ``root`` named ``<key><suffix>``, in order, less an unfinished write's
    (dot-named)."""
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
    """Files below ``path`` keyed by their relative path less ``suffix``, each as a `FileDataset`: saving
    ``{"a/b": df}`` with ``suffix=".csv"`` writes ``<path>/a/b.csv``, and no other file."""

    def __init__(self, path: str, suffix: str, spec: str | None = None) -> None:
        self._path, self._suffix, self._spec = Path(path), suffix, spec

    def load(self) -> dict:
        return {key: _read(file, self._spec) for key, file in _files(self._path, self._suffix)}

    def save(self, data: dict) -> None:
        for key, value in data.items():
            _write(self._path / f"{key}{self._suffix}", value, self._spec)
