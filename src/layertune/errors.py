"""Error messages that name the bad value and the valid choices."""

from __future__ import annotations

import collections.abc
import difflib
import types
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Annotated, Any, Literal, Union, get_args, get_origin

if TYPE_CHECKING:
    from pydantic import ValidationError


def choices_hint(value: object, choices: Iterable[object]) -> str:
    """'Did you mean ...?' plus the full list of valid choices, for an error message."""
    names = [str(c) for c in choices]
    close = difflib.get_close_matches(str(value), names, n=3, cutoff=0.5)
    hint = f" Did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
    return f"{hint} Valid choices: {', '.join(names)}."


class CorpusArgumentError(ValueError):
    """An argument of `layertune.corpora.load_corpus` does not fit the data (a column it names is missing, labels
    do not fit the task type, ...): ``argument`` names it, so that a study can name its own key for it."""

    def __init__(self, argument: str, message: str) -> None:
        super().__init__(message)
        self.argument = argument


def unknown_choice(kind: str, value: object, choices: Iterable[object]) -> ValueError:
    """A ValueError for an unknown name, e.g. ``unknown_choice("task", "cols", TASKS)``."""
    return ValueError(f"Unknown {kind} {value!r}.{choices_hint(value, choices)}")


def describe_validation_error(error: ValidationError, prefix: tuple = (), schema: Any = None) -> list[str]:
    """One line per bad key of a pydantic error, ``dotted.key: what is wrong (got value)``.

    Pydantic reports each member of a union (``float | list[float]``, a tuning method's ``lora``) separately,
    naming the member in the key; those names are dropped (`_as_written`) and the members' complaints joined with
    "or". ``schema``: what was validated (a model, or an annotation such as a tagged union), which tells where a
    location names a union's member and, where an unknown key was found, the valid keys for a "did you mean"
    (`keys_at`).
    """
    problems: dict[str, list[str]] = {}
    for item in error.errors():
        location = (*prefix, *_as_written(item["loc"], schema))
        key = dotted_key(location)
        message = item["msg"].removeprefix("Value error, ")
        if item["type"] == "extra_forbidden":
            keys = keys_at(schema, item["loc"][:-1]) if schema else []
            message = "unknown key." + (choices_hint(location[-1], keys) if keys else "")
        elif item["type"] == "missing":
            message = "required key is missing"
        elif key and not (item["type"] == "value_error" and isinstance(item["input"], Mapping)):
            # A section's own check (a model validator) names what is wrong in it; the whole section, repeated
            # after it, would only bury the message.
            message = f"{message} (got {item['input']!r})"
        messages = problems.setdefault(key, [])
        if message not in messages:
            messages.append(message)
    return [f"{key}: {' or '.join(messages)}" if key else " ".join(messages) for key, messages in problems.items()]


def _as_written(location: Iterable, schema: Any) -> list:
    """A pydantic error's location as the user wrote it: without the parts that name which member of a union
    pydantic tried (``str``, ``list[float]``, a tagged member's tag). With ``schema``, a part is such a name only
    where ``schema`` has a union, so that a key the user chose that equals a tag (a methods-study entry named
    ``lora``) stays; where there is no schema to follow, plain type names alone are dropped."""
    written, annotation = [], schema
    for part in location:
        inner = _inner(annotation)
        if not (_names_member(inner, part) if _is_union(inner) else annotation is None and _is_type_name(part)):
            written.append(part)
        annotation = _step(annotation, part) if annotation is not None else None
    return written


def keys_at(schema: Any, location: Iterable) -> list[str]:
    """The keys valid at ``location`` in ``schema``: a pydantic error's location as it reports it, stepping into a
    mapping's values by key, a list's items by index, and a union's member by its tag (a discriminated union's
    value, such as a tuning method's name) or its class name; empty where no model is found."""
    annotation: Any = schema
    for part in location:
        annotation = _step(annotation, part)
        if annotation is None:
            return []
    annotation = _inner(annotation)
    models = [annotation] if _is_model(annotation) else [m for m in map(_inner, get_args(annotation)) if _is_model(m)]
    return list(models[0].model_fields) if models else []


def _step(annotation: Any, part: Any) -> Any:
    """What ``part`` of a location leads to inside ``annotation``; None where it leads nowhere."""
    annotation = _inner(annotation)
    arguments = get_args(annotation)
    if _is_model(annotation):
        field = annotation.model_fields.get(part) if isinstance(part, str) else None
        return field.annotation if field is not None else None
    if get_origin(annotation) in (dict, collections.abc.Mapping) and arguments:
        return arguments[-1]
    if get_origin(annotation) in (list, collections.abc.Sequence) and arguments and isinstance(part, int):
        return arguments[0]
    if get_origin(annotation) is tuple and arguments and isinstance(part, int):  # tuple[A, B] or tuple[A, ...]
        return arguments[0] if arguments[-1] is Ellipsis else arguments[part] if part < len(arguments) else None
    if _is_union(annotation):
        members = [member for member in arguments if member is not type(None)]
        tagged = [_inner(member) for member in members if part in _tags(member)]
        if tagged:
            return tagged[0]
        found = [step for member in members if (step := _step(member, part)) is not None]
        return found[0] if found else annotation  # else ``part`` names a plain member (str, list[float]): stay
    return None


def _tags(member: Any) -> set:
    """The names pydantic gives a union's ``member`` in an error's location: its ``Tag`` (a callable
    discriminator's), the values of its literal fields (a discriminated union's tag) and its class name."""
    tags = {getattr(meta, "tag", None) for meta in get_args(member)[1:]} if get_origin(member) is Annotated else set()
    member = _inner(member)
    if _is_model(member):
        tags |= {member.__name__} | {value for field in member.model_fields.values()
                                     if get_origin(field.annotation) is Literal for value in get_args(field.annotation)}
    return tags - {None}


def _inner(annotation: Any) -> Any:
    """An annotation without ``Annotated``'s metadata."""
    return get_args(annotation)[0] if get_origin(annotation) is Annotated else annotation


def _is_model(annotation: Any) -> bool:
    from pydantic import BaseModel

    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def _is_union(annotation: Any) -> bool:
    return get_origin(annotation) in (Union, types.UnionType)


def _names_member(union: Any, part: Any) -> bool:
    """Whether a location's ``part``, met at ``union``, is pydantic's name for one of its members."""
    return _is_type_name(part) or any(part in _tags(member) for member in get_args(union))


def _is_type_name(part: Any) -> bool:
    """Whether ``part`` is how pydantic names a plain member of a union in a location (``str``, ``list[float]``,
    ``literal['a','b']``, a validator's ``function-after[...]``)."""
    return isinstance(part, str) and (part in ("str", "int", "float", "bool", "list[float]", "list[int]")
                                      or part.startswith(("literal[", "function-")))


def dotted_key(location: Iterable) -> str:
    """``("studies", "ner", "seeds", 1)`` → ``studies.ner.seeds[1]``."""
    text = ""
    for part in location:
        text += f"[{part}]" if isinstance(part, int) and text else (f".{part}" if text else str(part))
    return text
