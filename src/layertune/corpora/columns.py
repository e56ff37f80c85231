"""From read splits to a task's columns: the text and label columns inferred (or checked) for data outside the
registry, labels normalised (whitespace, case, classes of train) and encoded as class ids, token-classification
columns found and their tags made IOB2 ids, and splits conformed to a registry task's columns and labels.

The result is a `Loaded`: the splits plus what the task is, before a dev split is carved and sizes are sampled
(`layertune.corpora.sampling`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import datasets
import numpy as np

from layertune.corpora.conll import (
    conll_dataset, entity_types_of, iob1_to_iob2, iob2_label_names, read_conll, token_features,
)
from layertune.corpora.registry import TOKEN_COLUMN, TaskSpec
from layertune.corpus import TaskType
from layertune.errors import CorpusArgumentError

# Tried in order when text_columns is not given; the first set fully present wins.
TEXT_COLUMN_GUESSES = (
    ("sentence1", "sentence2"), ("premise", "hypothesis"), ("question1", "question2"), ("question", "sentence"),
    ("text",), ("sentence",), ("review",), ("content",), ("document",),
)
LABEL_COLUMN_GUESSES = ("label", "labels", "score", "target", "class")
TAG_COLUMN_GUESSES = ("tags", "ner_tags", "labels", "label")


@dataclass
class Loaded:
    """Normalised splits plus what the task is, before carving and subsampling."""

    name: str
    splits: dict[str, datasets.Dataset]
    text_columns: tuple[str, ...]
    task_type: TaskType
    label_names: tuple[str, ...]
    metrics: tuple[str, ...]
    main_metric: str
    max_length: int | None = None
    balanced: bool = False
    notes: list[str] = field(default_factory=list)
    sources: dict[str, str] = field(default_factory=dict)  # split → the file it came from, for errors

    @classmethod
    def from_spec(cls, spec: TaskSpec, splits: dict[str, datasets.Dataset], source: str,
                  official: bool = True, sources: dict[str, str] | None = None) -> Loaded:
        """``official``: the splits are the task's own, so its notes about them apply."""
        notes = [source, *spec.notes] if official else [source]
        return cls(spec.name, splits, spec.text_columns, spec.task_type, spec.label_names, spec.metrics,
                   spec.main_metric, spec.max_length, spec.balanced, notes, sources or {})

    def where(self, split: str) -> str:
        """The file a split came from, or a description of it: what an error about its data names."""
        return self.sources.get(split) or f"the {split} split of {self.name!r}"


# ------------------------------------------------------------------------------------------- registry tasks


def conform(ds: datasets.Dataset, spec: TaskSpec, where: str = "") -> datasets.Dataset:
    """Keep the spec's text columns and label, with labels mapped to the spec's label ids."""
    where = where or f"{spec.hub_path} ({spec.hub_config})"
    if spec.task_type == "token_classification":
        return _conform_tokens(ds, spec.label_names, where)
    _require_columns(ds, [*spec.text_columns, "label"], where)
    ds = ds.select_columns([*spec.text_columns, "label"])
    if spec.task_type == "classification" and not isinstance(ds.features["label"], datasets.ClassLabel):
        ds = _encode_labels(ds, spec.label_names, where)
    return ds if ds.features == spec.features() else ds.cast(spec.features())


def _require_columns(ds: datasets.Dataset, wanted, where: str, argument: str | None = None) -> None:
    missing = [c for c in wanted if c not in ds.column_names]
    if missing:
        message = f"{where} has no column {', '.join(map(repr, missing))}; its columns are {', '.join(ds.column_names)}."
        raise CorpusArgumentError(argument, message) if argument else ValueError(message)


def _encode_labels(ds: datasets.Dataset, names: tuple[str, ...], where: str) -> datasets.Dataset:
    """String labels by name (surrounding whitespace ignored), integer labels by index (both checked), to ClassLabel
    ids."""
    ds = _strip_labels(ds)
    values = set(ds.unique("label"))
    ints = all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in values)
    allowed = set(range(len(names))) if ints else set(names)
    if not values <= allowed:
        bad = sorted(map(str, values - allowed))[:5]
        raise ValueError(f"{where}: labels {bad} are not among {sorted(map(str, allowed))}.")
    if ints:
        return ds.cast_column("label", datasets.ClassLabel(names=list(names)))
    as_text = ds.cast_column("label", datasets.Value("string"))
    return as_text.cast_column("label", datasets.ClassLabel(names=list(names)))


# ------------------------------------------------------------------------------- datasets outside the registry


def generic(name: str, splits: dict[str, datasets.Dataset], text_columns, label_column: str,
            notes: list[str], sources: dict[str, str] | None = None, task_type: TaskType | None = None,
            label_names: tuple[str, ...] | None = None) -> Loaded:
    """Data outside the registry: its text and label columns found (or checked), its labels normalised. The task
    type follows the labels (strings or integers: classification; decimals: regression) unless ``task_type`` is
    given, and ``label_names`` give the classes' order (for integer labels, the name of each id)."""
    token_columns = None if task_type in ("classification", "regression") else _token_columns(
        splits["train"], text_columns, label_column, name)
    if token_columns is not None:
        return _generic_tokens(name, splits, *token_columns, notes)
    if task_type == "token_classification":
        raise CorpusArgumentError("task_type", f"task_type 'token_classification' needs a column of word lists "
                                  f"('{TOKEN_COLUMN}', or text_columns=) and a list-valued tags column; "
                                  f"{name!r} has columns {', '.join(splits['train'].column_names)}.")
    train = splits["train"]
    where = {s: (sources or {}).get(s) or f"the {s} split of {name!r}" for s in splits}
    label_column = _find_label_column(train, label_column, where["train"])
    text_columns = _find_text_columns(train, text_columns, label_column, where["train"])
    _check_one_value_per_row(splits, text_columns, label_column, where)
    splits, notes = _drop_unlabelled_test(splits, label_column, notes)
    for split, ds in splits.items():
        _require_columns(ds, text_columns, where[split], "text_columns")
        _require_columns(ds, [label_column], where[split], "label_column")
    splits = {s: ds.select_columns([*text_columns, label_column]) for s, ds in splits.items()}
    _check_complete(splits, [*text_columns, label_column], where)
    if label_column != "label":
        splits = {s: ds.rename_column(label_column, "label") for s, ds in splits.items()}
    splits, task_type, label_names, note = _normalize_labels(splits, name, where, task_type, label_names)
    if task_type == "regression":
        metrics = ("spearmanr", "pearsonr")
    else:
        metrics = ("accuracy", "f1") if len(label_names) == 2 else ("accuracy",)
    return Loaded(name, splits, text_columns, task_type, label_names, metrics, metrics[0], notes=[*notes, note],
                  sources={s: w for s, w in (sources or {}).items() if s in splits})


def _check_one_value_per_row(splits: dict[str, datasets.Dataset], text_columns: tuple[str, ...], label_column: str,
                             where: dict[str, str]) -> None:
    """Text and label columns hold one value per row. A list-valued text column would be taken for a sentence
    pair by the tokenizer, and a list-valued label fails deep inside Arrow: both are refused here, by name."""
    for split, ds in splits.items():
        for column in (*text_columns, label_column):
            feature = ds.features.get(column)
            if feature is None or isinstance(feature, (datasets.Value, datasets.ClassLabel)):
                continue
            role, hint = (("label", "for token classification, give the words as a list column 'tokens' (or "
                           "text_columns=) and one tag per word in a list column (label_column=)")
                          if column == label_column else
                          ("text", "sentence pairs are two columns: text_columns=('first', 'second')"))
            raise ValueError(f"{where[split]}: column {column!r} has type {ds.data.schema.field(column).type}, not "
                             f"one {role} per row; {hint}. Choose other columns, or flatten this one (one value per "
                             "row).")


def _check_complete(splits: dict[str, datasets.Dataset], columns: list[str], where: dict[str, str]) -> None:
    """Every example needs its text(s) and its label: a blank is an error naming the file, column and rows."""
    for split, ds in splits.items():
        for column in columns:
            blank = [row for row, value in enumerate(ds[column], start=1)
                     if value is None or (isinstance(value, float) and np.isnan(value))
                     or (isinstance(value, str) and not value.strip())]
            if blank:
                shown = ", ".join(map(str, blank[:5])) + (f" and {len(blank) - 5} more" if len(blank) > 5 else "")
                raise ValueError(f"{where[split]}: column {column!r} is blank or missing in {len(blank)} of {len(ds)} "
                                 f"rows ({shown}; data rows counted from 1). Fill them in, or drop those rows.")


def _find_label_column(ds: datasets.Dataset, label_column: str, where: str) -> str:
    if label_column in ds.column_names:
        return label_column
    guesses = [c for c in LABEL_COLUMN_GUESSES if c in ds.column_names] if label_column == "label" else []
    if len(guesses) == 1:
        return guesses[0]
    raise CorpusArgumentError("label_column", f"column {label_column!r} not in {where}; columns: "
                              f"{', '.join(ds.column_names)}.")


def _find_text_columns(ds: datasets.Dataset, text_columns, label_column: str, where: str) -> tuple[str, ...]:
    columns = ds.column_names
    if text_columns is not None:
        text_columns = (text_columns,) if isinstance(text_columns, str) else tuple(text_columns)
        _require_columns(ds, text_columns, where, "text_columns")
        if label_column in text_columns:
            raise CorpusArgumentError("text_columns", f"column {label_column!r} of {where} is given as both text "
                                      "and label.")
        return text_columns
    for guess in TEXT_COLUMN_GUESSES:
        if all(c in columns for c in guess):
            return guess
    strings = [c for c, f in ds.features.items()
               if c != label_column and isinstance(f, datasets.Value) and f.dtype in ("string", "large_string")]
    if len(strings) == 1:
        return (strings[0],)
    described = ", ".join(f"{c} ({getattr(f, 'dtype', type(f).__name__)})" for c, f in ds.features.items())
    raise CorpusArgumentError("text_columns", f"Cannot guess the text column(s) of {where}; its columns are "
                              f"{described}. Pass text_columns=('a',) or ('a', 'b') for sentence pairs.")


def _drop_unlabelled_test(splits: dict, label_column: str, notes: list[str]) -> tuple[dict, list[str]]:
    """Hub test splits often hide their labels (-1 or null); such a split cannot be scored."""
    test = splits.get("test")
    if test is None or label_column not in test.column_names:
        return splits, notes
    if set(test.unique(label_column)) <= {-1, None}:
        splits = {s: ds for s, ds in splits.items() if s != "test"}
        notes = [*notes, "The test split has no labels and was dropped."]
    return splits, notes


# ------------------------------------------------------------------------------------------------------- labels


def _normalize_labels(splits: dict[str, datasets.Dataset], name: str, where: dict[str, str],
                      task_type: TaskType | None = None, label_names: tuple[str, ...] | None = None,
                      ) -> tuple[dict, TaskType, tuple[str, ...], str]:
    """Classification (ClassLabel ids) or regression (float32) labels, and a note saying how the task type was
    decided. Plain labels: the classes are those of the train split, stripped of surrounding whitespace, in
    ``label_names`` order when given (integer labels then are indices into it), else sorted; a dev/test label outside
    them, or two spellings of one label differing only in case, is an error naming the files."""
    feature = splits["train"].features["label"]
    is_class = isinstance(feature, datasets.ClassLabel)
    dtype = getattr(feature, "dtype", "class label")
    decimals = not is_class and dtype.startswith("float")
    if task_type == "regression" or (task_type is None and decimals):
        if is_class or not dtype.startswith(("float", "int", "uint")):
            raise CorpusArgumentError("task_type", f"{where['train']}: task_type 'regression' needs numbers as labels, "
                                      f"but column 'label' holds {dtype} values.")
        if label_names:
            raise CorpusArgumentError("label_names", f"label_names {list(label_names)} name classes, but {name!r} is "
                                      "a regression task (its labels are scores); remove label_names.")
        how = "given" if task_type else "inferred: the labels are decimal numbers; task_type: classification " \
                                          "would treat them as classes"
        return ({s: ds.cast_column("label", datasets.Value("float32")) for s, ds in splits.items()}, "regression",
                (), f"Task type regression ({how}).")
    if is_class:  # names kept in their own order (unless label_names reorder them)
        splits = {s: _as_text_labels(ds) for s, ds in splits.items()}
    elif decimals:  # classes written as 1.0, 2.0: the same classes as 1, 2
        splits = {s: ds.map(lambda b: {"label": [None if v is None else f"{v:g}" for v in b["label"]]}, batched=True,
                            features=datasets.Features({**ds.features, "label": datasets.Value("string")}),
                            keep_in_memory=True) for s, ds in splits.items()}
    elif label_names and dtype.startswith(("int", "uint")):  # integer labels with names: label i is label_names[i]
        splits = {s: _name_integer_labels(ds, label_names, where[s]) for s, ds in splits.items()}
    splits = {s: _strip_labels(ds) for s, ds in splits.items()}
    found = {s: set(ds.unique("label")) - {None} for s, ds in splits.items()}
    _check_label_case(found, where)
    names = tuple(str(v) for v in sorted(found["train"], key=_label_sort_key))
    if len(names) < 2:
        raise ValueError(f"{where['train']}: every label is {names[0] if names else None!r}. A classifier needs at "
                         "least two classes (and a score to regress on needs numbers with decimals, e.g. 3.0).")
    if label_names:
        if len(set(label_names)) != len(label_names):
            raise CorpusArgumentError("label_names", f"label_names {list(label_names)} repeat a name.")
        if extra := [n for n in names if n not in label_names]:
            raise CorpusArgumentError("label_names", f"{where['train']}: label(s) {', '.join(map(repr, extra))} are "
                                      f"not in label_names {list(label_names)}.")
        if absent := [n for n in label_names if n not in names]:
            raise CorpusArgumentError("label_names", f"{where['train']}: label_names {', '.join(map(repr, absent))} "
                                      f"never occur in the train data, whose labels are {', '.join(map(repr, names))}."
                                      " A class the model never trained on cannot be predicted.")
        names = tuple(label_names)
    elif is_class:
        names = tuple(feature.names)
    for split, labels in found.items():
        if unseen := sorted({str(v) for v in labels} - set(names)):
            raise ValueError(
                f"{where[split]}: label(s) {', '.join(map(repr, unseen))} never occur in the train data "
                f"({where['train']}), whose labels are {', '.join(map(repr, names))}. A class the model never "
                "trained on cannot be predicted: correct the label, add training examples of it, or drop those rows.")
    as_text = {s: ds.cast_column("label", datasets.Value("string")) for s, ds in splits.items()}
    encoded = {s: _encode_labels(ds, names, where[s]) for s, ds in as_text.items()}
    kind = "named classes" if is_class else "text" if "string" in dtype else "whole numbers"
    how = "given" if task_type else f"inferred: the labels are {kind}"
    return encoded, "classification", names, f"Task type classification ({how}); {len(names)} classes: " \
                                             f"{', '.join(names)}."


def _as_text_labels(ds: datasets.Dataset) -> datasets.Dataset:
    feature = ds.features["label"]
    if not isinstance(feature, datasets.ClassLabel):
        return ds
    return ds.map(lambda b: {"label": feature.int2str(b["label"])}, batched=True, keep_in_memory=True,
                  features=datasets.Features({**ds.features, "label": datasets.Value("string")}))


def _name_integer_labels(ds: datasets.Dataset, label_names: tuple[str, ...], where: str) -> datasets.Dataset:
    bad = sorted(v for v in ds.unique("label") if v is not None and not 0 <= v < len(label_names))
    if bad:
        raise CorpusArgumentError("label_names", f"{where}: integer labels {bad[:5]} have no name: label_names "
                                  f"{list(label_names)} name the ids 0 to {len(label_names) - 1}.")
    return ds.map(lambda b: {"label": [None if v is None else label_names[v] for v in b["label"]]}, batched=True,
                  keep_in_memory=True, features=datasets.Features({**ds.features, "label": datasets.Value("string")}))


def _strip_labels(ds: datasets.Dataset) -> datasets.Dataset:
    """String labels without surrounding whitespace: ``"pos "`` is ``"pos"``, not a class of its own."""
    feature = ds.features["label"]
    if not (isinstance(feature, datasets.Value) and feature.dtype in ("string", "large_string")):
        return ds
    if all(v is None or v == v.strip() for v in ds.unique("label")):
        return ds
    return ds.map(lambda batch: {"label": [v if v is None else v.strip() for v in batch["label"]]}, batched=True,
                  keep_in_memory=True)


def _check_label_case(found: dict[str, set], where: dict[str, str]) -> None:
    """Labels that differ only in case (``pos`` / ``Pos``) are refused rather than merged: case can be meaningful,
    and which spelling is right is the data owner's call."""
    spellings: dict[str, dict[str, list[str]]] = {}
    for split, labels in found.items():
        for label in labels:
            if isinstance(label, str):
                spellings.setdefault(label.casefold(), {}).setdefault(label, []).append(split)
    for variants in spellings.values():
        if len(variants) > 1:
            shown = " and ".join(f"{label!r} (in {', '.join(where[s] for s in splits)})"
                                 for label, splits in sorted(variants.items()))
            raise ValueError(f"Labels {shown} differ only in case, so they would be separate classes. layertune does "
                             "not merge them (case can matter): spell each class the same way in every file.")


def _label_sort_key(value) -> tuple:
    # Numbers in numeric order (2 before 10), then strings alphabetically.
    return (0, value, "") if isinstance(value, (int, float, np.number)) else (1, 0, str(value))


def check_train_classes(train: datasets.Dataset, label_names: tuple[str, ...], where: str) -> None:
    present = sorted(set(train.unique("label")))
    if len(present) < 2:
        only = ", ".join(repr(label_names[i]) for i in present) or "none"
        raise ValueError(f"{where}: every training example has the same class ({only} of {', '.join(label_names)}). "
                         "A classifier needs examples of at least two classes to learn anything.")


# ------------------------------------------------------------------------------------------ token classification


def generic_conll(name: str, files: Mapping[str, Path], source: str) -> Loaded:
    """CoNLL column files with their own tag set: the entity types found in any split, tags as IOB2."""
    types = sorted(set().union(*(entity_types_of(read_conll(path), path) for path in files.values())))
    label_names = iob2_label_names(types)
    splits = {split: conll_dataset(path, label_names) for split, path in files.items()}
    return _token_loaded(name, splits, label_names, [source])


def _token_loaded(name: str, splits: dict[str, datasets.Dataset], label_names: tuple[str, ...],
                  notes: list[str]) -> Loaded:
    return Loaded(name, splits, (TOKEN_COLUMN,), "token_classification", label_names, ("seqeval",), "f1",
                  notes=notes)


def _is_list_of(feature, kinds: tuple[type, ...]) -> bool:
    return isinstance(feature, (datasets.List, datasets.Sequence)) and isinstance(feature.feature, kinds)


def _token_columns(ds: datasets.Dataset, text_columns, label_column: str, name: str) -> tuple[str, str] | None:
    """(words column, tags column) when ``ds`` is token classification data, else None."""
    if text_columns is not None:
        text_columns = (text_columns,) if isinstance(text_columns, str) else tuple(text_columns)
    words = text_columns[0] if text_columns and len(text_columns) == 1 else TOKEN_COLUMN
    if words not in ds.column_names or not _is_list_of(ds.features[words], (datasets.Value,)):
        return None
    guesses = (label_column,) if label_column != "label" else TAG_COLUMN_GUESSES
    for column in guesses:
        if column in ds.column_names and _is_list_of(ds.features[column], (datasets.Value, datasets.ClassLabel)):
            return words, column
    raise ValueError(f"{name!r} has a word-list column {words!r} but no list-valued tags column "
                     f"({', '.join(guesses)}); its columns are {', '.join(ds.column_names)}. Pass label_column=.")


def _generic_tokens(name: str, splits: dict[str, datasets.Dataset], words: str, tags: str,
                    notes: list[str]) -> Loaded:
    """Token classification from a dataset's own columns: class-labelled tags kept, string tags made IOB2."""
    for split, ds in splits.items():
        _require_columns(ds, [words, tags], f"{split} split of {name!r}")
    splits = {s: ds.select_columns([words, tags]).rename_columns({words: TOKEN_COLUMN, tags: "tags"})
              for s, ds in splits.items()}
    feature = splits["train"].features["tags"].feature
    if isinstance(feature, datasets.ClassLabel):
        label_names = tuple(feature.names)
    elif feature.dtype in ("string", "large_string"):
        found = set().union(*(set().union(*map(set, ds["tags"])) for ds in splits.values()))
        label_names = iob2_label_names(sorted({t[2:] for t in found if t != "O"}))
        if not found <= set(label_names):
            bad = sorted(found - set(label_names))[:5]
            raise ValueError(f"{name!r}: tags {bad} are not IOB (O, B-TYPE or I-TYPE).")
    else:
        raise ValueError(f"{name!r}: the tags of column {tags!r} are {feature.dtype} without names; give them as "
                         f"strings or as a ClassLabel list so they can be scored as entities.")
    splits = {s: _conform_tokens(ds, label_names, f"{s} split of {name!r}") for s, ds in splits.items()}
    return _token_loaded(name, splits, label_names, notes)


def _conform_tokens(ds: datasets.Dataset, label_names: tuple[str, ...], where: str) -> datasets.Dataset:
    """``tokens`` and ``tags`` (ClassLabel ids in ``label_names`` order); string tags converted IOB1 → IOB2."""
    _require_columns(ds, [TOKEN_COLUMN, "tags"], where)
    ds = ds.select_columns([TOKEN_COLUMN, "tags"])
    feature = ds.features["tags"].feature
    if isinstance(feature, datasets.ClassLabel):
        if tuple(feature.names) != tuple(label_names):
            ids = {n: i for i, n in enumerate(label_names)}
            if unknown := sorted(set(feature.names) - set(ids)):
                raise ValueError(f"{where}: tags {unknown} are not in the label set {list(label_names)}.")
            remap = [ids[n] for n in feature.names]
            return ds.map(lambda row: {"tags": [remap[t] for t in row["tags"]]}, features=token_features(label_names))
        return ds if ds.features == token_features(label_names) else ds.cast(token_features(label_names))
    if feature.dtype in ("string", "large_string"):
        ids = {n: i for i, n in enumerate(label_names)}

        def encode(row):
            converted = iob1_to_iob2(row["tags"])
            if unknown := sorted(set(converted) - set(ids)):
                raise ValueError(f"{where}: tags {unknown} are not in the label set {list(label_names)}.")
            return {"tags": [ids[t] for t in converted]}

        return ds.map(encode, features=token_features(label_names))
    values = set().union(*map(set, ds["tags"]))
    if not values <= set(range(len(label_names))):
        raise ValueError(f"{where}: tag ids {sorted(values - set(range(len(label_names))))[:5]} are outside "
                         f"0..{len(label_names) - 1} ({list(label_names)}).")
    return ds.cast(token_features(label_names))
