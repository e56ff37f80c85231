"""Reading data files into `datasets.Dataset`s: official GLUE TSVs (and recognising their layout), CSV/TSV/JSON(L)/
parquet tables (checked to be UTF-8 text with rows first), and a registry task's files in its own layout.

CoNLL column files are read by `layertune.corpora.conll`.
"""

from __future__ import annotations

import csv
from collections.abc import Mapping
from pathlib import Path

import datasets
import pyarrow.parquet as pq
from datasets.table import InMemoryTable

from layertune.corpora.columns import conform
from layertune.corpora.conll import conll_dataset, is_conll_file
from layertune.corpora.registry import TASKS, TaskSpec
from layertune.corpora.sources import FILE_TYPES


def read_spec_file(path: Path, spec: TaskSpec) -> datasets.Dataset:
    if spec.task_type == "token_classification" and path.suffix.lower() not in FILE_TYPES:
        return conll_dataset(path, spec.label_names, num_columns=spec.conll_columns)
    if is_conll_file(path):
        raise ValueError(f"{path} is a CoNLL column file, but {spec.name!r} is a {spec.task_type} task.")
    if spec.tsv_layout is not None and path.suffix.lower() == ".tsv":
        return _read_glue_tsv(path, spec)
    if path.suffix.lower() == ".parquet":
        # Read into memory so mirror data is not copied into the datasets cache.
        table = pq.read_table(path)
        return conform(datasets.Dataset(InMemoryTable(table)), spec, str(path))
    return conform(read_table_file(path), spec, str(path))


# ------------------------------------------------------------------------------------------------- GLUE TSVs


def detect_layout(files: Mapping[str, Path]) -> TaskSpec | None:
    """The GLUE task whose official TSV layout every file has, if any."""
    found = {_glue_layout_of(path) for path in files.values()}
    return TASKS[found.pop()] if len(found) == 1 and None not in found else None


def _glue_layout_of(path: Path) -> str | None:
    if path.suffix.lower() != ".tsv":
        return None
    with open(path, encoding="utf-8-sig", newline="") as f:
        first = f.readline().rstrip("\r\n").split("\t")
    for spec in TASKS.values():
        layout = spec.tsv_layout
        if layout is None:
            continue
        if layout.header is not None and tuple(first) == layout.header:
            return spec.name
        if layout.header is None and len(first) == layout.num_fields and first[layout.label] in ("0", "1"):
            return spec.name
    return None


def _read_glue_tsv(path: Path, spec: TaskSpec) -> datasets.Dataset:
    """An official GLUE TSV: no quoting (QUOTE_NONE), MRPC's UTF-8 BOM dropped, headerless CoLA by position."""
    layout = spec.tsv_layout
    with open(path, encoding="utf-8-sig", newline="") as f:
        reader = csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE)
        rows = []
        for row in reader:
            if row and len(row) != layout.num_fields:
                raise ValueError(f"{path}:{reader.line_num}: expected {layout.num_fields} tab-separated fields "
                                 f"({spec.name} layout), found {len(row)}.")
            if row:
                rows.append(row)
    if layout.header is not None:
        if tuple(rows[0]) != layout.header:
            raise ValueError(f"{path}: header {rows[0]} is not the {spec.name} layout {list(layout.header)}.")
        column_at = {name: i for i, name in enumerate(rows.pop(0))}
    else:
        column_at = {i: i for i in range(layout.num_fields)}
    columns = {col: [r[column_at[src]] for r in rows] for col, src in zip(spec.text_columns, layout.text)}
    parse = _label_parser(spec, path)
    columns["label"] = [parse(r[column_at[layout.label]]) for r in rows]
    return datasets.Dataset.from_dict(columns, features=spec.features())


def _label_parser(spec: TaskSpec, path: Path):
    if spec.task_type == "regression":
        return float
    ids = {name: i for i, name in enumerate(spec.label_names)} | {str(i): i for i in range(len(spec.label_names))}

    def parse(value: str) -> int:
        if value not in ids:
            raise ValueError(f"{path}: label {value!r} is not one of {list(spec.label_names)} (or their indices).")
        return ids[value]

    return parse


# ------------------------------------------------------------------------------------------------------ tables


def read_table_file(path: Path) -> datasets.Dataset:
    builder = FILE_TYPES[path.suffix.lower()]
    if builder != "parquet":
        _check_text_file(path)
    # Plain TSVs follow the GLUE convention: a quote character is just text.
    options = {"delimiter": "\t", "quoting": csv.QUOTE_NONE} if path.suffix.lower() == ".tsv" else {}
    try:
        return datasets.load_dataset(builder, data_files=str(path), split="train", **options)
    except Exception as error:  # datasets wraps the reader's own error (DatasetGenerationError)
        cause = error
        while cause.__cause__ is not None:
            cause = cause.__cause__
        raise ValueError(f"Could not read {path} as {builder}: {type(cause).__name__}: {cause}") from None


def _check_text_file(path: Path) -> None:
    """UTF-8 text with at least one row after a CSV/TSV header: otherwise an error saying so, before any parsing."""
    data = path.read_bytes()
    if not data.strip():
        raise ValueError(f"{path} is empty: no header and no rows.")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        line = data[: error.start].count(b"\n") + 1
        raise ValueError(f"{path} is not UTF-8 text (line {line}: byte {data[error.start:error.start + 1]!r}): save "
                         "it as UTF-8 (from latin-1, say: iconv -f latin1 -t utf-8).") from None
    rows = [line for line in text.splitlines() if line.strip()]
    if path.suffix.lower() in (".csv", ".tsv") and len(rows) < 2:
        raise ValueError(f"{path} has a header ({rows[0]}) but no rows.")
    _check_separator(path, rows[0])


# Per file type: the separator its name promises, and the other one (each with its plural) a misnamed file has.
_SEPARATORS = {".csv": ((",", "commas"), ("\t", "tabs")), ".tsv": (("\t", "tabs"), (",", "commas"))}


def _check_separator(path: Path, header: str) -> None:
    """A header split by the other separator (a TSV named .csv) would be read as one column, or fail inside
    pandas: said here, with the fix."""
    suffix = path.suffix.lower()
    if suffix not in _SEPARATORS:
        return
    (named, nameds), (other, others) = _SEPARATORS[suffix]
    if other in header and named not in header:
        rename = path.with_suffix(".tsv" if suffix == ".csv" else ".csv").name
        raise ValueError(f"{path} looks separated by {others}, not {nameds} (its header {header!r}), and a {suffix} "
                         f"file is read as separated by {nameds}: rename it to {rename}, or save it with {nameds}.")
