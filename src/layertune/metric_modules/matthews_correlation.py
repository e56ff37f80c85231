"""Matthews correlation coefficient (CoLA's metric), via scikit-learn; works for multiclass too."""

import datasets
import evaluate
from sklearn.metrics import matthews_corrcoef

_DESCRIPTION = "Matthews correlation in [-1, 1] (0 = chance), computed by sklearn.metrics.matthews_corrcoef."

_INPUTS = """
Args:
    predictions (list of int): predicted labels.
    references (list of int): gold labels.
    sample_weight (list of float): per-example weights.
Returns:
    matthews_correlation (float)
"""


class MatthewsCorrelation(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation="",
            inputs_description=_INPUTS,
            features=datasets.Features({"predictions": datasets.Value("int32"), "references": datasets.Value("int32")}),
            reference_urls=["https://scikit-learn.org/stable/modules/generated/sklearn.metrics.matthews_corrcoef.html"],
        )

    def _compute(self, predictions, references, sample_weight=None):
        return {"matthews_correlation": float(matthews_corrcoef(references, predictions, sample_weight=sample_weight))}
