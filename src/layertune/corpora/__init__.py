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
from typing import TYPE_CHECKING

from layertune.corpora import sources
from layertune.corpora.conll import is_conll_file
from layertune.corpora.registry import GLUE_CONFIGS, TASKS, TOKEN_COLUMN, TaskSpec
from layertune.corpora.sources import MIRROR_ENV, MIRROR_LAYOUT, DataUnavailableError, resolve_data_mirror
from layertune.corpus import Corpus

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
    registry = sources.is_registry_name(name)  # a registry name wins over a same-named folder in the working directory
    if data_files is None and not registry and sources.is_local_path(name):
        data_files = name
    spec = sources.resolve_task(name, config) if registry or data_files is None else None
    if spec is not None and balanced and spec.task_type != "classification":
        raise ValueError(f"balanced=True needs a classification task; {spec.name!r} is {spec.task_type}.")
    from layertune.corpora import sampling  # imports datasets: with the first corpus, not the package

    if data_files is not None:
        loaded = _load_local(name, data_files, spec, text_columns, label_column)
    elif spec is not None:
        loaded = _load_registry_task(spec, sources.mirror_root(data_mirror))
    else:
        loaded = _load_hub_dataset(name, config, text_columns, label_column)
    return sampling.finish(loaded, train_size=train_size, dev_size=dev_size, seed=seed, balanced=balanced)


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


def _load_hub_dataset(name: str, config: str | None, text_columns, label_column: str) -> Loaded:
    """Any other hub dataset: its splits renamed to ours, its columns and labels inferred."""
    from layertune.corpora import columns

    splits, notes = sources.canonical_splits(sources.fetch_dataset(name, config), f"hub dataset {name!r}")
    label = f"{name}:{config}" if config else name
    return columns.generic(label, splits, text_columns, label_column,
                           [f"Loaded from the Hugging Face hub: {name}" + (f" ({config})." if config else "."), *notes])


def _load_local(name, source, spec: TaskSpec | None, text_columns, label_column: str) -> Loaded:
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
                           sources={split: str(path) for split, path in files.items()})
