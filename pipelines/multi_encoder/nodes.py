"""multi_encoder: the single-vs-multi encoder study of ``params:multi_encoder``; the work is in
`layertune.multi_study`."""

from pathlib import Path

import pandas as pd

from layertune import multi_study
from layertune.study import data_mirror, section


def run_multi_encoder_study(multi_encoder: dict, download: dict, cache_root: Path) -> pd.DataFrame:
    """Every (system, seed) cell: one row each with its dev score and, for dme, mean attention per encoder."""
    study = multi_study.StudySpec.model_validate(multi_encoder)
    return multi_study.run_study(study, data_mirror=data_mirror(section("download", download)), cache_dir=cache_root)


def multi_encoder_report(results: pd.DataFrame) -> tuple[str, dict]:
    """``reports/multi_encoder.md`` (mean ± std per system, best in bold, dme attention) and its metrics."""
    return multi_study.report_markdown(results), multi_study.summary_metrics(results)
