"""evaluate: every cell of a study scored from the predictions it saved (dev, and test where it has labels)."""

from collections.abc import Callable

import pandas as pd

from layertune.cell import CellFolder
from layertune.corpus import Corpus
from layertune.reports.scores import score_cells
from layertune.study import StudyPlan


def evaluate(plan: StudyPlan, cells: dict[str, CellFolder], corpora: dict[str, Callable[..., Corpus]]) -> pd.DataFrame:
    """One row per cell of the plan (cells left over from older grids are ignored)."""
    return score_cells(plan, cells, {task: corpora[task]() for task in plan.spec.tasks})
