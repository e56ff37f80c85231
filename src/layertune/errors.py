"""Error messages that name the bad value and the valid choices."""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

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


def describe_validation_error(error: ValidationError, prefix: tuple = (),
                              known_keys: Callable[[tuple], Iterable[str]] | None = None,
                              union_tags: Iterable[str] = ()) -> list[str]:
    """One line per bad key of a pydantic error, ``dotted.key: what is wrong (got value)``.

    Pydantic reports each member of a union (``float | list[float]``) separately, naming the member in the key;
    those names (and ``union_tags``, the tags of discriminated unions) are dropped and the members' complaints
    joined with "or". ``known_keys(location)`` lists the keys valid where an unknown one was found, for a "did you
    mean".
    """
    problems: dict[str, list[str]] = {}
    for item in error.errors():
        location = (*prefix, *(part for part in item["loc"] if not _is_union_member(part, union_tags)))
        key = dotted_key(location)
        message = item["msg"].removeprefix("Value error, ")
        if item["type"] == "extra_forbidden":
            message = "unknown key." + (choices_hint(location[-1], known_keys(location[:-1])) if known_keys else "")
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


def _is_union_member(part: Any, tags: Iterable[str]) -> bool:
    return isinstance(part, str) and (part in ("str", "int", "float", "bool", "list[float]", "list[int]")
                                      or part.startswith(("literal[", "function-")) or part in tags)


def dotted_key(location: Iterable) -> str:
    """``("studies", "ner", "seeds", 1)`` → ``studies.ner.seeds[1]``."""
    text = ""
    for part in location:
        text += f"[{part}]" if isinstance(part, int) and text else (f".{part}" if text else str(part))
    return text
