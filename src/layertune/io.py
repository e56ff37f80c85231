"""Writing outputs so that an interrupted run never leaves a half-written artifact, nor loses the previous one."""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import shutil
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

_PARTIAL = ".partial-"  # staging folders: .<name>.partial-<pid>-<random>


@contextlib.contextmanager
def atomic_directory(path: str | Path) -> Iterator[Path]:
    """Yield a staging folder beside ``path``; it takes ``path``'s place, in one atomic step, only if the block
    finishes without error. Staging folders left by processes that died (a kill during a write) are removed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_partials(path.parent)
    # A plain mkdir (not mkdtemp's private 0700) so that the result has ordinary permissions.
    staging = path.parent / f".{path.name}{_PARTIAL}{os.getpid()}-{uuid.uuid4().hex}"
    staging.mkdir()
    try:
        yield staging
        if path.exists():
            _exchange(staging, path)  # staging now holds the old folder, removed below
        else:
            os.replace(staging, path)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def remove_stale_partials(folder: Path) -> None:
    """Remove staging folders in ``folder`` whose writing process no longer exists."""
    with contextlib.suppress(OSError):
        for entry in os.scandir(folder):
            if entry.name.startswith(".") and _PARTIAL in entry.name and not process_alive(_pid_of(entry.name)):
                shutil.rmtree(entry.path, ignore_errors=True)


def _pid_of(name: str) -> int:
    try:
        return int(name.rsplit(_PARTIAL, 1)[1].split("-")[0])
    except (IndexError, ValueError):
        return -1  # an older staging name: no owner recorded, treated as stale


def process_alive(pid: int) -> bool:
    """Whether a process with this id exists on this machine."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
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


def write_json(path: str | Path, data: object) -> None:
    """Sorted keys and a trailing newline: equal data gives byte-identical files. NaN and infinity are refused:
    they are not JSON."""
    Path(path).write_text(json.dumps(data, indent=2, sort_keys=True, allow_nan=False) + "\n")
