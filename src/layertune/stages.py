"""The work of the pipeline's study stages, as plain functions of typed plans: prepare a study's corpora, fill the
feature cache its cells read, and score its cells. Kedro nodes call these and nothing else."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from layertune.study import DataSpec, FeaturePlan, StudyPlan

if TYPE_CHECKING:
    import pandas as pd

    from layertune.cell import CellFolder
    from layertune.corpus import Corpus

# Training figures of a cell that reports show next to its scores.
TRAINING_FIGURES = ("best_epoch", "train_time_s", "samples_per_s", "trainable_parameters", "total_parameters",
                    "peak_memory_mb")


def prepare_corpus(load: Callable[..., Corpus], data: DataSpec) -> Corpus:
    """The seeded subsample a study trains on: at most ``train_size`` / ``dev_size`` examples (stratified, or
    balanced), dev carved from train when the task has none. ``load(**options)`` is `load_corpus` on raw files."""
    import dataclasses

    full = load()
    sizes = {"train_size": data.train_size, "dev_size": data.dev_size}
    for split, size in sizes.items():
        if size is not None and size >= len(getattr(full, split.removesuffix("_size"))):
            sizes[split] = None  # "at most": a smaller split is kept whole
    if sizes != {"train_size": None, "dev_size": None} or data.balanced is not None:
        full = load(**sizes, seed=data.seed, balanced=data.balanced)
    return full if data.test else dataclasses.replace(full, test=None)


def build_features(corpora: Mapping[str, Corpus], plan: FeaturePlan, cache_root: str | Path) -> dict[str, dict]:
    """Tokenize every task once per language model and cache, in one forward pass per split, the states entering
    every boundary the study's cells train from. Returns per setting (`StudyCell.setting_key`) the cache entries
    its cells will read."""
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    cached: dict[tuple[int, str], dict] = {}
    for index, spec in enumerate(plan.models):
        encoder = spec.build()
        for task in plan.tasks:
            cached[index, task] = encoder.cache_features(
                corpora[task], plan.boundaries[index], max_length=plan.max_length, cache_dir=cache_root,
                cache_dtype=plan.cache_dtype, device=device)
        del encoder
    manifests = {}
    for key, cell in plan.settings.items():
        manifests[key] = {"language_models": [
            {"model": plan.models[index].model, "tokenized": cached[index, cell.task]["tokenized"],
             "frozen_prefix": None if boundary is None else cached[index, cell.task]["frozen_prefix"][boundary],
             "boundary": boundary}
            for index, boundary in zip(cell.models, cell.boundaries)]}
    return manifests


def score_cells(plan: StudyPlan, cells: Mapping[str, CellFolder], corpora: Mapping[str, Corpus]) -> pd.DataFrame:
    """One row per cell of ``plan``: its place in the grid, every metric of its task on each split it predicted
    (``dev_<metric>``, ``test_<metric>``), its main ``score`` (dev) and training figures.

    Scores are recomputed from the saved predictions; they must equal what training measured, which checks that
    predictions, references and the model's best epoch belong together."""
    import pandas as pd

    from layertune.metrics import compute_metrics

    missing = [cell.dvc_stage for cell in plan.cells if cell.key not in cells]
    if missing:
        raise ValueError(f"{len(missing)} cell(s) of study {plan.name} have no results: {', '.join(missing)}. "
                         f"Run them first (dvc repro <stage>).")
    rows = []
    for cell in plan.cells:
        corpus, folder = corpora[cell.task], cells[cell.key]
        row = {"key": cell.key, "task": cell.task, "encoder": cell.encoder,
               "tunable_layers": str(cell.tunable_layers), "seed": cell.seed, "metric": corpus.main_metric}
        for split, predicted in folder.predictions().items():
            scores = compute_metrics(corpus.metrics, predicted["predictions"], predicted["references"])
            row.update({f"{split}_{name}": value for name, value in scores.items()})
        trained = folder.metrics()
        if abs(row[f"dev_{corpus.main_metric}"] - trained[f"eval_{corpus.main_metric}"]) > 1e-9:
            raise ValueError(f"{folder.path}: its saved dev predictions score {row[f'dev_{corpus.main_metric}']}, "
                             f"but training measured {trained[f'eval_{corpus.main_metric}']}: the folder is "
                             "inconsistent; retrain the cell (dvc repro --force " + cell.dvc_stage + ").")
        row["score"] = row[f"dev_{corpus.main_metric}"]
        row.update({name: trained[name] for name in TRAINING_FIGURES})
        rows.append(row)
    return pd.DataFrame(rows)
