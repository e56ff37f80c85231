"""Command line: ``layertune train-cell --task sst2 --model sentence-transformers/all-MiniLM-L6-v2 --tunable-layers 2
--seed 1 --output-dir runs/sst2-k2`` (``--method lora``, or ``--method '{name: lora, r: 4}'``, tunes them with LoRA),
or ``layertune train-cell --spec cell.json --output-dir runs/x``.

Building a study is the pipeline's work: ``dvc repro``, or ``layertune repro --jobs 4`` / ``--ray`` for several cells
at a time. Other installed packages add such commands as entry points of group ``layertune.commands`` (the pipeline
adds ``repro``), so this library knows none of them.

Every option is a field of `layertune.specs.CellSpec` (``--seed`` is the training seed, ``--data-seed`` the
subsample's; ``--revision`` the model's, ``--data-revision`` the hub dataset's), generated from it, so the command line
takes exactly what the library takes, checked the same way.
"""

from __future__ import annotations

import argparse
import difflib
import json
import logging
import os
import sys
import traceback
import types
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

# (section of CellSpec, its model, options renamed where two sections share a field name)
_SECTIONS = (("corpus", "CorpusSpec", {"seed": "data_seed", "revision": "data_revision"}),
             ("encoder", "EncoderSpec", {}),
             ("head", "HeadSpec", {}), ("training", "TrainingConfig", {}))


def _models() -> list[tuple[str, type[BaseModel], dict[str, str]]]:
    from layertune import specs

    return [(section, getattr(specs, name), renamed) for section, name, renamed in _SECTIONS]


def _place(section: str) -> tuple:
    """Where an option section's fields go in a CellSpec: ``encoder`` is the first (only) encoder's."""
    return ("encoders", 0) if section == "encoder" else (section,)


def _as_option(line: str, given: set[str] | None = None) -> str:
    """A spec's error line under the option the user typed: ``encoders[0].model: required key is missing`` →
    ``--model: required key is missing``; ``encoders[0].method.targets: unknown key`` → ``--method: targets:
    unknown key``. ``given``: the options (``section.field``) given, where a --spec file gave the rest (whose keys
    keep their names); None: every key is an option's."""
    from layertune.errors import dotted_key

    keys = {dotted_key((*_place(section), name)): renamed.get(name, name)
            for section, model, renamed in _models() for name in model.model_fields
            if given is None or f"{section}.{name}" in given}
    for key in sorted(keys, key=len, reverse=True):
        if line.startswith((f"{key}:", f"{key}.", f"{key}[")):
            rest = line[len(key):]
            return f"--{keys[key].replace('_', '-')}" + (rest if rest.startswith(":") else f": {rest.lstrip('.')}")
    return line


def _value(text: str) -> Any:
    """A command-line value as YAML 1.2 would read it: 3, 2e-5, true, null, 'all', a list like [1e-4,3e-5], or a
    mapping like {name: lora, r: 4, target_modules: [query, value]}."""
    text = text.strip()
    for convert in (int, float):
        try:
            return convert(text)
        except ValueError:
            pass
    if text.startswith("[") and text.endswith("]"):
        return [_value(part) for part in _items(text[1:-1])]
    if text.startswith("{") and text.endswith("}"):
        pairs = [part.partition(":") for part in _items(text[1:-1])]
        return {_value(key): _value(value) for key, _, value in pairs}
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        return text[1:-1]
    return {"true": True, "false": False, "null": None}.get(text, text)


def _items(text: str) -> list[str]:
    """The comma-separated items of a flow list or mapping's inside, nested brackets kept whole."""
    items, depth, start = [], 0, 0
    for position, character in enumerate(text):
        depth += {"[": 1, "{": 1, "]": -1, "}": -1}.get(character, 0)
        if character == "," and depth == 0:
            items.append(text[start:position])
            start = position + 1
    items.append(text[start:])
    return [item.strip() for item in items if item.strip()]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="layertune", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    cell = commands.add_parser("train-cell", help="train one cell and write its folder")
    cell.add_argument("--output-dir", required=True,
                      help="the cell's folder; an existing one is replaced only if empty or a previous output")
    cell.add_argument("--overwrite", action="store_true",
                      help="replace --output-dir even if it holds files layertune did not write (deleting them)")
    cell.add_argument("--spec", type=Path, help="a CellSpec as JSON (options given too override it)")
    cell.add_argument("--data-mirror", help="local data folder (default: $LAYERTUNE_DATA_MIRROR)")
    cell.add_argument("--cache-dir", help="tokenized-data and frozen-prefix cache (default: $LAYERTUNE_CACHE)")
    cell.add_argument("--verbose", action="store_true",
                      help="on an error, the traceback too, not only its one line (also: $LAYERTUNE_VERBOSE=1)")
    for section, model, renamed in _models():
        group = cell.add_argument_group(f"{section} ({model.__name__})")
        for name, field in model.model_fields.items():
            option = renamed.get(name, name)
            default = "required" if field.is_required() else f"default: {_shown(field.default)}"
            values = _values(field.annotation)
            group.add_argument(f"--{option.replace('_', '-')}", dest=f"{section}.{name}", type=_value,
                               default=argparse.SUPPRESS, metavar="{" + ",".join(values) + "}" if values else "VALUE",
                               help=f"{field.description or ''} ({default})".strip())
    for name, command in _plugin_commands().items():
        plugged = commands.add_parser(name, help=f"(from {command.value.split(':')[0]})")
        try:
            plugged.set_defaults(run=command.load()(plugged))
        except Exception as error:  # a broken plugin must not take train-cell down with it
            plugged.set_defaults(run=lambda args, error=error, name=name: _unavailable(name, error))
    return parser


def _values(annotation: Any) -> list[str]:
    """The values a field takes, where they are a closed set (a Literal, a bool, and null where it may be): what its
    option's help lists. Empty for an open type (a number, a path)."""
    import typing

    if annotation is bool:
        return ["true", "false"]
    if typing.get_origin(annotation) is typing.Literal:
        return [str(value) for value in typing.get_args(annotation)]
    if typing.get_origin(annotation) is typing.Annotated:
        return _values(typing.get_args(annotation)[0])
    members = typing.get_args(annotation) if typing.get_origin(annotation) in (typing.Union, types.UnionType) else ()
    found = [_values(member) if member is not type(None) else ["null"] for member in members]
    return [value for values in found for value in values] if found and all(found) else []


def _shown(default: Any) -> str:
    """A default as the command line writes it."""
    return {True: "true", False: "false", None: "null"}.get(default, default) if isinstance(default, (bool, type(None))) \
        else str(default.model_dump() if isinstance(default, BaseModel) else default)


def _unavailable(name: str, error: Exception) -> int:
    print(f"layertune: error: the command {name!r} could not be loaded: {type(error).__name__}: {error}",
          file=sys.stderr)
    return 2


def _plugin_commands() -> dict:
    """Commands of other installed packages: entry points of group ``layertune.commands``, each a function that
    configures its subcommand's parser and returns the function that runs it (taking the parsed arguments)."""
    from importlib.metadata import entry_points

    return {entry.name: entry for entry in entry_points(group="layertune.commands") if entry.name != "train-cell"}


def _refuse_unknown(parser: argparse.ArgumentParser, name: str, unknown: list[str]) -> None:
    """Exit with one line from the subcommand (not the top level's usage), naming for each unknown option the
    subcommand's closest (by spelling, or one it begins or ends), or, for one of its own given before it, where it
    goes."""
    command = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[name]
    options = {option.lstrip("-"): option for action in command._actions for option in action.option_strings
               if option.startswith("--") and option != "--help"}
    hints = []
    for word in (word.split("=")[0] for word in unknown if word.startswith("--")):
        typed = word.lstrip("-")
        if typed in options:
            hints.append(f"{word} goes after {name}")
        elif found := (difflib.get_close_matches(typed, options, n=2)
                       or [option for option in options if typed.startswith(option) or option.startswith(typed)][:2]):
            hints.append(f"{word}: did you mean {' or '.join(options[option] for option in found)}?")
    command.exit(2, f"{command.prog}: error: unrecognized arguments: {' '.join(unknown)}"
                    + "".join(f"; {hint}" for hint in hints) + f" ({command.prog} --help lists the options)\n")


def cell_spec(options: dict[str, Any], base: dict | None = None):
    """A `CellSpec` from ``{"section.field": value}`` options over ``base`` (a spec as a dict)."""
    from layertune.specs import CellSpec

    spec = json.loads(json.dumps(base if base is not None else {"corpus": {}, "encoders": [{}]}))
    if not isinstance(spec, dict) or not isinstance(spec.setdefault("encoders", [{}]), list):
        raise ValueError("--spec: a CellSpec's JSON is an object whose encoders are a list: {\"corpus\": {...}, "
                         "\"encoders\": [{...}], ...}")
    spec["encoders"] = spec["encoders"] or [{}]
    for key, value in options.items():
        section, name = key.split(".")
        target = spec
        for step in _place(section):
            target = target[step] if isinstance(target, list) else target.setdefault(step, {})
        target[name] = value
    return CellSpec.model_validate(spec)


def main(argv: list[str] | None = None) -> int:
    from layertune.cell import train_cell
    from layertune.errors import CorpusArgumentError, describe_validation_error
    from layertune.specs import CellSpec

    parser = _parser()
    parsed, unknown = parser.parse_known_args(argv)
    if unknown:
        _refuse_unknown(parser, parsed.command, unknown)
    if parsed.command != "train-cell":
        return parsed.run(parsed)
    args = vars(parsed)
    options = {key: value for key, value in args.items() if "." in key}
    base = None
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        base = _read_spec(args.pop("spec")) if args.get("spec") else None
        trained = train_cell(cell_spec(options, base), args["output_dir"], data_mirror=args.get("data_mirror"),
                             cache_dir=args.get("cache_dir"), overwrite=args["overwrite"])
    except ValidationError as error:
        _traceback_if_asked(args["verbose"])
        # a key the command line set (or could have, where no --spec file gave it) under the option's name
        given = None if base is None else set(options)
        lines = [_as_option(line, given) + (" (a list: [a, b])" if "a valid list" in line and base is None else "")
                 for line in describe_validation_error(error, schema=CellSpec)]
        print(f"layertune: error: {'; '.join(lines)}", file=sys.stderr)
        return 2
    except (ValueError, OSError) as error:
        _traceback_if_asked(args["verbose"])
        # the data's complaint about a corpus option (a column the data lacks) under the option's name
        said = _as_option(f"corpus.{error.argument}: {error}", None if base is None else set(options)) \
            if isinstance(error, CorpusArgumentError) else error
        print(f"layertune: error: {said}", file=sys.stderr)
        return 2
    print(json.dumps(trained.result.summary(), indent=2))
    return 0


def _read_spec(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"--spec {path}: cannot read it as a CellSpec's JSON ({error})") from None


def _traceback_if_asked(verbose: bool) -> None:
    """The error's traceback on stderr, with --verbose or $LAYERTUNE_VERBOSE=1 (else its one line is enough)."""
    if verbose or os.environ.get("LAYERTUNE_VERBOSE", "") not in ("", "0"):
        traceback.print_exc()


if __name__ == "__main__":
    sys.exit(main())
