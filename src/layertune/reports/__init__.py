"""Study reports: one function per kind of study, built from the shared pieces in `layertune.reports.common`.

A report function takes a `StudyResults` (the study's plan, every cell's scores and saved folder, the prepared
corpora) and returns a `Report` (Markdown, deterministic headline metrics and details, tables, figures). ``report.kind`` in a
study of params.yaml picks one of `REPORTS` (the kinds are listed in `layertune.study.ReportKind` too, so that
checking params.yaml does not import the reports). A new kind of study is a params.yaml section plus, if none of
these fits, a function registered in both places.
"""

from __future__ import annotations

from layertune.reports.common import Report, StudyResults
from layertune.reports.encoders import encoders_report
from layertune.reports.layers import layers_report
from layertune.reports.methods import methods_report
from layertune.reports.ner import ner_report

REPORTS = {"layers": layers_report, "ner": ner_report, "encoders": encoders_report, "methods": methods_report}


def build_report(results: StudyResults) -> Report:
    """The report of ``results``' kind (``report.kind`` of its study)."""
    return REPORTS[results.plan.spec.report.kind](results)
