"""evaluate: a trained cell's saved model, reloaded and scored on dev, with its predictions."""

from collections.abc import Callable

import pandas as pd

from layertune.corpus import Corpus
from layertune.study import Cell, evaluate_model, section


def evaluate(model, corpora: dict[str, Callable[..., Corpus]], cell: dict, tokenize: dict,
             evaluate: dict) -> tuple[pd.DataFrame, dict]:
    """Predictions per dev example, and the dev metrics with the cell's identity and its main ``score``."""
    cell = Cell.from_params(cell)
    corpus = corpora[cell.task]()
    predictions, metrics = evaluate_model(model, corpus, section("tokenize", tokenize),
                                          section("evaluate", evaluate).batch_size)
    return predictions, {**cell.as_dict(), "metric": corpus.main_metric, "score": metrics[corpus.main_metric],
                         **metrics}
