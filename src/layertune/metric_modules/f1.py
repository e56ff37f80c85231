"""F1: harmonic mean of precision and recall, via scikit-learn; binary by default like Hugging Face's f1."""

import datasets
import evaluate
import numpy as np
from sklearn.metrics import f1_score

_DESCRIPTION = "F1 = 2 * precision * recall / (precision + recall), computed by sklearn.metrics.f1_score."

_INPUTS = """
Args:
    predictions (list of int): predicted labels.
    references (list of int): gold labels.
    labels (list of int): labels to include when average != "binary".
    pos_label (int): the positive class for average="binary" (default 1).
    average (str): "binary" (default), "micro", "macro", "weighted", or None for one score per class.
    sample_weight (list of float): per-example weights.
    zero_division ("warn", 0, 1 or nan): value when precision or recall is undefined.
Returns:
    f1 (float, or list of float when average=None)
"""


class F1(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation="",
            inputs_description=_INPUTS,
            features=datasets.Features({"predictions": datasets.Value("int32"), "references": datasets.Value("int32")}),
            reference_urls=["https://scikit-learn.org/stable/modules/generated/sklearn.metrics.f1_score.html"],
        )

    def _compute(
        self, predictions, references, labels=None, pos_label=1, average="binary", sample_weight=None,
        zero_division="warn",
    ):
        score = f1_score(
            references, predictions, labels=labels, pos_label=pos_label, average=average,
            sample_weight=sample_weight, zero_division=zero_division,
        )
        return {"f1": float(score) if np.ndim(score) == 0 else np.asarray(score, dtype=float).tolist()}
