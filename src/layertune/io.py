"""Writing outputs so that an interrupted run never leaves a half-written artifact behind."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def atomic_directory(path: str | Path) -> Iterator[Path]:
    """Yield a temporary sibling folder; it replaces ``path`` only if the block finishes without error."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # A plain mkdir (not mkdtemp's private 0700) so that the result has ordinary permissions.
    staging = path.parent / f".{path.name}.partial-{uuid.uuid4().hex}"
    staging.mkdir()
    try:
        yield staging
        if path.exists():
            shutil.rmtree(path)
        os.replace(staging, path)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def write_json(path: str | Path, data: object) -> None:
    """Sorted keys and a trailing newline: equal data gives byte-identical files."""
    Path(path).write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
