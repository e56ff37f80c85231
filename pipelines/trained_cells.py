"""A study's trained cells: one folder per cell, below the train stage's output (``data/04_models/<study>``, which
DVC tracks whole and keeps between builds: ``persist``).

A cell is built when its folder records the build key it was trained for (`BUILD_FILE`): a digest of its spec, the
files of its base models, its prepared data and the library code that trains a cell. The train stage trains every
planned cell whose folder does not record its key, and no other, so an unchanged cell is never trained twice,
however the last build ended and on whichever machine it ran (DVC's remote carries the folders, keys included).
Each folder is written whole, key included, in one atomic step (`layertune.io.atomic_directory`): a stopped build
leaves finished cells built and no half-written one.

A folder whose cell is no longer planned (a seed or setting removed from params.yaml) is put aside, not deleted:
moved to ``retired`` (outside every DVC output), and moved back, untrained, when its cell is planned again with the
same key. So the stage's output holds exactly the planned cells, as a build from scratch would.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import shutil
import tarfile
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from layertune.cell import CellFolder, TrainedCell
from layertune.io import atomic_directory, remove_stale_partials

BUILD_FILE = "build.json"  # in a cell's folder: the key it was built for, and what the key is made of


def build_record(cell, code: str, data: str) -> dict:
    """What a cell (a `layertune.study.StudyCell`) is built from, and its key: a digest of the rest. ``code``: the
    library's fingerprint (`TrainPlan.code`); ``data``: the digest of the cell's prepared corpus."""
    made_of = {"spec": hashlib.sha256(cell.spec.model_dump_json().encode()).hexdigest()[:32],
               "models": list(cell.model_fingerprints), "code": code, "data": data}
    key = hashlib.sha256(json.dumps(made_of, sort_keys=True).encode()).hexdigest()[:32]
    return {"key": key, **made_of}


@dataclass(frozen=True)
class TrainedCells(Mapping):
    """The cell folders of one study: ``{key: CellFolder}`` over the complete ones (a folder being written is
    dot-named, and not one), and how a cell is found built, written, put aside and taken back."""

    path: Path
    retired: Path

    # -- reading: a Mapping of the complete folders, as evaluate and aggregate read them

    def __getitem__(self, key: str) -> CellFolder:
        folder = self.path / key
        if key.startswith(".") or not (folder / "cell.json").is_file():
            raise KeyError(key)
        return CellFolder(folder)

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(spec.parent.name for spec in self.path.glob("*/cell.json")
                           if not spec.parent.name.startswith(".")))

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def is_built(self, key: str, build_key: str) -> bool:
        return recorded_build_key(self.path / key) == build_key

    # -- writing

    def write(self, key: str, trained: TrainedCell, build: dict) -> Path:
        """Cell ``key``'s folder, with its build record, replacing an earlier one in one atomic step (by the main
        process only, in a cell trained by several: `layertune.distributed`)."""
        from layertune.distributed import is_main_process

        if is_main_process():
            trained.save(self.path / key, extra={BUILD_FILE: build})
        return self.path / key

    def receive(self, key: str, archive: bytes) -> Path:
        """Cell ``key``'s folder from a `pack`ed archive (a cell trained on another machine), in one atomic step."""
        with atomic_directory(self.path / key) as staging, tarfile.open(fileobj=io.BytesIO(archive)) as tar:
            _extract_cell(tar, staging)
        return self.path / key

    def set_aside(self, planned: Collection[str]) -> list[str]:
        """Folders of cells whose keys are not in ``planned`` moved to `retired`; returns their keys. Writes left
        by stopped builds (dot-named, of dead processes) are removed first."""
        self.path.mkdir(parents=True, exist_ok=True)
        remove_stale_partials(self.path)
        gone = [key for key in self if key not in planned]
        for key in gone:
            self._move(self.path / key, self.retired / key)
        return gone

    def take_back(self, key: str, build_key: str) -> bool:
        """Cell ``key`` moved back from `retired` if it was built for ``build_key``; whether it was."""
        if recorded_build_key(self.retired / key) != build_key:
            return False
        self._move(self.retired / key, self.path / key)
        return True

    @staticmethod
    def _move(source: Path, target: Path) -> None:
        """``source`` renamed to ``target`` (same file system: nothing is copied); an older ``target`` goes first."""
        target.parent.mkdir(parents=True, exist_ok=True)
        if target.exists():
            shutil.rmtree(target)  # an older folder of the same cell, which this class put there
        os.replace(source, target)


def recorded_build_key(folder: Path) -> str | None:
    """The build key ``folder``'s `BUILD_FILE` records; None without one (a folder not written by a build)."""
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        return json.loads((folder / BUILD_FILE).read_text())["key"]
    return None


def _extract_cell(tar: tarfile.TarFile, target: Path) -> None:
    """A packed cell's files and folders under ``target``, and nothing else: no links, devices or paths out of it,
    owned by this process's user with plain modes."""
    members = tar.getmembers()
    for member in members:  # `pack` writes files and folders only: an archive with more is not a cell's
        if not (member.isfile() or member.isdir()):
            why = "not a file or folder"
        elif not (target / member.name).resolve().is_relative_to(target.resolve()):
            why = "a path out of the folder"
        else:
            member.mode = 0o755 if member.isdir() else 0o644
            member.uid, member.gid, member.uname, member.gname = os.getuid(), os.getgid(), "", ""
            continue
        raise ValueError(f"not a packed cell folder: archive member {member.name!r} ({why})")
    # Python's own "data" filter where it has one (3.10.12, 3.11.4 on); before, the checks above alone
    tar.extractall(target, members, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))


def pack(folder: Path) -> bytes:
    """A cell folder as an archive, for `TrainedCells.receive` on another machine."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for path in sorted(folder.rglob("*")):
            tar.add(path, arcname=str(path.relative_to(folder)), recursive=False)
    return buffer.getvalue()
