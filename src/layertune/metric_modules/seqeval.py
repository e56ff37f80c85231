"""Entity-level precision / recall / F1 for IOB-tagged sequences, via the seqeval package.

Same inputs, defaults and output layout as Hugging Face's ``seqeval`` metric: with ``mode=None`` seqeval follows
conlleval, so an ``I-X`` after ``O`` still opens an entity; pass ``mode="strict", scheme="IOB2"`` for strict IOB2.
"""

import datasets
import evaluate
from seqeval import scheme as schemes
from seqeval.metrics import accuracy_score, classification_report

_SCHEMES = ("IOB1", "IOB2", "IOE1", "IOE2", "IOBES", "BILOU")

_DESCRIPTION = "Entity-level scores of seqeval.metrics.classification_report, plus token-level accuracy."

_INPUTS = """
Args:
    predictions (list of list of str): predicted tags per sentence, e.g. [["B-PER", "I-PER", "O"]].
    references (list of list of str): gold tags, same shape as predictions.
    suffix (bool): tags are "PER-B" rather than "B-PER" (default False).
    scheme (str): "IOB1", "IOB2", "IOE1", "IOE2", "IOBES" or "BILOU"; used with mode="strict".
    mode (str): None (default, conlleval-compatible) or "strict".
    sample_weight (list of float): per-sentence weights.
    zero_division ("warn", 0 or 1): value when precision or recall is undefined.
Returns:
    overall_precision, overall_recall, overall_f1 (entity-level micro averages), overall_accuracy (token-level),
    and per entity type a dict {"precision", "recall", "f1", "number"} (number = gold entities of that type).
"""


class Seqeval(evaluate.Metric):
    def _info(self):
        sequence = datasets.Sequence(datasets.Value("string", id="label"), id="sequence")
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation="",
            inputs_description=_INPUTS,
            features=datasets.Features({"predictions": sequence, "references": sequence}),
            codebase_urls=["https://github.com/chakki-works/seqeval"],
        )

    def _compute(
        self, predictions, references, suffix=False, scheme=None, mode=None, sample_weight=None, zero_division="warn"
    ):
        for i, (pred, ref) in enumerate(zip(predictions, references)):
            if len(pred) != len(ref):
                raise ValueError(f"sentence {i}: {len(pred)} predicted tags but {len(ref)} reference tags")
        if scheme is not None:
            # seqeval wants the scheme class; taking its name keeps the metric's arguments plain strings.
            if scheme not in _SCHEMES:
                raise ValueError(f"Unknown scheme {scheme!r}. Valid choices: {', '.join(_SCHEMES)}.")
            scheme = getattr(schemes, scheme)
        report = classification_report(
            y_true=references, y_pred=predictions, suffix=suffix, output_dict=True, scheme=scheme, mode=mode,
            sample_weight=sample_weight, zero_division=zero_division,
        )
        report.pop("macro avg")
        report.pop("weighted avg")
        overall = report.pop("micro avg")
        scores = {
            entity_type: {
                "precision": float(s["precision"]), "recall": float(s["recall"]), "f1": float(s["f1-score"]),
                "number": int(s["support"]),
            }
            for entity_type, s in report.items()
        }
        scores["overall_precision"] = float(overall["precision"])
        scores["overall_recall"] = float(overall["recall"])
        scores["overall_f1"] = float(overall["f1-score"])
        scores["overall_accuracy"] = float(accuracy_score(y_true=references, y_pred=predictions))
        return scores
