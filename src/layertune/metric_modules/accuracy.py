"""Accuracy: the fraction of predictions equal to the reference, via scikit-learn."""

import datasets
import evaluate
from sklearn.metrics import accuracy_score

_DESCRIPTION = "Accuracy = (TP + TN) / (TP + TN + FP + FN), computed by sklearn.metrics.accuracy_score."

_INPUTS = """
Args:
    predictions (list of int): predicted labels.
    references (list of int): gold labels.
    normalize (bool): fraction (True, default) or count (False) of correct predictions.
    sample_weight (list of float): per-example weights.
Returns:
    accuracy (float)
"""


class Accuracy(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation="",
            inputs_description=_INPUTS,
            features=datasets.Features({"predictions": datasets.Value("int32"), "references": datasets.Value("int32")}),
            reference_urls=["https://scikit-learn.org/stable/modules/generated/sklearn.metrics.accuracy_score.html"],
        )

    def _compute(self, predictions, references, normalize=True, sample_weight=None):
        score = accuracy_score(references, predictions, normalize=normalize, sample_weight=sample_weight)
        return {"accuracy": float(score)}
