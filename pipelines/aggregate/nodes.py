"""aggregate: the study's report, by the report function its ``report.kind`` names."""

from collections.abc import Callable

import pandas as pd

from layertune.cell import CellFolder
from layertune.corpus import Corpus
from layertune.reports import build_report
from layertune.reports.common import StudyResults
from layertune.study import StudyPlan


def report(plan: StudyPlan, scores: pd.DataFrame, cells: dict[str, CellFolder],
           corpora: dict[str, Callable[..., Corpus]]) -> tuple[str, dict, dict, dict, dict]:
    """Markdown, headline metrics (for `dvc metrics` and `dvc exp show`), every number (details), tables and
    figures."""
    built = build_report(StudyResults(plan, scores, cells, corpora))
    return built.markdown, built.metrics, built.details, built.tables, built.figures
