"""Error messages that name the bad value and the valid choices."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


def choices_hint(value: object, choices: Iterable[object]) -> str:
    """'Did you mean ...?' plus the full list of valid choices, for an error message."""
    names = [str(c) for c in choices]
    close = difflib.get_close_matches(str(value), names, n=3, cutoff=0.5)
    hint = f" Did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
    return f"{hint} Valid choices: {', '.join(names)}."


def unknown_choice(kind: str, value: object, choices: Iterable[object]) -> ValueError:
    """A ValueError for an unknown name, e.g. ``unknown_choice("task", "cols", TASKS)``."""
    return ValueError(f"Unknown {kind} {value!r}.{choices_hint(value, choices)}")
