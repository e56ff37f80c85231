"""Task metrics through Hugging Face ``evaluate``, from metric modules bundled with layertune.

``evaluate.load("f1")`` fetches the metric script from the Hub, which fails offline; loading the bundled file by path
never touches the network (evaluate copies it into its modules cache, ``HF_MODULES_CACHE``, and imports it there).
"""

from __future__ import annotations

import functools
import importlib.resources
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from layertune.errors import unknown_choice

if TYPE_CHECKING:
    import evaluate

METRICS: tuple[str, ...] = ("accuracy", "f1", "matthews_correlation", "pearsonr", "spearmanr", "seqeval")


@functools.cache
def load_metric(name: str) -> evaluate.EvaluationModule:
    """The bundled evaluate module ``name``, loaded once per process.

    Loaded with ``keep_in_memory=True`` so ``compute`` writes no Arrow cache files or lock files; the shared instance
    holds state during ``compute``, so do not call it from several threads at once.
    """
    if name not in METRICS:
        raise unknown_choice("metric", name, METRICS)
    import evaluate  # here, not at the top: importing evaluate pulls in transformers pipelines (seconds)

    script = importlib.resources.files("layertune") / "metric_modules" / f"{name}.py"
    with importlib.resources.as_file(script) as path:
        return evaluate.load(str(path), keep_in_memory=True)


def compute_metrics(
    names: Sequence[str],
    predictions: Sequence[Any] | np.ndarray,
    references: Sequence[Any] | np.ndarray,
    options: Mapping[str, Mapping[str, Any]] | None = None,
) -> dict[str, float]:
    """Scores of ``predictions`` against ``references`` for each metric, as one flat dict of plain floats.

    Keys equal the metric names (``accuracy``, ``f1``, ``matthews_correlation``, ``pearsonr``, ``spearmanr``), except
    ``seqeval``, which gives ``precision``, ``recall``, ``f1`` (entity-level micro averages), ``accuracy`` (token
    level) and ``<TYPE>_f1`` per entity type. ``options`` passes keyword arguments to one metric, e.g.
    ``{"f1": {"average": "macro"}}``; a metric giving one score per class (``average=None``) gives ``f1_0``, ``f1_1``...
    """
    if isinstance(names, str):
        raise TypeError(f"names must be a sequence of metric names, not the string {names!r}")
    if not names:
        raise ValueError(f"no metrics requested; choose from {', '.join(METRICS)}")
    modules = {name: load_metric(name) for name in names}  # unknown names fail before any work
    if "seqeval" in modules and len(modules) > 1:
        raise ValueError(f"seqeval scores tag sequences, the others labels or values: compute {list(names)} separately")
    options = dict(options or {})
    if unused := set(options) - set(names):
        raise ValueError(f"options given for metrics not requested: {sorted(unused)}")
    if len(predictions) != len(references):
        raise ValueError(f"{len(predictions)} predictions but {len(references)} references; they must pair up")
    if len(predictions) == 0:
        raise ValueError("no predictions to score: predictions and references are empty")

    scores: dict[str, float] = {}
    for name, module in modules.items():
        result = module.compute(predictions=predictions, references=references, **options.get(name, {}))
        for key, value in _flatten(name, result).items():
            if key in scores:  # e.g. both correlations asked for "return_pvalue"
                raise ValueError(f"two metrics report {key!r}; compute {list(names)} in separate calls")
            scores[key] = value
    return scores


def _flatten(name: str, result: Mapping[str, Any]) -> dict[str, float]:
    """One level of plain floats: seqeval's nested per-type dicts become ``<TYPE>_f1``, arrays ``<key>_<i>``."""
    if name == "seqeval":
        flat = {key.removeprefix("overall_"): float(v) for key, v in result.items() if key.startswith("overall_")}
        flat.update({f"{key}_f1": float(v["f1"]) for key, v in result.items() if isinstance(v, Mapping)})
        return flat
    flat = {}
    for key, value in result.items():
        array = np.asarray(value, dtype=float)
        if array.ndim == 0:
            flat[key] = float(array)
        else:
            flat.update({f"{key}_{i}": float(v) for i, v in enumerate(array.ravel())})
    return flat
