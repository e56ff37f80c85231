"""tokenize: each task of a study tokenized once per language model, and the frozen layers' output cached for every
boundary its cells train from, so that cells only read."""

from collections.abc import Callable
from pathlib import Path

from layertune.corpus import Corpus
from layertune.stages import build_features
from layertune.study import FeaturePlan


def build_feature_caches(corpora: dict[str, Callable[..., Corpus]], plan: FeaturePlan, cache_root: Path) -> dict:
    """One manifest per setting (task, encoder, tunable layers): the cache entries its cells read, whatever their
    seed (their dependency in dvc.yaml)."""
    return build_features({task: corpora[task]() for task in plan.tasks}, plan, cache_root)
