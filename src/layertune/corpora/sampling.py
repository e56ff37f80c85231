"""Sampling a corpus's splits to size: a dev split carved from train when the data has none (stratified by class),
a validation slice carved from train when asked for (stratified, rows in their original order), then seeded
subsamples of train and dev that keep class proportions or, balanced, equal classes (quotas per class).
The rows kept stay in their original order, and the same arguments always keep the same rows.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import datasets
import numpy as np

from layertune.corpora.columns import check_train_classes
from layertune.corpus import Corpus

if TYPE_CHECKING:
    from layertune.corpora.columns import Loaded

DEV_FRACTION = 0.1  # share of train carved off as dev when a dataset has no validation split


def finish(loaded: Loaded, *, train_size: int | None, dev_size: int | None, seed: int,
           balanced: bool | None, dev_fraction: float | None = None, validation_size: int | None = None) -> Corpus:
    """The `Corpus` of ``loaded``: train of at least two classes (classification), dev carved from train if there
    is none, a validation slice of ``validation_size`` carved from train, then train and dev subsampled to
    ``train_size`` / ``dev_size`` (balanced or stratified by class).

    The slice is carved before train is subsampled, so a seed gives the same slice whatever ``train_size``: the
    points of a learning curve select on the same examples."""
    classify = loaded.task_type == "classification"
    balanced = loaded.balanced if balanced is None else balanced
    if balanced and not classify:
        raise ValueError(f"balanced=True needs a classification task; {loaded.name!r} is {loaded.task_type}.")
    splits, notes = dict(loaded.splits), list(loaded.notes)
    if classify:
        check_train_classes(splits["train"], loaded.label_names, loaded.where("train"))
    if "dev" not in splits:
        splits["train"], splits["dev"], note = _carve_dev(splits["train"], dev_size, seed,
                                                          loaded.label_names if classify else (),
                                                          loaded.where("train"), dev_fraction or DEV_FRACTION)
        notes.append(note)
    if validation_size is not None:
        splits["train"], splits["validation"], note = _carve_validation(
            splits["train"], validation_size, seed, loaded.label_names if classify else (), loaded.where("train"))
        notes.append(note)
    for split, size in (("train", train_size), ("dev", dev_size)):
        # Only sentence labels can be stratified by; token-classification sentences are sampled at random.
        splits[split], note = _subsample(splits[split], size, seed=seed, balanced=balanced,
                                         label_names=loaded.label_names if classify else (), split=split)
        notes += [note] if note else []
    return Corpus(name=loaded.name, train=splits["train"], dev=splits["dev"], text_columns=loaded.text_columns,
                  task_type=loaded.task_type, metrics=loaded.metrics, main_metric=loaded.main_metric,
                  label_names=loaded.label_names, test=splits.get("test"), validation=splits.get("validation"),
                  notes=notes,
                  max_length=loaded.max_length)


def unused_sample(full: datasets.Dataset, used: list[datasets.Dataset], size: int, *, seed: int,
                  text_columns: tuple[str, ...], label_names: tuple[str, ...]) -> datasets.Dataset:
    """At most ``size`` rows of ``full`` whose text is in none of ``used`` (a study's train, validation and dev: no
    example scored twice, none trained on), a seeded subsample stratified by class when ``label_names`` are given,
    in their original order: the same arguments always give the same rows."""
    import json

    def texts(dataset: datasets.Dataset) -> list[str]:
        return [json.dumps(row) for row in zip(*(dataset[column] for column in text_columns))]

    taken = {text for dataset in used for text in texts(dataset)}
    pool = full.select([i for i, text in enumerate(texts(full)) if text not in taken])
    if not len(pool):
        raise ValueError(f"every one of the {len(full):,} training examples is in the study's train or dev sample: "
                         "none is left to evaluate on")
    sample, _ = _subsample(pool, min(size, len(pool)), seed=seed, balanced=False, label_names=label_names,
                           split="evaluation")
    return sample


def _carve_validation(train: datasets.Dataset, size: int, seed: int, label_names: tuple[str, ...], where: str):
    """``size`` rows of train as the validation slice, stratified by class when ``label_names`` are given (every
    class present keeps at least one row in train), seeded; both parts keep their rows' original order."""
    if size >= len(train):
        raise ValueError(f"{where}: validation_size={size:,} leaves nothing to train on: the train split has "
                         f"{len(train):,} examples.")
    rng = np.random.default_rng([seed, 1])  # a stream of its own: the train subsample draws from `seed`
    if label_names:
        labels = np.asarray(train["label"])
        counts = np.bincount(labels, minlength=len(label_names))
        quotas = np.minimum(_proportional_quotas(counts, size), np.maximum(counts - 1, 0))
        taken = np.concatenate([rng.choice(np.flatnonzero(labels == c), size=q, replace=False)
                                for c, q in enumerate(quotas)])
    else:
        taken = rng.choice(len(train), size=size, replace=False)
    chosen = np.zeros(len(train), dtype=bool)
    chosen[taken] = True
    how = "stratified by label, " if label_names else ""
    note = (f"validation: {int(chosen.sum()):,} examples carved from train ({how}seed {seed}) to pick the best epoch "
            f"and stop early; train keeps the other {int((~chosen).sum()):,}.")
    return train.select(np.flatnonzero(~chosen)), train.select(np.flatnonzero(chosen)), note


def _carve_dev(train: datasets.Dataset, dev_size: int | None, seed: int, label_names: tuple[str, ...], where: str,
               fraction: float):
    """Dev carved from train, stratified by class when ``label_names`` are given (classification).

    A class with a single example cannot be stratified (it cannot be in both parts): that is an error naming the
    class, rather than a silent unstratified carve that could leave the class out of train or dev."""
    stratify = bool(label_names)
    size = max(dev_size or 0, round(fraction * len(train)), 1)
    if stratify:
        counts = np.bincount(np.asarray(train["label"]), minlength=len(label_names))
        if single := [name for name, count in zip(label_names, counts) if count == 1]:
            raise ValueError(f"{where}: {_single_classes(single, len(label_names), len(train))}")
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


def _single_classes(single: list[str], classes: int, rows: int, shown: int = 5) -> str:
    """Why classes of one example stop a stratified carve, and the fixes; many classes are counted, not listed (300
    of them made a 7,000-character line)."""
    fix = ("add examples, drop {}, or give a dev file (a task entry's splits: {{train: <file>, dev: <file>}}; "
           "load_corpus: data_files={{'train': ..., 'dev': ...}}).")
    carve = "a dev split carved from train (stratified by class) needs 2 examples of each class"
    if len(single) == 1:
        return f"class {single[0]!r} has 1 example, and {carve}: " + fix.format("the class")
    names = ", ".join(map(repr, single[:shown])) + (f" and {len(single) - shown} more" if len(single) > shown else "")
    every = f" Every class has 1 ({classes} in {rows} rows): is the label column the label? If so, " \
        if len(single) == classes else " "
    return f"{len(single)} classes have 1 example ({names}), and {carve}.{every}" + fix.format("those classes")


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
