"""Profiles: named sets of overrides of ``params.yaml`` (``profiles/<name>.yaml``, ``dotted.key: value``; ``decided``:
the record of rounds), run as DVC experiments: ``dvc exp run $(python -m pipelines.profiles ci)``."""

from __future__ import annotations

import copy
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from layertune.errors import choices_hint
from layertune.study import ParamsError
from pipelines.params import RECORD_FILE, RECORD_KEY, read_params, read_yaml, validate_params


def profile_names(root: str | Path = ".") -> list[str]:
    """The profiles shipped in ``<root>/profiles``."""
    return sorted(p.stem for p in (Path(root) / "profiles").glob("*.yaml"))


def load_profile(name_or_path: str | Path, root: str | Path = ".") -> dict[str, Any]:
    """A profile's overrides ``{dotted.key: value}`` from ``profiles/<name>.yaml`` (or a path)."""
    path = Path(name_or_path)
    if not path.suffix:
        path = Path(root) / "profiles" / f"{name_or_path}.yaml"
    if not path.is_file():
        raise FileNotFoundError(f"No profile {str(name_or_path)!r} ({path} is missing)."
                                f"{choices_hint(name_or_path, profile_names(root))}")
    overrides = read_yaml(path) or {}
    if not isinstance(overrides, dict) or not all(isinstance(k, str) for k in overrides):
        raise ParamsError(f"{path}: a profile is a mapping of dotted keys to values, e.g. "
                          "'studies.ablation.training.epochs: 1'.")
    return overrides


def apply_overrides(params: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """``params`` with each ``dotted.key`` set, as `dvc_arguments` makes DVC do it: a value (a mapping too: a
    profile's ``encoders`` are all the encoders) replaces what was there; missing sections are created."""
    merged = copy.deepcopy(dict(params))
    for key, value in overrides.items():
        node, parts = merged, key.split(".")
        for part in parts[:-1]:
            if not isinstance(node.setdefault(part, {}), dict):
                raise ParamsError(f"profile key {key!r}: {part!r} holds a value, not a section of params.yaml")
            node = node[part]
        node[parts[-1]] = value
    return merged


def dvc_arguments(overrides: Mapping[str, Any], params: Mapping[str, Any]) -> list[str]:
    """``dvc exp run`` arguments that apply a profile to ``params`` (`read_params`) as `apply_overrides` does, in
    Hydra's syntax: ``++key=value``; a mapping is deleted (``~key``) and added again (``+key=…``), since Hydra would
    merge it into the old one. A key under ``decided`` (a profile clearing a decided study's rounds) is set in the
    record of rounds' file."""
    arguments = []
    for key, value in overrides.items():
        file = f"{RECORD_FILE}:" if key.split(".")[0] == RECORD_KEY else ""
        if isinstance(value, dict):
            if _has_key(params, key):
                arguments += ["-S", f"{file}~{key}"]
            arguments += ["-S", f"{file}+{key}={_hydra_value(value)}"]
        else:
            arguments += ["-S", f"{file}++{key}={_hydra_value(value)}"]
    return arguments


def _has_key(params: Mapping[str, Any], key: str) -> bool:
    node: Any = params
    for part in key.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return False
        node = node[part]
    return True


def _hydra_value(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return "[" + ",".join(_hydra_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{_hydra_value(v)}" for k, v in value.items()) + "}"
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, str):  # quoted: 'all', hub ids with '/', names with '-' stay strings
        return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"
    return str(value)


def main(argv: list[str] | None = None) -> int:
    """``python -m pipelines.profiles <profile>`` prints the ``dvc exp run`` arguments that select it;
    ``--check`` validates params.yaml with the profile applied instead."""
    import argparse

    from pipelines.hooks import ModelMirrorHook
    from pipelines.param_checks import InvalidParams

    parser = argparse.ArgumentParser(prog="python -m pipelines.profiles", description=main.__doc__)
    parser.add_argument("profile", help=f"a name in profiles/ ({', '.join(profile_names())}) or a path")
    parser.add_argument("--check", action="store_true", help="validate params.yaml with the profile applied")
    parser.add_argument("--params", default="params.yaml")
    args = parser.parse_args(argv)
    try:
        project = Path(args.params).resolve().parent
        overrides, params = load_profile(args.profile), read_params(project)
        if args.check:
            checked = apply_overrides(params, overrides)
            # Models resolved as the stages resolve them (their hook's rule).
            ModelMirrorHook().apply((checked.get("download") or {}).get("model_mirror"), project)
            validate_params(checked)
            print(f"{args.profile}: valid")
        else:
            print(" ".join(dvc_arguments(overrides, params)))
    except (ParamsError, FileNotFoundError, InvalidParams) as error:
        print(f"error: {error.message if isinstance(error, InvalidParams) else error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
