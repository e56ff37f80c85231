"""ner: the CoNLL-2003 layer study of ``params:ner`` (every tunable-layers cell, baselines, report)."""

from pathlib import Path

import pandas as pd

from layertune.ner_study import (
    NerParams, feature_cache_dir, load_study_corpus, majority_baselines, report_figures, report_markdown, run_study,
)
from layertune.study import data_mirror, section


def train_ner_cells(ner: dict, download: dict, cache_root: Path) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """Per-epoch history, one summary row per cell, and the drift of every parameter of every cell."""
    params = NerParams.model_validate(ner)
    corpus = load_study_corpus(params, data_mirror(section("download", download)))
    result = run_study(params, corpus, cache_dir=feature_cache_dir(cache_root, params.model))
    return result.history, result.summary, result.drift


def ner_baselines(ner: dict, download: dict) -> dict:
    """Dev scores of the majority tag and of each word's most frequent training tag."""
    params = NerParams.model_validate(ner)
    return majority_baselines(load_study_corpus(params, data_mirror(section("download", download))))


def ner_report(summary: pd.DataFrame, history: pd.DataFrame, drift: pd.DataFrame, baselines: dict,
               ner: dict) -> tuple[str, dict]:
    """``reports/ner.md`` and its figures, keyed by file name."""
    markdown = report_markdown(summary, drift, baselines, NerParams.model_validate(ner))
    return markdown, report_figures(summary, history, drift, baselines)
