"""Saving and loading task models: safetensors for weights, JSON for settings, never pickle.

A saved folder holds ``config.json`` (the task model's class, the specs that build it: an `EncoderSpec` per language
model, a `CombineSpec`, the `HeadSpec`; and the weights' checksums), ``model.safetensors`` and ``encoder/`` (the
Hugging Face config of each language model, and its tokenizer when the weights do not come from a base model).
`TaskModel.save` and `TaskModel.from_pretrained` call this module, which stands below them: each `TaskModel` class
registers itself here (`register`), to be loaded by the name its config holds. Folders saved before the specs were the
config's form load too (`_spec_form`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import safetensors.torch
from torch import nn

from layertune.io import atomic_directory, file_digest, tensors_digest, write_json
from layertune.language_model import LanguageModel
from layertune.model_specs import CombineSpec, EncoderSpec
from layertune.multi_encoder import MultiEncoder

if TYPE_CHECKING:
    from layertune.encoder import Encoder

MIN_FROZEN_SHARE = 0.1  # below this share of frozen weights, a saved model stores everything (no base needed)
_MODEL_CLASSES: dict[str, type[nn.Module]] = {}  # every `TaskModel` class by name (see `register`)


def register(model_class: type[nn.Module]) -> None:
    """Make ``model_class`` loadable from the class name a saved config holds."""
    _MODEL_CLASSES[model_class.__name__] = model_class


def save_task_model(model: nn.Module, directory: str | Path) -> Path:
    """Write the task model ``model`` into ``directory``, all or nothing; a model that kept a tenth or more of its
    weights frozen stores only what is not its base model's (see `TaskModel.save`)."""
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    trained = {name for name, parameter in model.named_parameters() if parameter.requires_grad}
    # Frozen and provided by the base checkpoint: these can be left to it (a frozen tensor the checkpoint lacked
    # was initialized at random, and is stored like a trained one).
    base = {f"encoder.{name}" for name in model.encoder.base_tensors()}
    frozen = {k: v for k, v in state.items() if k not in trained and k in base}
    frozen_share = sum(p.numel() for p in model.parameters() if not p.requires_grad) / max(
        sum(p.numel() for p in model.parameters()), 1)
    if frozen_share < MIN_FROZEN_SHARE:
        frozen = {}
    stored = {k: v for k, v in state.items() if k not in frozen}
    # safetensors says a full disk in its own error; the atomic write says it as a DiskFull naming these bytes
    with atomic_directory(directory, needed=sum(v.numel() * v.element_size() for v in stored.values())) as staging:
        model.encoder.save_config(staging / "encoder", tokenizer=not frozen)
        safetensors.torch.save_file(stored, staging / "model.safetensors")
        weights = {"file_xxh3": file_digest(staging / "model.safetensors"),
                   "base": {"frozen_xxh3": tensors_digest(frozen)} if frozen else None}
        write_json(staging / "config.json", {**model.config(), "weights": weights})
    return Path(directory)


def load_task_model(cls: type[nn.Module], directory: str | Path, *, trust_remote_code: bool = False) -> nn.Module:
    """The model `save_task_model` wrote, as the class its config names, which must be ``cls`` or a subclass; in
    eval mode (see `TaskModel.from_pretrained`)."""
    directory = Path(directory)
    config = _spec_form(_read_config(directory, cls))
    weights = config.get("weights") or {}
    encoder = load_encoder(directory / "encoder", config, trust_remote_code=trust_remote_code,
                           pretrained=weights.get("base") is not None)
    model = _MODEL_CLASSES[config["class"]]._from_config(encoder, config)
    if weights.get("file_xxh3") and file_digest(directory / "model.safetensors") != weights["file_xxh3"]:
        raise ValueError(f"{directory}/model.safetensors does not match the checksum in its config.json: the file "
                         "was changed or damaged after it was saved. Retrain or restore it.")
    try:
        state = safetensors.torch.load_file(directory / "model.safetensors")
    except Exception as error:  # safetensors raises its own error types for truncated/corrupt files
        raise ValueError(f"{directory}/model.safetensors is corrupt or partial ({error}).") from None
    if weights.get("base") is not None:
        _check_base(model, state, weights["base"], config["encoders"], directory)
    try:
        model.load_state_dict(state, strict=weights.get("base") is None)
    except RuntimeError as error:
        raise ValueError(f"{directory}/model.safetensors does not fit its config.json (a class count or size "
                         f"differs): {str(error).splitlines()[-1].strip()}") from None
    model.mark_trained()  # its weights are the saved ones: training continues from them, it draws nothing anew
    model.eval()
    return model


def load_encoder(directory: Path, config: dict, *, trust_remote_code: bool = False,
                 pretrained: bool = False) -> Encoder:
    """Rebuild a saved encoder (single or multi) from the specs in its model's ``config``: random weights, or
    ``pretrained`` the base models' (see `LanguageModel.from_saved`)."""
    specs = [EncoderSpec.model_validate(spec) for spec in config["encoders"]]
    options = {"trust_remote_code": trust_remote_code, "pretrained": pretrained}
    if config["combine"] is None:
        return LanguageModel.from_saved(directory, specs[0], config["pooling_source"][0], **options)
    return MultiEncoder.from_saved(directory, specs, CombineSpec.model_validate(config["combine"]),
                                   config["pooling_source"], **options)


def _spec_form(config: dict) -> dict:
    """``config`` as saved today. Before, it held an ``encoder`` settings dict (``name`` for the model; a
    `MultiEncoder`'s ``language_models``, ``combine_method``, ``dropout``, ``projection_size``) and the head's
    fields at its top level."""
    if "encoders" in config:
        return config
    encoder = config["encoder"]
    singles = encoder.get("language_models", [encoder])
    specs = [{"model": single["name"], "revision": single.get("revision"), "tunable_layers": single["tunable_layers"],
              "pooling": single["pooling"], "freeze_embeddings": single["freeze_embeddings"],
              "frozen_dropout": single["frozen_dropout"], "layers": single.get("layers"),
              **({"method": single["method"]} if "method" in single else {})} for single in singles]
    combine = {"method": encoder["combine_method"], "dropout": encoder["dropout"],
               "projection_size": encoder["projection_size"]} if "language_models" in encoder else None
    head = {key: config[key] for key in ("head", "head_hidden_size", "head_dropout")}
    return {**{key: value for key, value in config.items() if key not in {"encoder", *head}}, "encoders": specs,
            "combine": combine, "head": head,
            "pooling_source": [single.get("pooling_source", "saved with the model") for single in singles]}


def _read_config(directory: Path, cls: type[nn.Module]) -> dict:
    missing = [f for f in ("config.json", "model.safetensors", "encoder") if not (directory / f).exists()]
    if missing:
        raise ValueError(f"{directory} is not a complete saved layertune model: missing {', '.join(missing)}.")
    try:
        config = json.loads((directory / "config.json").read_text())
        model_class = _MODEL_CLASSES[config["class"]]
    except (json.JSONDecodeError, KeyError, TypeError) as error:
        raise ValueError(f"{directory}/config.json is corrupt or not a layertune model config ({error}).") from None
    if not issubclass(model_class, cls):
        raise ValueError(f"{directory} holds a {config['class']}, not a {cls.__name__}.")
    return config


def _check_base(model: nn.Module, stored: dict, base: dict, encoders: list[dict], directory: Path) -> None:
    """The base weights under the stored ones must be those the model was trained on."""
    current = model.state_dict()
    if unknown := sorted(set(stored) - set(current)):
        raise ValueError(f"{directory}/model.safetensors holds tensors this model does not have: {unknown[:3]}")
    frozen = {k: v for k, v in current.items() if k not in stored}
    if tensors_digest(frozen) != base["frozen_xxh3"]:
        names = [spec["model"] for spec in encoders]
        raise ValueError(f"The base weights found for {', '.join(map(repr, names))} differ from the ones the model in "
                         f"{directory} was trained on (content hash of its frozen tensors): another version or "
                         "revision of the model is installed or mirrored. Load the base it was trained on.")
