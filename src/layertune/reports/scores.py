"""A study's cells scored: one row per cell with every metric of its task, recomputed from its saved predictions."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from layertune.study import StudyPlan

if TYPE_CHECKING:
    import pandas as pd

    from layertune.cell import CellFolder
    from layertune.corpus import Corpus

# Training figures of a cell that reports show next to its scores.
TRAINING_FIGURES = ("best_epoch", "train_time_s", "samples_per_s", "trainable_parameters", "total_parameters",
                    "peak_memory_mb")
# How it trained (cells saved before these were recorded lack them: what such a cell did, or "not recorded").
CONVERGENCE = {"epochs_trained": None, "stopped_by": "max_epochs", "mixed_precision": "not recorded"}


def score_cells(plan: StudyPlan, cells: Mapping[str, CellFolder], corpora: Mapping[str, Corpus]) -> pd.DataFrame:
    """One row per cell of ``plan``: its place in the grid, every metric of its task on each split it predicted
    (``dev_<metric>``, ``test_<metric>``), its main ``score`` (dev), the validation slice's at the epoch it kept
    (``validation_score``) and training figures.

    Scores are recomputed from the saved predictions; they must equal what training measured, which checks that
    predictions, references and the model's best epoch belong together."""
    import pandas as pd

    from layertune.metrics import compute_metrics

    missing = [cell.key for cell in plan.cells if cell.key not in cells]
    if missing:
        raise ValueError(f"{len(missing)} cell(s) of study {plan.name} have no results: {', '.join(missing)}. "
                         "Train them first.")
    rows = []
    for cell in plan.cells:
        corpus, folder = corpora[cell.task], cells[cell.key]
        row = {"key": cell.key, "task": cell.task, "encoder": cell.encoder,
               "tunable_layers": str(cell.tunable_layers), "seed": cell.seed, "metric": corpus.main_metric}
        if cell.method is not None:  # a methods study: the method setting beside its layers
            row = {**row, "method": cell.method}
        for split, predicted in folder.predictions().items():
            scores = compute_metrics(corpus.metrics, predicted["predictions"], predicted["references"])
            row.update({f"{split}_{name}": value for name, value in scores.items()})
        trained = folder.metrics()
        if abs(row[f"dev_{corpus.main_metric}"] - trained[f"eval_{corpus.main_metric}"]) > 1e-9:
            raise ValueError(f"{folder.path}: its saved dev predictions score {row[f'dev_{corpus.main_metric}']}, "
                             f"but training measured {trained[f'eval_{corpus.main_metric}']}: the folder is "
                             f"inconsistent; retrain cell {cell.key} of study {plan.name}.")
        row["score"] = row[f"dev_{corpus.main_metric}"]
        # Beside what dev says, the main metric on the validation slice at the epoch the cell kept (NaN for a cell
        # that chose on dev, from before the slice).
        validation = f"validation_{corpus.main_metric}"
        kept = [record[validation] for record in folder.history()
                if record.get("epoch") == trained["best_epoch"] and validation in record]
        row["validation_score"] = kept[0] if kept else float("nan")
        row.update({name: trained[name] for name in TRAINING_FIGURES})
        row.update({name: trained.get(name, default) for name, default in CONVERGENCE.items()})
        if row["epochs_trained"] is None:  # a cell from before early stopping trained every epoch
            row["epochs_trained"] = len(folder.history())
        rates = cell.spec.training.learning_rates([e.model for e in cell.spec.encoders])
        row["learning_rate"] = " ".join(f"{rate:g}" for rate in rates.language_models)  # one per language model
        row["head_learning_rate"] = rates.head
        rows.append(row)
    return pd.DataFrame(rows)
