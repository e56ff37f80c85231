"""prepare: the seeded subsample of each task that one study trains and evaluates on."""

import dataclasses
from collections.abc import Callable

from layertune.corpus import Corpus
from layertune.cell import SampleSpec
from pipelines.plans import PreparePlan


def prepare_corpora(raw: dict[str, Callable[..., Corpus]], plan: PreparePlan) -> dict[str, Corpus]:
    missing = [task for task in plan.tasks if task not in raw]
    if missing:
        raise ValueError(f"No raw splits for {', '.join(missing)}: run the download stage first.")
    return {task: prepare_corpus(raw[task], plan.data) for task in plan.tasks}


def prepare_corpus(load: Callable[..., Corpus], data: SampleSpec) -> Corpus:
    """The seeded subsample a study trains on: at most ``train_size`` / ``dev_size`` examples (stratified, or
    balanced), dev carved from train when the task has none. ``load(**options)`` is `load_corpus` on raw files."""
    full = load()
    sizes = {"train_size": data.train_size, "dev_size": data.dev_size}
    for split, size in sizes.items():
        if size is not None and size >= len(getattr(full, split.removesuffix("_size"))):
            sizes[split] = None  # "at most": a smaller split is kept whole
    if sizes != {"train_size": None, "dev_size": None} or data.balanced is not None:
        full = load(**sizes, seed=data.seed, balanced=data.balanced)
    return full if data.test else dataclasses.replace(full, test=None)
