"""The CoNLL column format for token classification: a ``word ... TAG`` line per token, blank lines between sentences.

CoNLL-2003 lines are ``word POS chunk NER``; ``-DOCSTART-`` lines mark articles and are not sentences. Its NER tags
are IOB1 (``B-`` only where an entity directly follows one of the same type); models train on IOB2 (``B-`` starts
every entity), which marks the same spans, so tags are converted on reading.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import datasets

DOCSTART = "-DOCSTART-"
OUTSIDE = "O"
_IOB_TAG = re.compile(r"^(O|[BI]-\S+)$")
# CoNLL column files: one token per line, blank line between sentences. A .txt file counts when it has columns.
CONLL_SUFFIXES = (".conll", ".iob", ".bio")


@dataclass(frozen=True)
class Sentence:
    """One sentence of a CoNLL file: its words, their tags, and the line number of its first word."""

    words: tuple[str, ...]
    tags: tuple[str, ...]
    first_line: int


def is_conll_file(path: Path) -> bool:
    """A CoNLL column file: a .conll/.iob/.bio suffix, or a .txt file whose first line has columns (word ... tag)."""
    if path.suffix.lower() in CONLL_SUFFIXES:
        return True
    if path.suffix.lower() != ".txt":
        return False
    with open(path, encoding="utf-8", errors="replace") as lines:
        first = next((line for line in lines if line.strip()), "")
    return len(first.split()) >= 2


def read_conll(path: str | os.PathLike, num_columns: int | None = None) -> list[Sentence]:
    """Sentences of a CoNLL file, tags as written (the last column).

    Every token line must have ``num_columns`` whitespace-separated columns (default: as many as the file's first
    token line). Raises ValueError naming file and line for a line with another count, and for a file without any
    sentence.
    """
    path = Path(path)
    sentences, words, tags, first_line = [], [], [], 0
    with open(path, encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            columns = line.split()
            if not columns or columns[0] == DOCSTART:
                if words:
                    sentences.append(Sentence(tuple(words), tuple(tags), first_line))
                words, tags = [], []
                continue
            num_columns = num_columns or len(columns)
            if len(columns) != num_columns:
                raise ValueError(f"{path}:{number}: expected {num_columns} space-separated columns "
                                 f"(word ... tag), found {len(columns)}: {line.strip()!r}")
            first_line = first_line if words else number
            words.append(columns[0])
            tags.append(columns[-1])
    if words:
        sentences.append(Sentence(tuple(words), tuple(tags), first_line))
    if not sentences:
        raise ValueError(f"{path} holds no sentences: an empty split cannot be trained or scored.")
    return sentences


def iob1_to_iob2(tags: list[str] | tuple[str, ...]) -> list[str]:
    """``I-X`` that starts an entity (after ``O``, another type, or at the start) becomes ``B-X``.

    IOB2 input comes out unchanged, so the conversion is safe whichever of the two schemes a file uses.
    """
    converted, previous_type = [], None
    for tag in tags:
        prefix, _, entity_type = tag.partition("-")
        if prefix == "I" and entity_type != previous_type:
            tag = f"B-{entity_type}"
        converted.append(tag)
        previous_type = entity_type if prefix in ("B", "I") else None
    return converted


def iob2_label_names(entity_types: list[str] | tuple[str, ...]) -> tuple[str, ...]:
    """``O`` then ``B-T``, ``I-T`` for each type, in the order given."""
    return (OUTSIDE, *(f"{prefix}-{t}" for t in entity_types for prefix in ("B", "I")))


def entity_types_of(sentences: list[Sentence], path: str | os.PathLike) -> list[str]:
    """The entity types used in ``sentences``, sorted; a tag that is not ``O``, ``B-T`` or ``I-T`` is an error."""
    types = set()
    for sentence in sentences:
        for offset, tag in enumerate(sentence.tags):
            if not _IOB_TAG.match(tag):
                raise ValueError(f"{path}:{sentence.first_line + offset}: tag {tag!r} is not IOB "
                                 f"(O, B-TYPE or I-TYPE).")
            types.update([tag[2:]] if tag != OUTSIDE else [])
    return sorted(types)


def conll_dataset(path: str | os.PathLike, label_names: tuple[str, ...] | list[str], *,
                  num_columns: int | None = None) -> datasets.Dataset:
    """A split as a Dataset of ``tokens`` (words) and ``tags`` (IOB2 ids into ``label_names``).

    A tag outside ``label_names`` (after IOB1 → IOB2 conversion) is an error naming file and line.
    """
    import datasets

    sentences = read_conll(path, num_columns)
    ids = {name: i for i, name in enumerate(label_names)}
    tags = []
    for sentence in sentences:
        converted = iob1_to_iob2(sentence.tags)
        for offset, (tag, original) in enumerate(zip(converted, sentence.tags)):
            if tag not in ids:
                raise ValueError(f"{path}:{sentence.first_line + offset}: tag {original!r} is not in the label "
                                 f"set {list(label_names)}.")
        tags.append([ids[tag] for tag in converted])
    return datasets.Dataset.from_dict({"tokens": [list(s.words) for s in sentences], "tags": tags},
                                      features=token_features(label_names))


def token_features(label_names: tuple[str, ...] | list[str]) -> datasets.Features:
    """The columns of every token-classification split: ``tokens`` (strings) and ``tags`` (class ids)."""
    import datasets

    return datasets.Features({"tokens": datasets.List(datasets.Value("string")),
                              "tags": datasets.List(datasets.ClassLabel(names=list(label_names)))})
