"""evaluate: every trained cell of one (task, model), its saved model reloaded and scored on dev."""

from collections.abc import Callable

from layertune.corpus import Corpus
from layertune.study import Cell, evaluate_model, section


def evaluate(models: dict[str, Callable], trainings: dict[str, dict], corpora: dict[str, Callable[..., Corpus]],
             cell: dict, study: dict, tokenize: dict, evaluate: dict) -> tuple[dict, dict]:
    """Predictions per dev example and dev metrics (with the cell's identity and main ``score``) for each cell of
    the study grid with ``cell``'s task and model, keyed like the cells' folders; leftovers of older grids are
    skipped."""
    task, model = cell["task"], cell["model"]
    grid = {c for c in section("study", study).cells() if (c.task, c.model) == (task, model)}
    corpus, options = corpora[task](), section("tokenize", tokenize)
    batch_size = section("evaluate", evaluate).batch_size
    predictions, metrics, evaluated = {}, {}, set()
    for folder, summary in trainings.items():
        identity = Cell(summary["task"], summary["model"], summary["tunable_layers"], summary["seed"])
        if identity not in grid:
            continue
        predictions[folder], scores = evaluate_model(models[folder](), corpus, options, batch_size)
        metrics[folder] = {**identity.as_dict(), "metric": corpus.main_metric, "score": scores[corpus.main_metric],
                           **scores}
        evaluated.add(identity)
    missing = grid - evaluated
    if missing:
        raise ValueError(f"No trained model for {len(missing)} cell(s) of the study: "
                         f"{', '.join(c.dvc_stage for c in sorted(missing, key=str))}")
    return predictions, metrics
