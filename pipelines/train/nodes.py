"""train: one cell (task, model, tunable_layers, seed), chosen by ``params:cell``."""

from collections.abc import Callable
from pathlib import Path

from layertune.corpus import Corpus
from layertune.study import Cell, feature_cache_dir, section, train_cell


def train(corpora: dict[str, Callable[..., Corpus]], cache_root: Path, cell: dict, train: dict,
          tokenize: dict) -> tuple:
    """The model (best epoch), its summary (identity included), the per-epoch history and the drift table."""
    cell = Cell.from_params(cell)
    if cell.task not in corpora:
        raise ValueError(f"No prepared corpus for {cell.task!r} (found {', '.join(corpora)}): add it to "
                         f"study.tasks and run the prepare stage.")
    result, model = train_cell(corpora[cell.task](), cell, section("train", train), section("tokenize", tokenize),
                               cache_dir=feature_cache_dir(cache_root, cell.task, cell.model))
    return model, {**cell.as_dict(), **result.summary()}, result.history, result.drift
