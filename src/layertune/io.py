"""Writing outputs so that an interrupted run never leaves a half-written artifact behind."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def atomic_directory(path: str | Path) -> Iterator[Path]:
    """Yield a temporary sibling folder; it replaces ``path`` only if the block finishes without error."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{path.name}.partial-", dir=path.parent))
    staging.chmod(0o777 & ~_umask())  # mkdtemp makes it private (0700); the result is an ordinary folder
    try:
        yield staging
        if path.exists():
            shutil.rmtree(path)
        os.replace(staging, path)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_json(path: str | Path, data: object) -> None:
    """Sorted keys and a trailing newline: equal data gives byte-identical files."""
    Path(path).write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
