"""Benchmark corpora: GLUE, IMDb and CoNLL-2003 from a local mirror or the Hugging Face hub, any hub dataset, or
local files.

The mirror comes first: ``data_mirror=`` or ``$LAYERTUNE_DATA_MIRROR`` names a folder laid out as

    glue/{CoLA,SST-2,MRPC,RTE,STS-B}/{train,dev}.tsv   the official GLUE TSVs
    imdb/{train,test}.parquet                           columns text, label (0 = neg, 1 = pos)
    ner/conll2003/{train,dev,test}.txt                  the CoNLL-2003 shared-task files (word POS chunk NER)

A task missing from the mirror is fetched from the hub; offline, the error says how to point at a mirror.
Every corpus comes out the same way: the text column(s) plus ``label`` (ints ``0..C-1`` in ``label_names`` order for
classification, float for regression), and the same arguments always give the same rows in the same order.
Token-classification corpora instead have ``tokens`` (the words of a sentence) and ``tags`` (IOB2 ids into
``label_names``), from CoNLL column files (see `layertune.conll`) or any dataset with such columns.
"""

from __future__ import annotations

import csv
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import datasets
import numpy as np
import pyarrow.parquet as pq
from datasets.table import InMemoryTable

from layertune.conll import conll_dataset, entity_types_of, iob1_to_iob2, iob2_label_names, read_conll, token_features
from layertune.corpus import Corpus, TaskType
from layertune.tasks import GLUE_CONFIGS, TASKS, TOKEN_COLUMN, TaskSpec
from layertune.errors import choices_hint, unknown_choice

logger = logging.getLogger(__name__)

MIRROR_ENV = "LAYERTUNE_DATA_MIRROR"
MIRROR_LAYOUT = ("glue/{CoLA,SST-2,MRPC,RTE,STS-B}/{train,dev}.tsv, imdb/{train,test}.parquet and "
                 "ner/conll2003/{train,dev,test}.txt")
DEV_FRACTION = 0.1  # share of train carved off as dev when a dataset has no validation split
SPLIT_ALIASES = {"train": "train", "dev": "dev", "validation": "dev", "valid": "dev", "val": "dev", "test": "test"}
FILE_TYPES = {".csv": "csv", ".tsv": "csv", ".json": "json", ".jsonl": "json", ".parquet": "parquet"}
# Tried in order when text_columns is not given; the first set fully present wins.
TEXT_COLUMN_GUESSES = (
    ("sentence1", "sentence2"), ("premise", "hypothesis"), ("question1", "question2"), ("question", "sentence"),
    ("text",), ("sentence",), ("review",), ("content",), ("document",),
)
LABEL_COLUMN_GUESSES = ("label", "labels", "score", "target", "class")
# CoNLL column files: one token per line, blank line between sentences. A .txt file counts when it has columns.
CONLL_SUFFIXES = (".conll", ".iob", ".bio")
TAG_COLUMN_GUESSES = ("tags", "ner_tags", "labels", "label")


class DataUnavailableError(ConnectionError):
    """The data is neither in the mirror nor reachable on the Hugging Face hub."""


# ---------------------------------------------------------------------------------------------------- public API


def GLUE_COLA(**options) -> Corpus:
    """CoLA: grammatical acceptability, scored by Matthews correlation. ``options`` go to :func:`load_corpus`."""
    return load_corpus("cola", **options)


def GLUE_SST2(**options) -> Corpus:
    """SST-2: binary sentiment of movie-review phrases, scored by accuracy."""
    return load_corpus("sst2", **options)


def GLUE_MRPC(**options) -> Corpus:
    """MRPC: paraphrase detection on sentence pairs, scored by accuracy (and F1), as in the GLUE tables."""
    return load_corpus("mrpc", **options)


def GLUE_RTE(**options) -> Corpus:
    """RTE: textual entailment on sentence pairs, scored by accuracy."""
    return load_corpus("rte", **options)


def GLUE_STSB(**options) -> Corpus:
    """STS-B: sentence-pair similarity regression (0..5), scored by Spearman (and Pearson) correlation."""
    return load_corpus("stsb", **options)


def IMDB(train_size: int | None = None, test_size: int | None = None, seed: int = 42, **options) -> Corpus:
    """IMDb reviews, balanced seeded subsamples (e.g. 8000/2000); dev is drawn from the official test split."""
    return load_corpus("imdb", train_size=train_size, dev_size=test_size, seed=seed, **options)


def CONLL_03(train_size: int | None = None, seed: int = 42, **options) -> Corpus:
    """CoNLL-2003 English NER (PER, ORG, LOC, MISC), IOB2 tags, scored by entity-level F1 (seqeval).

    ``train_size``: a seeded random subsample of training sentences, kept in file order; dev and test stay whole
    unless ``dev_size`` is given.
    """
    return load_corpus("conll2003", train_size=train_size, seed=seed, **options)


def load_corpus(
    name: str,
    config: str | None = None,
    *,
    data_mirror: str | os.PathLike | None = None,
    train_size: int | None = None,
    dev_size: int | None = None,
    seed: int = 42,
    text_columns: tuple[str, ...] | list[str] | None = None,
    label_column: str = "label",
    data_files: str | os.PathLike | Mapping[str, str | os.PathLike] | None = None,
    balanced: bool | None = None,
) -> Corpus:
    """Load a corpus by registry name (``"cola"``, ``"glue"`` + ``"mrpc"``, ``"imdb"``), hub id, or local files.

    * Registry tasks (:data:`TASKS`) are read from the mirror (``data_mirror`` or ``$LAYERTUNE_DATA_MIRROR``), else
      from the hub. Any other hub dataset needs its full id (``"owner/name"``, optional ``config``).
    * Local data: ``name`` is a file or folder path, or ``data_files`` is a path or ``{split: path}``
      (csv/tsv/json/jsonl/parquet; ``validation``/``valid``/``val`` mean dev). Official GLUE TSVs are recognised
      by their layout, or read as task ``name`` when it is a registry task. CoNLL column files (.txt, .conll,
      .iob, .bio; last column IOB1 or IOB2 tags) load as token classification.
    * A dataset with a ``tokens`` column (lists of words) and a list-valued tags column (``tags``, ``ner_tags``,
      ``labels`` or ``label_column``) loads as token classification.
    * ``text_columns`` / ``label_column`` are guessed when not given for data outside the registry. Their labels
      are stripped of surrounding whitespace and the classes are those of train: a dev/test label train lacks, two
      spellings differing only in case, one class in train, or a list-valued text or label column is an error.
    * ``train_size`` / ``dev_size``: seeded subsample keeping class proportions, or equal classes when
      ``balanced`` (default: the task's own setting, True for IMDb). Without a dev split one is carved from train,
      stratified by class (a class with a single example is an error naming it: it cannot be in both parts).
    """
    _check_size("train_size", train_size)
    _check_size("dev_size", dev_size)
    registry = _is_registry_name(name)  # a registry name wins over a same-named folder in the working directory
    if data_files is None and not registry and _is_local_path(name):
        data_files = name
    spec = _resolve_task(name, config) if registry or data_files is None else None
    if spec is not None and balanced and spec.task_type != "classification":
        raise ValueError(f"balanced=True needs a classification task; {spec.name!r} is {spec.task_type}.")
    if data_files is not None:
        loaded = _load_local(name, data_files, spec, text_columns, label_column)
    elif spec is not None:
        loaded = _load_registry_task(spec, _mirror_root(data_mirror))
    else:
        loaded = _load_hub_dataset(name, config, text_columns, label_column)
    return _finish(loaded, train_size=train_size, dev_size=dev_size, seed=seed, balanced=balanced)


# ------------------------------------------------------------------------------------------- resolving the name


def _check_size(arg: str, value: object) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"{arg} must be a positive int or None, not {value!r}.")


def _is_local_path(name: str | os.PathLike) -> bool:
    return isinstance(name, os.PathLike) or Path(name).expanduser().exists()


def _task_key(name: str) -> str:
    # "SST-2", "STS-B", "CoLA" (the GLUE folder names) resolve to the registry keys.
    return str(name).lower().replace("-", "").replace("_", "")


def _is_registry_name(name: object) -> bool:
    """True for a registry task, ``glue`` (with a config) or a registry task's hub id."""
    if not isinstance(name, str):
        return False
    return _task_key(name) in (*TASKS, "glue") or name in {spec.hub_path for spec in TASKS.values()}


def _resolve_task(name: str, config: str | None) -> TaskSpec | None:
    """The registry spec for ``name`` (+ ``config``), None for a hub id outside the registry."""
    key = _task_key(name)
    if key in TASKS:
        spec = TASKS[key]
        if config is not None and config not in (spec.hub_config, spec.name):
            raise unknown_choice(f"{spec.name} config", config, [spec.hub_config])
        return spec
    if key == "glue" or name == "nyu-mll/glue":
        if config is None:
            hint = choices_hint("", GLUE_CONFIGS)
            raise ValueError(f"{name!r} needs a config, e.g. load_corpus('glue', 'mrpc').{hint}")
        if _task_key(config) not in GLUE_CONFIGS:
            raise unknown_choice("GLUE config", config, GLUE_CONFIGS)
        return TASKS[_task_key(config)]
    for spec in TASKS.values():
        if name == spec.hub_path:
            return _resolve_task(spec.name, config)
    if "/" in name:
        return None
    error = unknown_choice("task", name, TASKS)
    raise ValueError(f"{error} Any other Hugging Face dataset needs its full id ('owner/name'); "
                     f"local files need a path that exists or data_files=.")


def _mirror_root(data_mirror: str | os.PathLike | None) -> Path | None:
    origin = "data_mirror" if data_mirror is not None else MIRROR_ENV
    root = data_mirror if data_mirror is not None else os.environ.get(MIRROR_ENV)
    if not root:
        return None
    root = Path(root).expanduser()
    if not root.is_dir():
        raise FileNotFoundError(f"{origin}={str(root)!r} is not a folder; it should hold {MIRROR_LAYOUT}.")
    return root


# ----------------------------------------------------------------------------------------------------- loading


@dataclass
class _Loaded:
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
                  official: bool = True, sources: dict[str, str] | None = None) -> _Loaded:
        """``official``: the splits are the task's own, so its notes about them apply."""
        notes = [source, *spec.notes] if official else [source]
        return cls(spec.name, splits, spec.text_columns, spec.task_type, spec.label_names, spec.metrics,
                   spec.main_metric, spec.max_length, spec.balanced, notes, sources or {})

    def where(self, split: str) -> str:
        """The file a split came from, or a description of it: what an error about its data names."""
        return self.sources.get(split) or f"the {split} split of {self.name!r}"


def _load_registry_task(spec: TaskSpec, mirror: Path | None) -> _Loaded:
    files = {split: mirror / rel for split, rel in spec.mirror_files.items()} if mirror else {}
    if files and all(path.is_file() for path in files.values()):
        splits = {split: _read_spec_file(path, spec) for split, path in files.items()}
        shown = ", ".join(spec.mirror_files.values())
        return _Loaded.from_spec(spec, splits, f"Loaded from the data mirror {mirror} ({shown}).")
    if mirror:
        logger.info("%s is not in the data mirror %s; trying the Hugging Face hub", spec.name, mirror)
    try:
        hub = datasets.load_dataset(spec.hub_path, spec.hub_config, revision=spec.hub_revision)
    except OSError as err:  # ConnectionError (offline) and DatasetNotFoundError are both OSErrors
        raise DataUnavailableError(_mirror_hint(spec, mirror, err)) from err
    hub = {split: ds.rename_columns({k: v for k, v in spec.hub_columns.items() if k in ds.column_names})
           for split, ds in hub.items()}
    splits = {split: _conform(hub[hub_split], spec) for split, hub_split in spec.hub_splits.items()}
    return _Loaded.from_spec(spec, splits, f"Loaded from the Hugging Face hub: {spec.hub_path} ({spec.hub_config}).")


def _mirror_hint(spec: TaskSpec, mirror: Path | None, err: Exception) -> str:
    wanted = ", ".join(spec.mirror_files.values())
    where = f"The data mirror {mirror} has no {wanted}. " if mirror else "No data mirror is set. "
    return (f"Could not load task {spec.name!r} from the Hugging Face hub ({spec.hub_path}, {spec.hub_config}): "
            f"{type(err).__name__}: {err}. {where}To work offline, point at a local copy: set "
            f"{MIRROR_ENV}=/path/to/data (or pass data_mirror=) to a folder holding {wanted} "
            f"(full layout: {MIRROR_LAYOUT}).")


def _load_hub_dataset(name: str, config: str | None, text_columns, label_column: str) -> _Loaded:
    try:
        if config is not None:
            configs = datasets.get_dataset_config_names(name)
            if config not in configs:
                raise unknown_choice(f"{name} config", config, configs)
        hub = datasets.load_dataset(name, config)
    except OSError as err:
        raise DataUnavailableError(
            f"Could not load {name!r} from the Hugging Face hub: {type(err).__name__}: {err}. Offline, download "
            f"it elsewhere and pass the files: load_corpus({name!r}, data_files={{'train': ..., 'dev': ...}})."
        ) from err
    splits, notes = _canonical_splits(dict(hub), f"hub dataset {name!r}")
    label = f"{name}:{config}" if config else name
    return _generic(label, splits, text_columns, label_column,
                    [f"Loaded from the Hugging Face hub: {name}" + (f" ({config})." if config else "."), *notes])


def _canonical_splits(splits: Mapping[str, datasets.Dataset], what: str) -> tuple[dict, list[str]]:
    """Rename validation/valid/val to dev and drop splits we do not use (noted)."""
    out, notes = {}, []
    for split, ds in splits.items():
        ours = SPLIT_ALIASES.get(split.lower())
        if ours is None or ours in out:
            notes.append(f"Split {split!r} of {what} is not used.")
        else:
            out[ours] = ds
    if "train" not in out:
        raise ValueError(f"{what} has no train split; its splits are {', '.join(splits)}.")
    return out, notes


def _load_local(name, source, spec: TaskSpec | None, text_columns, label_column: str) -> _Loaded:
    files = _split_files(source)
    spec = spec or _detect_layout(files)
    shown = ", ".join(f"{split}={path}" for split, path in files.items())
    if spec is not None:
        splits = {split: _read_spec_file(path, spec) for split, path in files.items()}
        return _Loaded.from_spec(spec, splits, f"Loaded from local files ({spec.name} layout): {shown}.",
                                 official=False, sources={split: str(path) for split, path in files.items()})
    label = name if not _is_local_path(name) else Path(name).stem
    if all(_is_conll_file(path) for path in files.values()):
        return _generic_conll(str(label), files, f"Loaded from local CoNLL files: {shown}.")
    splits = {split: _read_table_file(path) for split, path in files.items()}
    return _generic(str(label), splits, text_columns, label_column, [f"Loaded from local files: {shown}."],
                    sources={split: str(path) for split, path in files.items()})


def _split_files(source) -> dict[str, Path]:
    """``{split: path}`` from a file (train only), a folder (``train.csv``, ``dev.tsv``, ...), or a mapping."""
    if isinstance(source, Mapping):
        files = {}
        for split, path in source.items():
            if str(split).lower() not in SPLIT_ALIASES:
                raise unknown_choice("split", split, SPLIT_ALIASES)
            files[SPLIT_ALIASES[str(split).lower()]] = Path(path).expanduser()
    elif Path(source).expanduser().is_dir():
        folder = Path(source).expanduser()
        files = {SPLIT_ALIASES[p.stem.lower()]: p for p in sorted(folder.iterdir())
                 if p.stem.lower() in SPLIT_ALIASES and p.suffix.lower() in (*FILE_TYPES, *CONLL_SUFFIXES, ".txt")}
        if "train" not in files:
            found = ", ".join(sorted(p.name for p in folder.iterdir())) or "nothing"
            raise FileNotFoundError(f"No train file (train.csv/.tsv/.json/.jsonl/.parquet) in {folder}; found {found}.")
    else:
        files = {"train": Path(source).expanduser()}
    for path in files.values():
        if not path.is_file():
            raise FileNotFoundError(f"Data file {path} does not exist.")
        if path.suffix.lower() not in FILE_TYPES and not _is_conll_file(path):
            error = unknown_choice("file type", path.suffix or path.name, (*FILE_TYPES, *CONLL_SUFFIXES))
            if path.suffix.lower() == ".txt":
                error = ValueError(f"{error} A .txt file is read as CoNLL columns (word ... tag), but the first line "
                                   f"of {path} has fewer than 2 columns.")
            raise error
    if "train" not in files:
        raise ValueError(f"data_files needs a 'train' file; got {', '.join(files)}.")
    return files


def _detect_layout(files: Mapping[str, Path]) -> TaskSpec | None:
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


# ------------------------------------------------------------------------------------------------ file readers


def _read_spec_file(path: Path, spec: TaskSpec) -> datasets.Dataset:
    if spec.task_type == "token_classification" and path.suffix.lower() not in FILE_TYPES:
        return conll_dataset(path, spec.label_names, num_columns=spec.conll_columns)
    if _is_conll_file(path):
        raise ValueError(f"{path} is a CoNLL column file, but {spec.name!r} is a {spec.task_type} task.")
    if spec.tsv_layout is not None and path.suffix.lower() == ".tsv":
        return _read_glue_tsv(path, spec)
    if path.suffix.lower() == ".parquet":
        # Read into memory so mirror data is not copied into the datasets cache.
        table = pq.read_table(path)
        return _conform(datasets.Dataset(InMemoryTable(table)), spec, str(path))
    return _conform(_read_table_file(path), spec, str(path))


def _is_conll_file(path: Path) -> bool:
    if path.suffix.lower() in CONLL_SUFFIXES:
        return True
    if path.suffix.lower() != ".txt":
        return False
    with open(path, encoding="utf-8", errors="replace") as lines:
        first = next((line for line in lines if line.strip()), "")
    return len(first.split()) >= 2


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


def _read_table_file(path: Path) -> datasets.Dataset:
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


def _conform(ds: datasets.Dataset, spec: TaskSpec, where: str = "") -> datasets.Dataset:
    """Keep the spec's text columns and label, with labels mapped to the spec's label ids."""
    where = where or f"{spec.hub_path} ({spec.hub_config})"
    if spec.task_type == "token_classification":
        return _conform_tokens(ds, spec.label_names, where)
    _require_columns(ds, [*spec.text_columns, "label"], where)
    ds = ds.select_columns([*spec.text_columns, "label"])
    if spec.task_type == "classification" and not isinstance(ds.features["label"], datasets.ClassLabel):
        ds = _encode_labels(ds, spec.label_names, where)
    return ds if ds.features == spec.features() else ds.cast(spec.features())


def _require_columns(ds: datasets.Dataset, wanted, where: str) -> None:
    missing = [c for c in wanted if c not in ds.column_names]
    if missing:
        raise ValueError(f"{where} has no column {', '.join(map(repr, missing))}; "
                         f"its columns are {', '.join(ds.column_names)}.")


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


def _generic(name: str, splits: dict[str, datasets.Dataset], text_columns, label_column: str,
             notes: list[str], sources: dict[str, str] | None = None) -> _Loaded:
    token_columns = _token_columns(splits["train"], text_columns, label_column, name)
    if token_columns is not None:
        return _generic_tokens(name, splits, *token_columns, notes)
    train = splits["train"]
    where = {s: (sources or {}).get(s) or f"the {s} split of {name!r}" for s in splits}
    label_column = _find_label_column(train, label_column, name)
    text_columns = _find_text_columns(train, text_columns, label_column, name)
    _check_one_value_per_row(splits, text_columns, label_column, where)
    splits, notes = _drop_unlabelled_test(splits, label_column, notes)
    for split, ds in splits.items():
        _require_columns(ds, [*text_columns, label_column], f"{split} split of {name!r}")
    splits = {s: ds.select_columns([*text_columns, label_column]) for s, ds in splits.items()}
    _check_complete(splits, [*text_columns, label_column], where)
    if label_column != "label":
        splits = {s: ds.rename_column(label_column, "label") for s, ds in splits.items()}
    splits, task_type, label_names = _normalize_labels(splits, name, where)
    if task_type == "regression":
        metrics = ("spearmanr", "pearsonr")
    else:
        metrics = ("accuracy", "f1") if len(label_names) == 2 else ("accuracy",)
    return _Loaded(name, splits, text_columns, task_type, label_names, metrics, metrics[0], notes=notes,
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


def _find_label_column(ds: datasets.Dataset, label_column: str, name: str) -> str:
    if label_column in ds.column_names:
        return label_column
    guesses = [c for c in LABEL_COLUMN_GUESSES if c in ds.column_names] if label_column == "label" else []
    if len(guesses) == 1:
        return guesses[0]
    raise ValueError(f"{name!r} has no label column {label_column!r}; its columns are "
                     f"{', '.join(ds.column_names)}. Pass label_column=.")


def _find_text_columns(ds: datasets.Dataset, text_columns, label_column: str, name: str) -> tuple[str, ...]:
    columns = ds.column_names
    if text_columns is not None:
        text_columns = (text_columns,) if isinstance(text_columns, str) else tuple(text_columns)
        _require_columns(ds, text_columns, repr(name))
        return text_columns
    for guess in TEXT_COLUMN_GUESSES:
        if all(c in columns for c in guess):
            return guess
    strings = [c for c, f in ds.features.items()
               if c != label_column and isinstance(f, datasets.Value) and f.dtype in ("string", "large_string")]
    if len(strings) == 1:
        return (strings[0],)
    described = ", ".join(f"{c} ({getattr(f, 'dtype', type(f).__name__)})" for c, f in ds.features.items())
    raise ValueError(f"Cannot guess the text column(s) of {name!r}; its columns are {described}. "
                     f"Pass text_columns=('a',) or ('a', 'b') for sentence pairs.")


def _drop_unlabelled_test(splits: dict, label_column: str, notes: list[str]) -> tuple[dict, list[str]]:
    """Hub test splits often hide their labels (-1 or null); such a split cannot be scored."""
    test = splits.get("test")
    if test is None or label_column not in test.column_names:
        return splits, notes
    if set(test.unique(label_column)) <= {-1, None}:
        splits = {s: ds for s, ds in splits.items() if s != "test"}
        notes = [*notes, "The test split has no labels and was dropped."]
    return splits, notes


def _normalize_labels(splits: dict[str, datasets.Dataset], name: str,
                      where: dict[str, str]) -> tuple[dict, TaskType, tuple[str, ...]]:
    """Classification (ClassLabel ids) or regression (float32) labels. Plain labels: the classes are those of the
    train split, stripped of surrounding whitespace; a dev/test label outside them, or two spellings of one label
    differing only in case, is an error naming the files."""
    feature = splits["train"].features["label"]
    if isinstance(feature, datasets.ClassLabel):
        names = tuple(feature.names)
        return {s: _encode_labels(ds, names, f"{s} split of {name!r}") if ds.features["label"] != feature else ds
                for s, ds in splits.items()}, "classification", names
    if isinstance(feature, datasets.Value) and feature.dtype.startswith("float"):
        return {s: ds.cast_column("label", datasets.Value("float32")) for s, ds in splits.items()}, "regression", ()
    splits = {s: _strip_labels(ds) for s, ds in splits.items()}
    found = {s: set(ds.unique("label")) - {None} for s, ds in splits.items()}
    _check_label_case(found, where)
    names = tuple(str(v) for v in sorted(found["train"], key=_label_sort_key))
    if len(names) < 2:
        raise ValueError(f"{where['train']}: every label is {names[0] if names else None!r}. A classifier needs at "
                         "least two classes (and a score to regress on needs numbers with decimals, e.g. 3.0).")
    for split, labels in found.items():
        if unseen := sorted({str(v) for v in labels} - set(names)):
            raise ValueError(
                f"{where[split]}: label(s) {', '.join(map(repr, unseen))} never occur in the train data "
                f"({where['train']}), whose labels are {', '.join(map(repr, names))}. A class the model never "
                "trained on cannot be predicted: correct the label, add training examples of it, or drop those rows.")
    as_text = {s: ds.cast_column("label", datasets.Value("string")) for s, ds in splits.items()}
    encoded = {s: _encode_labels(ds, names, where[s]) for s, ds in as_text.items()}
    return encoded, "classification", names


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


# ------------------------------------------------------------------------------------------ token classification


def _generic_conll(name: str, files: Mapping[str, Path], source: str) -> _Loaded:
    """CoNLL column files with their own tag set: the entity types found in any split, tags as IOB2."""
    types = sorted(set().union(*(entity_types_of(read_conll(path), path) for path in files.values())))
    label_names = iob2_label_names(types)
    splits = {split: conll_dataset(path, label_names) for split, path in files.items()}
    return _token_loaded(name, splits, label_names, [source])


def _token_loaded(name: str, splits: dict[str, datasets.Dataset], label_names: tuple[str, ...],
                  notes: list[str]) -> _Loaded:
    return _Loaded(name, splits, (TOKEN_COLUMN,), "token_classification", label_names, ("seqeval",), "f1",
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
                    notes: list[str]) -> _Loaded:
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


# -------------------------------------------------------------------------------------- carving and subsampling


def _finish(loaded: _Loaded, *, train_size: int | None, dev_size: int | None, seed: int,
            balanced: bool | None) -> Corpus:
    classify = loaded.task_type == "classification"
    balanced = loaded.balanced if balanced is None else balanced
    if balanced and not classify:
        raise ValueError(f"balanced=True needs a classification task; {loaded.name!r} is {loaded.task_type}.")
    splits, notes = dict(loaded.splits), list(loaded.notes)
    if classify:
        _check_train_classes(splits["train"], loaded.label_names, loaded.where("train"))
    if "dev" not in splits:
        splits["train"], splits["dev"], note = _carve_dev(splits["train"], dev_size, seed,
                                                          loaded.label_names if classify else (),
                                                          loaded.where("train"))
        notes.append(note)
    for split, size in (("train", train_size), ("dev", dev_size)):
        # Only sentence labels can be stratified by; token-classification sentences are sampled at random.
        splits[split], note = _subsample(splits[split], size, seed=seed, balanced=balanced,
                                         label_names=loaded.label_names if classify else (), split=split)
        notes += [note] if note else []
    return Corpus(name=loaded.name, train=splits["train"], dev=splits["dev"], text_columns=loaded.text_columns,
                  task_type=loaded.task_type, metrics=loaded.metrics, main_metric=loaded.main_metric,
                  label_names=loaded.label_names, test=splits.get("test"), notes=notes,
                  max_length=loaded.max_length)


def _check_train_classes(train: datasets.Dataset, label_names: tuple[str, ...], where: str) -> None:
    present = sorted(set(train.unique("label")))
    if len(present) < 2:
        only = ", ".join(repr(label_names[i]) for i in present) or "none"
        raise ValueError(f"{where}: every training example has the same class ({only} of {', '.join(label_names)}). "
                         "A classifier needs examples of at least two classes to learn anything.")


def _carve_dev(train: datasets.Dataset, dev_size: int | None, seed: int, label_names: tuple[str, ...], where: str):
    """Dev carved from train, stratified by class when ``label_names`` are given (classification).

    A class with a single example cannot be stratified (it cannot be in both parts): that is an error naming the
    class, rather than a silent unstratified carve that could leave the class out of train or dev."""
    stratify = bool(label_names)
    size = max(dev_size or 0, round(DEV_FRACTION * len(train)), 1)
    if stratify:
        counts = np.bincount(np.asarray(train["label"]), minlength=len(label_names))
        if single := [name for name, count in zip(label_names, counts) if count == 1]:
            shown = ("class " if len(single) == 1 else "classes ") + ", ".join(f"{n!r} (1 example)" for n in single)
            raise ValueError(
                f"{where}: {shown} cannot be split between train and the dev split carved from it (stratified by "
                "class, each class needs at least 2 examples). Add examples, drop the class, or give a dev file: "
                "data_files={'train': ..., 'dev': ...}.")
        size = max(size, int((counts > 0).sum()))  # a stratified dev holds at least one example of every class
    if size >= len(train):
        raise ValueError(f"{where}: cannot carve a dev split of {size:,} from a train split of {len(train):,} "
                         "examples.")
    try:
        parts = train.train_test_split(test_size=size, seed=seed, stratify_by_column="label" if stratify else None)
    except ValueError as error:  # too few examples left for every class to be in both parts
        raise ValueError(f"{where}: cannot carve a dev split of {size:,} stratified by class from {len(train):,} "
                         f"examples: {error}") from None
    how = "stratified by label, " if stratify else ""
    note = (f"No validation split: dev is {size:,} examples carved from train ({how}seed {seed}); "
            f"train keeps the other {len(parts['train']):,}.")
    return parts["train"], parts["test"], note


def _subsample(ds: datasets.Dataset, size: int | None, *, seed: int, balanced: bool,
               label_names: tuple[str, ...], split: str) -> tuple[datasets.Dataset, str | None]:
    """Seeded subsample of ``size`` rows kept in their original order; stratified by class when classifying."""
    if size is None and not balanced:
        return ds, None
    if size is not None and size > len(ds):
        raise ValueError(f"{split}_size={size:,} but the {split} split has only {len(ds):,} examples.")
    rng = np.random.default_rng(seed)
    if not label_names:  # regression: no classes to stratify by
        if size == len(ds):
            return ds, None
        keep = np.sort(rng.choice(len(ds), size=size, replace=False))
        return ds.select(keep), f"{split}: random subsample of {size:,} of {len(ds):,} examples (seed {seed})."
    labels = np.asarray(ds["label"])
    counts = np.bincount(labels, minlength=len(label_names))
    if balanced:
        quotas = _balanced_quotas(counts, size, label_names, split)
        size = int(quotas.sum())
    else:
        quotas = _proportional_quotas(counts, size)
    if size == len(ds):
        return ds, None
    keep = np.sort(np.concatenate([
        rng.choice(np.flatnonzero(labels == c), size=q, replace=False) for c, q in enumerate(quotas)
    ]))
    kind = "balanced (equal classes)" if balanced else "stratified"
    shown = ", ".join(f"{n} {q:,}" for n, q in zip(label_names, quotas))
    return ds.select(keep), f"{split}: {kind} subsample of {size:,} of {len(ds):,} examples ({shown}; seed {seed})."


def _proportional_quotas(counts: np.ndarray, size: int) -> np.ndarray:
    """Rows per class in proportion to ``counts``, rounded by largest remainder so they sum to ``size``."""
    exact = counts * size / counts.sum()
    quotas = np.floor(exact).astype(int)
    order = np.argsort(-(exact - quotas), kind="stable")
    quotas[order[: size - quotas.sum()]] += 1
    return quotas


def _balanced_quotas(counts: np.ndarray, size: int | None, label_names: tuple[str, ...], split: str) -> np.ndarray:
    """Equal rows per class (any remainder to the first classes); ``size=None``: as many as the rarest class has."""
    for name, count in zip(label_names, counts):
        if count == 0:
            raise ValueError(f"Class {name!r} would have no examples after balancing: the {split} split has no "
                             f"{name!r} examples (classes: {', '.join(label_names)}).")
    size = int(counts.min()) * len(counts) if size is None else size
    quotas = np.full(len(counts), size // len(counts))
    quotas[: size % len(counts)] += 1
    for name, count, quota in zip(label_names, counts, quotas):
        if quota == 0:
            raise ValueError(f"Class {name!r} would have no examples after balancing: {split}_size={size} is "
                             f"smaller than the {len(counts)} classes ({', '.join(label_names)}).")
        if quota > count:
            raise ValueError(f"Class {name!r} has only {count:,} {split} examples; a balanced subsample of "
                             f"{size:,} needs {quota:,} per class.")
    return quotas


def resolve_data_mirror(configured: str | os.PathLike | None) -> str | os.PathLike | None:
    """The data mirror to use: ``$LAYERTUNE_DATA_MIRROR`` when set (then None, which `load_corpus` resolves to it),
    else ``configured`` (None: the Hugging Face hub)."""
    return None if os.environ.get(MIRROR_ENV) else configured
