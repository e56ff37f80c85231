"""tokenize: tokenize each task once per model and cache the frozen layers' output for every boundary needed."""

from collections.abc import Callable
from pathlib import Path

from layertune.corpus import Corpus
from layertune.study import build_features, feature_cache_dir, section


def build_feature_caches(corpora: dict[str, Callable[..., Corpus]], cache_root: Path, study: dict,
                         tokenize: dict) -> dict:
    """One encoder load per model and one forward pass per split fill the cache of every (task, model)."""
    from layertune.language_model import LanguageModel

    study, options = section("study", study), section("tokenize", tokenize)
    manifest = {}
    for model in study.models:
        encoder = LanguageModel(model, tunable_layers=0)
        for task in study.tasks:
            manifest[f"{task}/{model}"] = build_features(
                corpora[task](), model, study.tunable_layers, options, feature_cache_dir(cache_root, task, model),
                encoder=encoder)
    return manifest
