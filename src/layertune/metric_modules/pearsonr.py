"""Pearson correlation (STS-B's metric), via scipy.

Features are float64, not Hugging Face's ``Value("float")`` (float32), so scores match scipy on the raw inputs.
"""

import datasets
import evaluate
from scipy.stats import pearsonr

_DESCRIPTION = "Pearson correlation coefficient in [-1, 1] between predictions and references, by scipy.stats.pearsonr."

_INPUTS = """
Args:
    predictions (list of float): predicted values.
    references (list of float): gold values.
    return_pvalue (bool): also return the two-sided p-value (default False).
Returns:
    pearsonr (float), and p-value (float) if return_pvalue
"""


class Pearsonr(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation="",
            inputs_description=_INPUTS,
            features=datasets.Features(
                {"predictions": datasets.Value("float64"), "references": datasets.Value("float64")}
            ),
            reference_urls=["https://docs.scipy.org/doc/scipy/reference/generated/scipy.stats.pearsonr.html"],
        )

    def _compute(self, predictions, references, return_pvalue=False):
        result = pearsonr(references, predictions)
        scores = {"pearsonr": float(result.statistic)}
        if return_pvalue:
            scores["p-value"] = float(result.pvalue)
        return scores
