"""aggregate: the study's report, by the report function its ``report.kind`` names, and the tidy tables of
dvc.yaml's plots (`dvc plots show`, `dvc plots diff`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import pandas as pd

# Imported as the node runs (the reports import scipy, matplotlib and seaborn): see pipelines/evaluate/nodes.py.
if TYPE_CHECKING:
    from layertune.cell import CellFolder
    from layertune.corpus import Corpus
    from layertune.study import StudyPlan

# Per history record: the loss of each split, as dvc.yaml's loss plot names them (dev: where it picked the epoch, in
# a study without a validation slice).
LOSSES = {"train": "train_loss", "validation": "validation_loss", "dev": "eval_loss"}


def report(plan: StudyPlan, scores: pd.DataFrame, cells: dict[str, CellFolder],
           corpora: dict[str, Callable[..., Corpus]], evaluation: dict, references: dict) -> tuple:
    """Markdown, headline metrics (for `dvc metrics` and `dvc exp show`), every number (details), tables and
    figures; then the plots' tables: score per setting, loss per epoch."""
    from layertune.reports import build_report
    from layertune.reports.common import StudyResults

    built = build_report(StudyResults(plan, scores, cells, corpora, evaluation, references))
    return (built.markdown, built.metrics, built.details, built.tables, built.figures,
            score_points(plan, built.tables), loss_points(plan, cells))


def score_points(plan: StudyPlan, tables: dict[str, pd.DataFrame]) -> pd.DataFrame:
    """One row per setting of the report's table: its mean dev score and interval at ``setting``, the value the
    study varies, on the line ``series`` (the rest of what names the setting)."""
    if "methods" in tables:
        table, axis = tables["methods"], "method"
    else:
        table = tables["settings"]
        axis = "encoder" if plan.spec.report.kind == "encoders" else "tunable_layers"
    series = table["task"] + " / " + (table["encoder"] if axis != "encoder" else
                                      table["tunable_layers"].astype(str) + " tunable layers")
    metrics = tables["cells"].drop_duplicates("task").set_index("task")["metric"]
    return pd.DataFrame({"series": series, "setting": table[axis].astype(str), "task": table["task"],
                         "metric": table["task"].map(metrics), "score": table["mean"],
                         "ci_low": table["ci_low"], "ci_high": table["ci_high"]})


def loss_points(plan: StudyPlan, cells: dict[str, CellFolder]) -> pd.DataFrame:
    """One row per cell, epoch and split (train, validation or dev) with a loss in the cell's history: the scored
    split's only where it was scored (every epoch, or the last with ``eval_strategy: end``)."""
    rows = [{"cell": cell.key, "task": cell.task, "seed": cell.seed, "epoch": record["epoch"], "split": split,
             "loss": record[key]}
            for cell in plan.cells for record in cells[cell.key].history()
            for split, key in LOSSES.items() if key in record]
    return pd.DataFrame(rows, columns=["cell", "task", "seed", "epoch", "split", "loss"])
