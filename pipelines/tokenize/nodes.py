"""tokenize: each task of a study tokenized once per language model, and the frozen layers' output cached for every
boundary its cells train from, so that cells only read."""

from collections.abc import Callable, Mapping
from pathlib import Path

from layertune.corpus import Corpus
from pipelines.plans import FeaturePlan


PIPELINE_ADVICE = ("Free space there, point the catalog's feature_cache (conf/base/catalog.yml, now {root}) at "
                   "another disk, or set the study's training.cache_dtype: bfloat16 (half-size states) or "
                   "frozen_prefix_cache: false in params.yaml.")


def build_feature_caches(corpora: dict[str, Callable[..., Corpus]], plan: FeaturePlan, cache_root: Path) -> dict:
    """One manifest per setting (task, encoder, tunable layers): the cache entries its cells read, whatever their
    seed (their dependency in dvc.yaml)."""
    return build_features({task: corpora[task]() for task in plan.tasks}, plan, cache_root)


def build_features(corpora: Mapping[str, Corpus], plan: FeaturePlan, cache_root: str | Path) -> dict[str, dict]:
    """Tokenize every task once per language model and cache, in one forward pass per split, the states entering
    every boundary the study's cells train from; per setting (`StudyCell.setting_key`), the entries its cells read."""
    import torch

    from layertune.frozen_prefix import CacheDiskFull
    from layertune.training_config import autocast_dtype, resolve_mixed_precision

    device = "cuda" if torch.cuda.is_available() else "cpu"  # where the cells train, as ModelTrainer decides
    autocast = autocast_dtype(resolve_mixed_precision(plan.mixed_precision, device))
    cached: dict[tuple[int, str], dict] = {}
    for index, spec in enumerate(plan.models):
        encoder = spec.build()
        for task in plan.tasks:
            try:
                cached[index, task] = encoder.cache_features(
                    corpora[task], plan.boundaries[index], max_length=plan.max_length, cache_dir=cache_root,
                    cache_dtype=plan.cache_dtype, device=device, autocast=autocast)
            except CacheDiskFull as full:  # the library's advice names its own arguments; here the catalog decides
                raise full.advising(PIPELINE_ADVICE.format(root=cache_root)) from None
        del encoder
    manifests = {}
    for key, cell in plan.settings.items():
        manifests[key] = {"language_models": [
            {"model": plan.models[index].model, "tokenized": cached[index, cell.task]["tokenized"],
             "frozen_prefix": None if boundary is None else cached[index, cell.task]["frozen_prefix"][boundary],
             "boundary": boundary}
            for index, boundary in zip(cell.models, cell.boundaries)]}
    return manifests
