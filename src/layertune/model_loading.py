"""Loading a Hugging Face encoder safely: its config (no code runs unless the caller allows it), its tokenizer, and
its weights (safetensors only, in float32), with errors that say what is wrong and what to do."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers

from layertune.model_paths import (first_line, gated_model, is_gated, model_not_found, require_safe_weights,
                                   resolve_model_path)

# Config attributes that hold the dropout after attention/feed-forward blocks, by model family.
_DROPOUT_ATTRIBUTES = ("hidden_dropout_prob", "dropout", "hidden_dropout")


def load_config(path: str, trust_remote_code: bool, revision: str | None) -> transformers.PretrainedConfig:
    folder = Path(path)
    if folder.is_dir() and not (folder / "config.json").is_file():
        raise OSError(f"{folder} is a folder but not a model in Hugging Face layout: it has no config.json "
                      f"(it holds {', '.join(sorted(p.name for p in folder.iterdir())[:5]) or 'nothing'}).")
    if folder.is_dir():
        try:
            json.loads((folder / "config.json").read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise OSError(f"{folder / 'config.json'} is not valid JSON ({error}): the model folder is damaged.") from None
    try:
        return transformers.AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code, revision=revision)
    except ValueError as error:
        if trust_remote_code or "trust_remote_code" not in str(error):
            raise
        raise ValueError(
            f"{path} needs code that ships with the model (its config's auto_map names Python modules to run), and "
            "layertune runs none unless you ask: pass trust_remote_code=True (LanguageModel, from_pretrained) only "
            "if you trust where the model came from."
        ) from None
    except OSError as error:
        if folder.is_dir():  # a model folder that cannot be read: transformers' own message says why
            raise
        raise OSError(gated_model(path) if is_gated(error) else
                      model_not_found(path, revision, f"{type(error).__name__}: {first_line(error)}")) from None


def load_tokenizer(path, trust_remote_code: bool, revision: str | None):
    """The model's tokenizer. One whose config names code (``auto_map``) cannot load without running that code:
    transformers then fails with an unrelated message (no sentencepiece or tiktoken to convert a slow tokenizer),
    so say what it is and how to allow it."""
    try:
        return transformers.AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code, revision=revision)
    except (ValueError, OSError) as error:
        from transformers.models.auto.tokenization_auto import get_tokenizer_config

        if trust_remote_code or "auto_map" not in get_tokenizer_config(path, revision=revision):
            raise
        raise ValueError(
            f"{path}'s tokenizer needs code that ships with the model (its tokenizer_config.json's auto_map names "
            "Python modules to run), and layertune runs none unless you ask: pass trust_remote_code=True "
            "(LanguageModel, from_pretrained) only if you trust where the model came from.") from error


def load_weights(path, config: transformers.PretrainedConfig, trust_remote_code: bool, revision: str | None):
    """The pretrained encoder under ``config``, and the names of the tensors its checkpoint lacked (newly drawn).

    Read from safetensors only (never unpickled), and in float32 whatever the checkpoint's dtype (transformers 5
    keeps a float16 or bfloat16 checkpoint's): weights that train need float32 for AdamW's small steps; lower
    precision is autocast's business, per operation."""
    require_safe_weights(path)
    model, loading = transformers.AutoModel.from_pretrained(
        path, config=config, trust_remote_code=trust_remote_code, revision=revision, output_loading_info=True,
        use_safetensors=True, dtype=torch.float32)
    return model, set(loading["missing_keys"])


def load_base_model(name: str, config, trust_remote_code: bool, revision: str | None):
    """The pretrained weights and tokenizer of ``name``, under ``config`` (the saved one: dropout and all)."""
    path = resolve_model_path(name)
    require_safe_weights(path, f"base model {name!r}")
    try:
        model, missing = load_weights(path, config, trust_remote_code, revision)
        tokenizer = load_tokenizer(path, trust_remote_code, revision)
    except OSError as error:
        raise OSError(f"This model stores only the tensors it trained; the frozen rest comes from its base model "
                      f"{name!r}, which cannot be loaded here: not a local folder (relative to {Path.cwd()}), not "
                      f"packaged, not in the model mirror, and the hub did not provide it ({error}).") from None
    return model, tokenizer, missing


def set_hidden_dropout(config: transformers.PretrainedConfig, probability: float) -> None:
    names = [a for a in _DROPOUT_ATTRIBUTES if hasattr(config, a)]
    if not names:
        raise ValueError(f"{type(config).__name__} has none of {_DROPOUT_ATTRIBUTES}; cannot set hidden_dropout_prob.")
    setattr(config, names[0], probability)
