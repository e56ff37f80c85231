"""A study's trained cells: one folder per cell, written whole in one atomic step, its build record (`BUILD_FILE`)
last. A cell is built when its folder proves its planned build key (`proof_problem`); a folder no longer planned, or
at a planned cell's place without proving it, is set aside, never deleted. docs/pipeline.md, "Which cells train".
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import json
import logging
import os
import shutil
import tarfile
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from layertune.cell import CellFolder, TrainedCell
from layertune.io import (DiskFull, atomic_directory, disk_full, file_digest, file_digests, free_bytes, in_bytes,
                          remove_stale_partials, write_json)

logger = logging.getLogger(__name__)

BUILD_FILE = "build.json"  # in a cell's folder, written last: the key it was built for, what the key is made of,
# and the digest of every other file of the folder
UNVERIFIED = ".unverified"  # below `TrainedCells.retired`: folders set aside because they did not prove their cell


def build_record(cell, code: str, data: str) -> dict:
    """What a cell (a `layertune.study.StudyCell`) is built from, and its key: a digest of the rest; and the cell it
    is (``cell``, outside the digest: a folder found at another cell's place is known for what it is, whatever its
    build). ``code``: the library's fingerprint (`TrainPlan.code`); ``data``: the digest of the cell's prepared
    corpus."""
    made_of = {"spec": spec_digest(cell.spec), "models": list(cell.model_fingerprints), "code": code, "data": data}
    key = hashlib.sha256(json.dumps(made_of, sort_keys=True).encode()).hexdigest()[:32]
    return {"key": key, "cell": cell.key, **made_of}


def spec_digest(spec) -> str:
    """The digest of a cell's spec (a `layertune.specs.CellSpec`), as build records and MLflow tags name it."""
    return hashlib.sha256(spec.model_dump_json().encode()).hexdigest()[:32]


def read_record(folder: Path) -> dict | None:
    """``folder``'s build record; None without a readable one (a folder not written by a build, or damaged)."""
    with contextlib.suppress(OSError, ValueError):
        record = json.loads((folder / BUILD_FILE).read_text())
        if isinstance(record, dict) and isinstance(record.get("key"), str):
            return record
    return None


def recorded_build_key(folder: Path) -> str | None:
    """The build key ``folder``'s `BUILD_FILE` records; None without one (a folder not written by a build)."""
    record = read_record(folder)
    return record["key"] if record else None


def proof_problem(folder: Path, build_key: str | None = None) -> str | None:
    """What keeps ``folder`` from proving that it holds the cell its build record (with ``build_key``: for that key)
    describes; None if it proves it. Costs a read of every file (the page cache keeps a recent folder in memory)."""
    from layertune.specs import CellSpec

    if folder.is_symlink():
        return "it is a link, not a folder (a cell folder is never followed out of the study's folder)"
    record = read_record(folder)
    if record is None:
        return f"it has no readable {BUILD_FILE} (no build wrote it, or it was cut short)"
    if build_key is not None and record["key"] != build_key:
        return f"it was built for another key ({record['key'][:12]}…, planned: {build_key[:12]}…)"
    files = record.get("files")
    if not isinstance(files, dict) or "cell.json" not in files:
        return f"its {BUILD_FILE} lists no files (written before layertune recorded them)"
    for name, digest in files.items():
        path = folder / name
        if (why := _not_inside(folder, name)) is not None:
            return why
        if path.is_symlink() or not path.is_file():
            return f"{name} is missing"
        if file_digest(path) != digest:
            return f"{name} is not the file its build wrote (its digest differs)"
    try:
        spec = CellSpec.model_validate_json((folder / "cell.json").read_text())
    except ValueError:
        return "cell.json is not a cell's spec"
    if spec_digest(spec) != record.get("spec"):
        return "cell.json is another cell's spec than its build record names"
    return None


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
        """Whether cell ``key``'s folder proves it is built for ``build_key`` (`proof_problem`)."""
        return proof_problem(self.path / key, build_key) is None

    def settle(self, key: str, build_key: str, planned: Mapping[str, str] | None = None) -> bool:
        """Whether cell ``key`` is built for ``build_key``, once its place is settled: a folder there that proves it
        stays (files its build did not write moved aside), else a retired one that proves it is taken back. A folder
        looked at (there, then retired) that does not prove it is set aside, whatever the reason, but for one: an
        intact older build of this very cell stays where it is (in place, for the new build to replace). ``planned``:
        ``{cell key: build key}`` of the study's plan, which names the cell an older record (one that does not name
        its cell) was built for, where it is another planned cell's build."""
        place = self.path / key
        for folder in (place, self.retired / key):
            if not (folder.exists() or folder.is_symlink()):
                continue
            if proof_problem(folder, build_key) is None:
                if folder != place:
                    self._move(folder, place)
                self._unrecorded_aside(place, key)
                return True
            if (why := _not_an_older_build(folder, key, planned or {})) is not None:
                self._set_aside(folder, key, why)
        return False

    def built_elsewhere(self) -> dict[str, list[Path]]:
        """The cells the project's other studies have built, ``{build key: [folder, ...]}``: the study folders beside
        this one (the catalog keeps every study's below one folder), as their build records name them. Read from
        the records alone; `copy_built` proves a folder before it takes it."""
        found: dict[str, list[Path]] = {}
        studies = sorted(folder for folder in self.path.parent.iterdir()
                         if folder != self.path and not folder.name.startswith(".") and not folder.is_symlink()
                         and folder.is_dir()) if self.path.parent.is_dir() else []
        for study in studies:
            for folder in sorted(study.iterdir()):
                if not folder.name.startswith(".") and not folder.is_symlink() and (record := read_record(folder)):
                    found.setdefault(record["key"], []).append(folder)
        return found

    # -- writing

    def copy_built(self, key: str, build: dict, source: Path) -> bool:
        """Cell ``key`` built by copying ``source``, another study's folder of the same build (``build``, this
        cell's record: the same spec, models, code and data, so the cell that training it here gives, on the
        machine that trained it); whether it did. The copy takes the recorded files only, and its place in one
        atomic step once it proves the build; a source that does not prove it, or that cannot be read whole, is
        left as it is, and the cell trains."""
        record = read_record(source) or {}
        try:
            if any(record.get(part) != build[part] for part in ("spec", "models", "code", "data")):
                raise _NotCopied("its build record names another build")
            if (problem := proof_problem(source, build["key"])) is not None:
                raise _NotCopied(problem)
            with _disk_full_said(self.path / key, lambda: _folder_bytes(source)), \
                    atomic_directory(self.path / key) as staging:
                for name in record["files"]:  # a folder's other files are not the build's (`_unrecorded`)
                    if not (source / name).resolve().is_relative_to(source.resolve()):  # a link swapped in since
                        raise _NotCopied(f"{name} now leads out of the folder")
                    (staging / name).parent.mkdir(parents=True, exist_ok=True)
                    shutil.copyfile(source / name, staging / name, follow_symlinks=False)
                write_json(staging / BUILD_FILE, {**record, "cell": key,
                                                  "copied_from": f"{source.parent.name}/{source.name}"})
                if (problem := proof_problem(staging, build["key"])) is not None:  # changed while it was copied
                    raise _NotCopied(problem)
        except CellDiskFull:
            raise  # as for a trained cell: free space, and build again
        except (_NotCopied, OSError) as error:  # OSError: the source moved or became unreadable meanwhile
            logger.warning("cell %s is trained, not copied from %s: %s", key, source, error)
            return False
        return True

    def write(self, key: str, trained: TrainedCell, build: dict) -> Path:
        """Cell ``key``'s folder, its build record (``build`` and every other file's digest) written last, replacing
        an earlier one in one atomic step; by the main process only (`layertune.distributed`)."""
        from layertune.distributed import is_main_process

        if is_main_process():
            with _disk_full_said(self.path / key, lambda: _state_bytes(trained.model)):
                trained.save(self.path / key,
                             extra={BUILD_FILE: lambda folder: {**build, "files": file_digests(folder)}})
        return self.path / key

    def receive(self, key: str, archive: bytes, build_key: str) -> Path:
        """Cell ``key``'s folder from a `pack`ed archive, in one atomic step, once it proves it is built for
        ``build_key``; else a `ValueError` saying what did not match, and nothing is written."""
        with _disk_full_said(self.path / key, lambda: len(archive)), atomic_directory(self.path / key) as staging, \
                tarfile.open(fileobj=io.BytesIO(archive)) as tar:
            _extract_cell(tar, staging)
            if problem := proof_problem(staging, build_key):
                raise ValueError(f"the folder of cell {key} that came back does not prove its build: {problem}")
        return self.path / key

    def set_aside(self, planned: Collection[str]) -> list[str]:
        """Folders of cells whose keys are not in ``planned`` moved to `retired`; returns their keys. Writes left
        by stopped builds (dot-named, of dead processes) are removed first."""
        self.path.mkdir(parents=True, exist_ok=True)
        remove_stale_partials(self.path)
        gone = [key for key in self if key not in planned]
        for key in gone:
            self._retire(key)
        return gone

    def _set_aside(self, folder: Path, key: str, problem: str) -> Path:
        """``folder`` (of cell ``key``) moved to ``retired/.unverified/<key>-<n>``, never over another, with one
        warning naming it and ``problem``; where it went."""
        target = self._aside(key)
        os.replace(folder, target)  # a link is moved as a link: nothing is followed
        logger.warning("%s does not prove it holds cell %s (%s): set aside, untouched, in %s; the cell trains again",
                       folder, key, problem, target)
        return target

    def _unrecorded_aside(self, folder: Path, key: str) -> None:
        """What ``folder`` (cell ``key``'s, proving its build) holds beyond the files its build recorded (a note, a
        link, a folder of your own) moved to ``retired/.unverified/<key>-<n>/``, each at its relative path, with one
        warning naming them: the study's output holds what a clean build writes, and the cell stays built."""
        found = _unrecorded(folder, set(read_record(folder)["files"]))
        if not found:
            return
        target = self._aside(key)
        for relative in found:
            (target / relative).parent.mkdir(parents=True, exist_ok=True)
            os.replace(folder / relative, target / relative)  # links moved as links
        logger.warning("%s holds what its build did not write (%s): moved aside, untouched, to %s; the cell stays "
                       "built", folder, ", ".join(map(str, found)), target)

    def _aside(self, key: str) -> Path:
        """A new place for something of cell ``key`` set aside: ``retired/.unverified/<key>-<n>``, never another's."""
        aside = self.retired / UNVERIFIED
        aside.mkdir(parents=True, exist_ok=True)
        number = 1
        while (target := aside / f"{key}-{number}").exists() or target.is_symlink():
            number += 1
        return target

    def _retire(self, key: str) -> None:
        """Cell ``key``'s folder moved to `retired`, over an older retired folder of it that this class put there
        (one that proves its own build); any other folder there is set aside first, never deleted."""
        retired = self.retired / key
        if (retired.exists() or retired.is_symlink()) and (problem := proof_problem(retired)) is not None:
            self._set_aside(retired, key, problem)
        self._move(self.path / key, retired)

    @staticmethod
    def _move(source: Path, target: Path) -> None:
        """``source`` renamed to ``target`` (same file system: nothing is copied); an older ``target`` goes first."""
        target.parent.mkdir(parents=True, exist_ok=True)
        if target.exists():
            shutil.rmtree(target)  # an older folder of the same cell, which this class put there
        os.replace(source, target)


def _not_an_older_build(folder: Path, key: str, planned: Mapping[str, str]) -> str | None:
    """None if ``folder`` is an intact build of cell ``key``, an older one; else why not. A folder swapped in from
    another cell's place proves its own build, and its record names that cell (before records named their cell: its
    key is that planned cell's, ``planned`` being ``{cell key: build key}``)."""
    if (problem := proof_problem(folder)) is not None:
        return problem
    record = read_record(folder)
    owner = record.get("cell") or next((cell for cell, build in planned.items() if build == record["key"]), key)
    return None if owner == key else f"it holds the build of cell {owner}, not of {key}"


def _not_inside(folder: Path, name: str) -> str | None:
    """None if the recorded file ``name`` is a plain path below ``folder``, through no link; else why not (a record
    written by hand could name a file anywhere: its proof, or a copy of it, must never read or write there)."""
    relative = Path(name)
    if relative.is_absolute() or ".." in relative.parts or not relative.parts:
        return f"its {BUILD_FILE} names {name!r}, not a path inside the folder"
    for parent in list(reversed(relative.parents))[1:]:  # the folders on the way, below ``folder``
        if (folder / parent).is_symlink():
            return f"{parent} is a link, not a folder (a cell folder is never followed out of itself)"
    return None


def _unrecorded(folder: Path, files: set[str]) -> list[Path]:
    """The paths below ``folder`` that are neither its build record nor one of ``files`` (relative paths), nor a
    folder on their way: files and links, and folders holding nothing recorded, each whole. Links are not followed."""
    recorded = {*files, BUILD_FILE}
    holding = {parent for name in recorded for parent in Path(name).parents}
    found = []
    for root, folders, names in os.walk(folder):  # os.walk lists a link to a folder in `folders`, never enters it
        here = Path(root).relative_to(folder)
        for name in list(folders):
            if here / name not in holding or (folder / here / name).is_symlink():
                found.append(here / name)
                folders.remove(name)
        found += [here / name for name in names if str(here / name) not in recorded]
    return sorted(found)


class _NotCopied(Exception):
    """A source not copied: it is another build's, does not prove its build, or changed while it was copied
    (nothing of the copy is kept)."""


class CellDiskFull(DiskFull):
    """No room for a cell's folder (nothing of it was written). Pickled as any OSError: a worker sends it on."""


@contextlib.contextmanager
def _disk_full_said(folder: Path, needed) -> Iterator[None]:
    """A disk full (or a quota reached) while ``folder`` is written, whatever the writer raised (the atomic write
    says it as a `DiskFull`), as one `CellDiskFull` (``needed()``: the bytes it takes); the atomic write has left
    nothing of it."""
    try:
        yield
    except Exception as error:
        if isinstance(error, CellDiskFull) or not disk_full(error):
            raise
        raise CellDiskFull(errno.ENOSPC, f"no space left for cell {folder.name}'s folder in {folder.parent}: it needs "
                                         f"up to {in_bytes(needed())} and {in_bytes(free_bytes(folder))} are free. "
                                         "Free space there; every cell built so far is kept, and the next build trains "
                                         "only the rest") from error


def _folder_bytes(folder: Path) -> int:
    """The bytes of the files below ``folder``; links are not followed."""
    return sum(path.lstat().st_size for path in folder.rglob("*") if path.is_file() and not path.is_symlink())


def _state_bytes(model) -> int:
    """The bytes of a model's weights (what its folder holds, at most)."""
    return sum(tensor.numel() * tensor.element_size() for tensor in model.state_dict().values()) \
        if hasattr(model, "state_dict") else 0


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
