"""train: one cell of one study (``--params study=<study>,cell=<key>``)."""

from collections.abc import Callable
from pathlib import Path

from layertune.cell import TrainedCell, train_cell
from layertune.corpus import Corpus
from layertune.study import StudyCell


def train(cell: StudyCell, corpora: dict[str, Callable[..., Corpus]], cache_root: Path) -> TrainedCell:
    """The cell trained on its study's prepared data, from the tokenize stage's caches."""
    return train_cell(cell.spec, corpus=corpora[cell.task](), cache_dir=cache_root)
