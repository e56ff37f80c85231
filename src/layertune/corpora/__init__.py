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
``label_names``), from CoNLL column files (see `layertune.corpora.conll`) or any dataset with such columns.

`load_corpus` reads top to bottom, one module of this package per step: where the data lives (`sources`: registry
names from `registry`, the mirror, the hub, local files), reading it (`readers`; `conll` for CoNLL column files), its
columns and labels (`columns`: inferred, checked, encoded, conformed to a task), and its size (`sampling`: a dev split
carved, train and dev subsampled). Importing the package does not import `datasets` (seconds): the steps that need
it come with the first `load_corpus`, so that checking a study's task names stays cheap.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, get_args

from layertune.corpora import sources
from layertune.corpora.conll import is_conll_file
from layertune.corpora.registry import GLUE_CONFIGS, TASKS, TOKEN_COLUMN, TaskSpec
from layertune.corpora.sources import MIRROR_ENV, MIRROR_LAYOUT, DataUnavailableError, resolve_data_mirror
from layertune.corpus import Corpus, TaskType
from layertune.errors import CorpusArgumentError, unknown_choice

if TYPE_CHECKING:
    from layertune.corpora.columns import Loaded

__all__ = [
    "CONLL_03", "GLUE_COLA", "GLUE_CONFIGS", "GLUE_MRPC", "GLUE_RTE", "GLUE_SST2", "GLUE_STSB", "IMDB", "MIRROR_ENV",
    "MIRROR_LAYOUT", "TASKS", "TOKEN_COLUMN", "Corpus", "DataUnavailableError", "TaskSpec", "load_corpus",
    "resolve_data_mirror",
]


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
    revision: str | None = None,
    splits: Mapping[str, str] | None = None,
    task_type: TaskType | None = None,
    metric: str | None = None,
    label_names: tuple[str, ...] | list[str] | None = None,
    dev_fraction: float | None = None,
    validation_size: int | None = None,
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
    * ``task_type`` (classification, regression, token_classification) is inferred from the labels unless given
      (a note in ``Corpus.notes`` says which); ``label_names`` give the classes' order (integer labels: the name of
      each id); ``metric`` is the one that selects the best epoch and ranks settings (any of
      `layertune.metrics.METRICS` that fits the task type; default: the task's own).
    * Hub datasets: ``revision`` pins a commit, branch or tag; ``splits`` says which hub split is our train / dev /
      test (``{"dev": "validation_matched"}``; default: train, validation/valid/val/dev, test by name).
    * ``train_size`` / ``dev_size``: seeded subsample keeping class proportions, or equal classes when
      ``balanced`` (default: the task's own setting, True for IMDb). Without a dev split one is carved from train
      (``dev_fraction`` of it, default 0.1), stratified by class (a class with a single example is an error naming
      it: it cannot be in both parts).
    * ``validation_size``: that many examples carved from train (seeded, stratified by class, before the train
      subsample) as the corpus's validation slice, which `ModelTrainer` selects the best epoch and stops early on.
    """
    _check_size("train_size", train_size)
    _check_size("validation_size", validation_size)
    _check_size("dev_size", dev_size)
    if dev_fraction is not None and not 0 < dev_fraction < 1:
        raise CorpusArgumentError("dev_fraction", f"dev_fraction must be between 0 and 1 (a share of train), not "
                                  f"{dev_fraction!r}.")
    if task_type is not None and task_type not in get_args(TaskType):
        raise CorpusArgumentError("task_type", str(unknown_choice("task_type", task_type, get_args(TaskType))))
    # A registry name wins over a same-named folder in the working directory. A registry task's hub id with a
    # revision or splits is read from the hub like any dataset: the mirror holds no particular revision.
    registry = sources.is_registry_name(name) and not (revision or splits) or sources.is_registry_name(name, hub=False)
    if data_files is None and not registry and sources.names_a_file(name):
        data_files = name
    spec = sources.resolve_task(name, config) if registry or data_files is None else None
    if spec is not None and balanced and spec.task_type != "classification":
        raise ValueError(f"balanced=True needs a classification task; {spec.name!r} is {spec.task_type}.")
    if spec is not None and (given := [a for a, v in (("task_type", task_type), ("label_names", label_names))
                                       if v is not None]):
        raise CorpusArgumentError(given[0], f"{given[0]} is for data outside the registry; {spec.name!r} is a "
                                  "registry task with its own labels and task type.")
    from layertune.corpora import sampling  # imports datasets: with the first corpus, not the package

    reading = {"text_columns": text_columns, "label_column": label_column, "task_type": task_type,
               "label_names": tuple(label_names) if label_names is not None else None}
    if data_files is not None:
        loaded = _load_local(name, data_files, spec, **reading)
    elif spec is not None:
        loaded = _load_registry_task(spec, sources.mirror_root(data_mirror))
    else:
        loaded = _load_hub_dataset(name, config, revision, splits, **reading)
    if task_type is not None and loaded.task_type != task_type:
        raise CorpusArgumentError("task_type", f"task_type is {task_type!r}, but {name!r} reads as "
                                  f"{loaded.task_type} data.")
    if metric is not None:
        loaded = _with_metric(loaded, metric)
    return sampling.finish(loaded, train_size=train_size, dev_size=dev_size, seed=seed, balanced=balanced,
                           dev_fraction=dev_fraction, validation_size=validation_size)


# The metrics that fit each task type (see `layertune.metrics`); the first is the default.
METRICS_BY_TASK_TYPE = {"classification": ("accuracy", "f1", "matthews_correlation"),
                        "regression": ("spearmanr", "pearsonr"), "token_classification": ("f1", "precision", "recall",
                                                                                          "accuracy")}


def _with_metric(loaded: Loaded, metric: str) -> Loaded:
    """``loaded`` selected and ranked by ``metric``: first of its metrics, and its main metric."""
    import dataclasses

    valid = METRICS_BY_TASK_TYPE[loaded.task_type]
    if metric not in valid:
        raise CorpusArgumentError("metric", str(unknown_choice(f"metric for {loaded.task_type}", metric, valid)))
    if metric == "f1" and loaded.task_type == "classification" and len(loaded.label_names) != 2:
        raise CorpusArgumentError("metric", f"metric 'f1' is binary F1, but {loaded.name!r} has "
                                  f"{len(loaded.label_names)} classes; use accuracy or matthews_correlation.")
    if loaded.task_type == "token_classification":  # seqeval reports them all
        return dataclasses.replace(loaded, main_metric=metric)
    metrics = (metric, *(m for m in loaded.metrics if m != metric))
    return dataclasses.replace(loaded, metrics=metrics, main_metric=metric)


def _check_size(arg: str, value: object) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"{arg} must be a positive int or None, not {value!r}.")


# -------------------------------------------------------------------------- reading and conforming, by source


def _load_registry_task(spec: TaskSpec, mirror: Path | None) -> Loaded:
    """A registry task from the data mirror when it holds every file of the task, else from the hub."""
    from layertune.corpora import columns, readers

    if files := sources.mirror_files(spec, mirror):
        splits = {split: readers.read_spec_file(path, spec) for split, path in files.items()}
        shown = ", ".join(spec.mirror_files.values())
        return columns.Loaded.from_spec(spec, splits, f"Loaded from the data mirror {mirror} ({shown}).")
    splits = {split: columns.conform(ds, spec) for split, ds in sources.fetch_task(spec, mirror).items()}
    return columns.Loaded.from_spec(spec, splits,
                                    f"Loaded from the Hugging Face hub: {spec.hub_path} ({spec.hub_config}).")


def _load_hub_dataset(name: str, config: str | None, revision: str | None, splits: Mapping[str, str] | None,
                      **reading) -> Loaded:
    """Any other hub dataset: its splits renamed to ours, its columns and labels inferred."""
    from layertune.corpora import columns

    what = f"hub dataset {name!r}"
    hub = sources.fetch_dataset(name, config, revision)
    found, notes = sources.chosen_splits(hub, splits, what) if splits else sources.canonical_splits(hub, what)
    label = f"{name}:{config}" if config else name
    source = f"Loaded from the Hugging Face hub: {name}" + (f" ({config})" if config else "") + (
        f" at revision {revision}." if revision else ".")
    return columns.generic(label, found, notes=[source, *notes], **reading)


def _load_local(name, source, spec: TaskSpec | None, *, text_columns, label_column: str, **reading) -> Loaded:
    """Local files: in a registry task's layout (``spec``, or a GLUE TSV layout recognised), CoNLL column files, or
    tables whose columns and labels are inferred."""
    from layertune.corpora import columns, readers

    files = sources.split_files(source)
    spec = spec or readers.detect_layout(files)
    shown = ", ".join(f"{split}={path}" for split, path in files.items())
    if spec is not None:
        splits = {split: readers.read_spec_file(path, spec) for split, path in files.items()}
        return columns.Loaded.from_spec(spec, splits, f"Loaded from local files ({spec.name} layout): {shown}.",
                                        official=False, sources={split: str(path) for split, path in files.items()})
    label = name if not sources.is_local_path(name) else Path(name).stem
    if all(is_conll_file(path) for path in files.values()):
        return columns.generic_conll(str(label), files, f"Loaded from local CoNLL files: {shown}.")
    splits = {split: readers.read_table_file(path) for split, path in files.items()}
    return columns.generic(str(label), splits, text_columns, label_column, [f"Loaded from local files: {shown}."],
                           sources={split: str(path) for split, path in files.items()}, **reading)
