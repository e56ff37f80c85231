"""Writing outputs so that an interrupted run never leaves a half-written artifact, nor loses the previous one; and
never replaces a folder that holds something layertune did not write (`output_directory`). The content hashes that
name and check what is written (of a file, a dataset, named tensors)."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import re
import shutil
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

CACHE_ENV = "LAYERTUNE_CACHE"  # where the library keeps what it can compute again (tokenized data, frozen states)


def cache_root() -> Path:
    """``$LAYERTUNE_CACHE``, else ``~/.cache/layertune``."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "layertune").expanduser()


_PARTIAL = ".partial-"  # staging folders and files: .<name>.partial-<pid>-<random>[<suffix>]
# In every folder `output_directory` writes: what proves that replacing the folder loses nothing of the user's.
MARKER = ".layertune-output"
Needed = int | Callable[[], int] | None  # the bytes an output takes, or what counts them when asked (a full disk)


class OutputDirectoryError(ValueError):
    """An output folder that may not be replaced; raised before any work."""


def check_output_directory(path: str | Path, *, overwrite: bool = False) -> Path:
    """``path`` if a new output may take its place: it does not exist, is an empty folder, holds `MARKER` (a
    previous layertune output) or, with ``overwrite``, is any other folder. Never the current folder, the home
    folder or a parent of either (``/`` included), even with ``overwrite``: replacing one deletes what it holds."""
    given, path = str(path), Path(path).expanduser()  # messages name the folder as the caller wrote it
    resolved, cwd, home = path.resolve(), Path.cwd().resolve(), Path.home().resolve()
    if resolved in (cwd, *cwd.parents, home, *home.parents):
        what = f"the current folder ({cwd})" if resolved == cwd else f"the home folder ({home})" \
            if resolved == home else f"a parent of the current folder ({cwd})" if resolved in cwd.parents \
            else f"a parent of the home folder ({home})"
        raise OutputDirectoryError(
            f"Output folder {given!r} is {what}: writing an output there would replace the folder and delete "
            f"everything in it. Give a new folder for the output, e.g. {_new_folder_name()!r}.")
    if path.is_symlink():
        raise OutputDirectoryError(f"Output folder {given!r} is a symbolic link (to {resolved}): the output would "
                                   "replace the link. Give the folder it points to, or a new folder.")
    if not path.exists():
        return path
    if not path.is_dir():
        raise OutputDirectoryError(f"Output folder {given!r} exists and is not a folder. Give another path.")
    if overwrite or _empty_or_marked(path):
        return path
    raise OutputDirectoryError(
        f"Output folder {given!r} already exists and holds files layertune did not write (it has no {MARKER} "
        "file): writing the output there would delete them. Choose another folder, or pass overwrite=True "
        "(on the command line --overwrite) to replace it and everything in it.")


def _new_folder_name() -> str:
    """A folder name in the current folder that nothing holds yet (``run``, else ``run-2``, …): what a refused output
    folder's message suggests. Below the given folder it could be a system one (``/`` gave ``/run``)."""
    return next(name for name in ("run", *(f"run-{n}" for n in range(2, 1000))) if not os.path.lexists(name))


def _empty_or_marked(folder: Path) -> bool:
    marker = folder / MARKER
    return not any(folder.iterdir()) or marker.is_file() and not marker.is_symlink()


@contextlib.contextmanager
def output_directory(path: str | Path, *, overwrite: bool = False, written_by: str = "layertune",
                     needed: Needed = None) -> Iterator[Path]:
    """`atomic_directory` for a folder the user names: `check_output_directory` first, and again before the swap
    (the folder may have changed while the block ran); the new folder holds `MARKER` (JSON: ``written_by``), so
    the next output may replace it without ``overwrite``."""
    check_output_directory(path, overwrite=overwrite)
    with atomic_directory(Path(path).expanduser(), needed=needed) as staging:
        write_json(staging / MARKER, {"written_by": written_by, "note": "a later output here replaces this folder"})
        yield staging
        check_output_directory(path, overwrite=overwrite)


@contextlib.contextmanager
def atomic_directory(path: str | Path, *, needed: Needed = None) -> Iterator[Path]:
    """Yield a staging folder beside ``path``; it takes ``path``'s place, in one atomic step, only if the block
    finishes without error. Staging folders left by processes that died (a kill during a write) are removed. A
    full disk, whichever writer met it, is one `DiskFull` naming the folder and ``needed`` (`disk_full_said`)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_partials(path.parent)
    # A plain mkdir (not mkdtemp's private 0700) so that the result has ordinary permissions.
    staging = path.parent / f".{path.name}{_PARTIAL}{os.getpid()}-{uuid.uuid4().hex}"
    try:
        with disk_full_said(path, needed, staging):
            staging.mkdir()
            yield staging
        if path.exists():
            _exchange(staging, path)  # staging now holds the old folder, removed below
        else:
            os.replace(staging, path)
    finally:
        _remove(staging)


@contextlib.contextmanager
def atomic_file(path: str | Path, *, needed: Needed = None) -> Iterator[Path]:
    """Yield a staging file path beside ``path`` (same suffix, so writers that go by it still do); it replaces
    ``path`` in one atomic step only if the block finishes without error: a reader sees the old file or the new
    one, never half of one. Staging files left by processes that died are removed, as `atomic_directory`'s are; a
    full disk is one `DiskFull`, as there."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_partials(path.parent)
    staging = path.parent / f".{path.name}{_PARTIAL}{os.getpid()}-{uuid.uuid4().hex}{path.suffix}"
    try:
        with disk_full_said(path, needed, staging):
            yield staging
        os.replace(staging, path)
    finally:
        _remove(staging)


def _remove(path: Path) -> None:
    """``path`` gone, ignoring errors; a link (what the swap left if ``path`` was one) is unlinked, never followed."""
    if path.is_symlink() or path.is_file():
        with contextlib.suppress(OSError):
            path.unlink()
    else:
        shutil.rmtree(path, ignore_errors=True)


def remove_stale_partials(folder: Path) -> list[Path]:
    """Remove staging folders in ``folder`` whose writing process no longer exists; return those of writers alive."""
    alive = []
    with contextlib.suppress(OSError):
        for entry in os.scandir(folder):
            if entry.name.startswith(".") and _PARTIAL in entry.name:
                if process_alive(_pid_of(entry.name)):
                    alive.append(Path(entry.path))
                else:
                    _remove(Path(entry.path))
    return alive


def _pid_of(name: str) -> int:
    try:
        return int(name.rsplit(_PARTIAL, 1)[1].split("-")[0])
    except (IndexError, ValueError):
        return -1  # an older staging name: no owner recorded, treated as stale


def process_alive(pid: int) -> bool:
    """Whether a process with this id runs on this machine (a zombie, which has exited, does not)."""
    import psutil

    try:
        return pid > 0 and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
    except psutil.Error:  # another user's process that cannot be read: it exists
        return True


def _exchange(first: Path, second: Path) -> None:
    """Swap two paths atomically (Linux renameat2 RENAME_EXCHANGE). Elsewhere: move ``second`` aside, then
    ``first`` in (a kill between the two leaves the old folder aside, beside the path, not lost)."""
    if sys.platform == "linux":
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = getattr(libc, "renameat2", None)
        if renameat2 is not None:
            at_fdcwd, rename_exchange = -100, 2
            if renameat2(at_fdcwd, os.fsencode(first), at_fdcwd, os.fsencode(second), rename_exchange) == 0:
                return
    aside = second.parent / f".{second.name}{_PARTIAL}{os.getpid()}-{uuid.uuid4().hex}"
    os.replace(second, aside)
    os.replace(first, second)
    os.replace(aside, first)


def file_digest(path: str | Path) -> str:
    """A fast content hash (xxh3-128) of a file, read in chunks."""
    import xxhash

    digest = xxhash.xxh3_128()
    with open(path, "rb") as handle:
        while chunk := handle.read(2**24):
            digest.update(chunk)
    return digest.hexdigest()


def file_digests(folder: str | Path) -> dict[str, str]:
    """``{path relative to folder: file_digest}`` of every file below ``folder``, sorted; links are left out, never
    followed."""
    folder = Path(folder)
    return {str(path.relative_to(folder)): file_digest(path)
            for path in sorted(folder.rglob("*")) if path.is_file() and not path.is_symlink()}


DIGEST_ROWS = 8192  # rows hashed at a time: the memory a digest takes stays small, whatever the dataset


def dataset_digest(dataset, columns: list[str] | None = None) -> str:
    """A content hash (xxh3-128) of a `datasets.Dataset`'s rows as they read (a selection applied), of ``columns``
    or all, with their features (label names included): equal data gives the same digest in any process, however
    it is stored (files, chunks, a selection's indices). Through Arrow's IPC form, whole columns at a time: a
    row-wise read costs about a second per 2,000 examples."""
    import datasets
    import pyarrow as pa
    import xxhash

    columns = list(dataset.column_names if columns is None else columns)
    features = datasets.Features({column: dataset.features[column] for column in columns}).to_dict()
    digest = xxhash.xxh3_128(json.dumps(features, sort_keys=True).encode())
    for batch in dataset.select_columns(columns).with_format("arrow").iter(batch_size=DIGEST_ROWS):
        # Each column copied into one array of its own: the IPC form of a slice (a selection of contiguous rows,
        # a batch) carries bytes of the rows around it.
        arrays = [pa.concat_arrays(column.chunks) if column.num_chunks else pa.array([], type=column.type)
                  for column in batch.columns]
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, pa.schema([(name, array.type) for name, array in zip(columns, arrays)])) as out:
            out.write_batch(pa.RecordBatch.from_arrays(arrays, names=columns))
        digest.update(sink.getvalue())
    return digest.hexdigest()


def tensors_digest(tensors: dict) -> str:
    """A content hash (xxh3-128) of named tensors (``{name: torch.Tensor}``): names, dtypes, shapes and bytes."""
    import torch
    import xxhash

    digest = xxhash.xxh3_128()
    for name in sorted(tensors):
        tensor = tensors[name].detach().cpu().contiguous()
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        digest.update(tensor.view(torch.uint8).numpy() if tensor.numel() else b"")
    return digest.hexdigest()


def write_json(path: str | Path, data: object) -> None:
    """Sorted keys and a trailing newline: equal data gives byte-identical files. NaN and infinity are refused:
    they are not JSON. Written atomically (`atomic_file`)."""
    text = (json.dumps(data, indent=2, sort_keys=True, allow_nan=False) + "\n").encode()  # a refusal leaves no file
    with atomic_file(path, needed=len(text)) as staging:
        staging.write_bytes(text)


# ------------------------------------------------------------------------------------------------ a full disk

DISK_FULL = (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC))  # no space left; a quota reached
# How writers that raise no OSError with its errno say it: Rust's io::Error ("No space left on device (os error 28)":
# safetensors, tokenizers), Arrow's detail ("[errno 28]"), and numpy's short write, an OSError with no errno
# ("100000 requested and 8176 written": a file on a local disk is written short when it is full).
_SAID = re.compile(r"\(os error (\d+)\)|\[errno (\d+)\]", re.IGNORECASE)
_SHORT_WRITE = re.compile(r"^\d+ requested and \d+ written$")


def disk_full(error: BaseException | None) -> bool:
    """Whether ``error``, or an error it was raised from, says that a disk is full or a quota reached."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and (error.errno in DISK_FULL or error.errno is None and
                                           _SHORT_WRITE.match(str(error))):
            return True
        if any(int(code) in DISK_FULL for match in _SAID.finditer(str(error)) for code in match.groups() if code):
            return True
        error = error.__cause__ or error.__context__
    return False


class DiskFull(OSError):
    """No room on a disk for an output (or a quota reached): its message names the folder, the bytes the output
    needs and those free, and what to do; the atomic write left nothing of it. Pickled as any OSError (a worker
    process sends it on), its message whole; ``needed`` is lost on the way."""

    ADVICE = "Free space there, or write it to another disk; nothing of it was written, and what was there is kept."
    needed = 0

    @classmethod
    def of(cls, code: int, path: Path, needed: int, at_least: bool = False, advice: str = ADVICE) -> DiskFull:
        """The error for ``path`` (a file or folder being written) that needs ``needed`` bytes (``at_least``: what
        was written when the disk filled, the whole being unknown)."""
        how = "at least" if at_least else "about"
        full = cls(code, f"no space left in {path.parent} for {path.name}: it needs {how} {in_bytes(needed)} and "
                         f"{in_bytes(free_bytes(path.parent))} are free. {advice}")
        full.needed = needed
        return full

    def __str__(self) -> str:  # the sentence alone, as every one-line error prints it (not "[Errno 28] …")
        return self.strerror


def disk_full_error(error: BaseException) -> DiskFull | None:
    """The `DiskFull` that says ``error``'s full disk: the first in its chain (the one nearest the caller), else one
    in the writer's own words; None if ``error`` is no full disk."""
    if not disk_full(error):
        return None
    seen, cause = set(), error
    while cause is not None and id(cause) not in seen:
        if isinstance(cause, DiskFull):
            return cause
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__
    where = f" ({error.filename})" if isinstance(error, OSError) and error.filename else ""
    said = " ".join(str(error).split())
    return DiskFull(errno.ENOSPC, f"no space left on a disk{where}: {said}. Free space there, and run it again")


def in_bytes(size: int) -> str:
    """``size`` as a message says it: ``173,704 bytes (169.6 KiB)``; the unit that keeps it under 1,024."""
    shown, unit = float(size), "bytes"
    for bigger in ("KiB", "MiB", "GiB", "TiB"):
        if shown < 1024:
            break
        shown, unit = shown / 1024, bigger
    return f"{size:,} bytes" + (f" ({shown:,.1f} {unit})" if unit != "bytes" else "")


def free_bytes(folder: Path) -> int:
    """The bytes free to this user on ``folder``'s disk (its nearest existing parent's)."""
    return shutil.disk_usage(next(p for p in (folder, *folder.parents) if p.exists())).free


@contextlib.contextmanager
def disk_full_said(path: str | Path, needed: Needed = None, staging: Path | None = None) -> Iterator[None]:
    """Within the block, a full disk (whatever the writer raised: an OSError, safetensors' or Arrow's own error) is
    one `DiskFull` for ``path``, naming ``needed`` (bytes, or a function that counts them), else at least what
    ``staging`` holds (or an inner `DiskFull` counted). A `DiskFull` of a write inside (a model's folder inside a
    cell's) is said again for ``path``, the one the caller named."""
    try:
        yield
    except Exception as error:
        if not disk_full(error):
            raise
        size = needed() if callable(needed) else needed
        code = error.errno if isinstance(error, OSError) and error.errno in DISK_FULL else errno.ENOSPC
        if size is None:
            size = max(_size(staging), error.needed if isinstance(error, DiskFull) else 0)
            raise DiskFull.of(code, Path(path), size, at_least=True) from error
        raise DiskFull.of(code, Path(path), size) from error


def _size(path: Path | None) -> int:
    """The bytes of the files at or below ``path`` (0 if none); links are not followed."""
    if path is None or not (path.exists() or path.is_symlink()):
        return 0
    if not path.is_dir() or path.is_symlink():
        return path.lstat().st_size
    return sum(file.lstat().st_size for file in path.rglob("*") if file.is_file() and not file.is_symlink())


class CacheNotWritable(PermissionError):
    """The cache folder cannot be written (read-only, or not this user's); ``advice`` as in `CacheDiskFull`."""

    ADVICE = "Point the cache at a folder you can write (cache_dir=, --cache-dir or $LAYERTUNE_CACHE)."

    def __init__(self, root: Path, reason: str, advice: str = ADVICE) -> None:
        self.root, self.reason = root, reason
        super().__init__(errno.EACCES, f"Cannot write the layertune cache folder {root} ({reason}). {advice}")

    def advising(self, advice: str) -> CacheNotWritable:
        return CacheNotWritable(self.root, self.reason, advice)


def check_writable(root: Path) -> None:
    """`CacheNotWritable` unless a file can be made in ``root`` (made if missing). Here, below everything that
    imports torch: the pipeline checks its cache folder in every stage that names it, before any work."""
    import tempfile

    try:
        root.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=root):
            pass
    except OSError as error:
        if error.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):
            raise
        raise CacheNotWritable(root, error.strerror or str(error)) from None
