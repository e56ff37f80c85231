import sys

import numpy as np
import pytest
from scipy.stats import pearsonr, spearmanr
from sklearn.metrics import accuracy_score, f1_score, matthews_corrcoef

from layertune.metrics import METRICS, compute_metrics, load_metric

SEEDS = [0, 1, 2, 3, 4]


def _labels(seed: int, num_classes: int, n: int = 300) -> tuple[np.ndarray, np.ndarray]:
    """Random predictions that agree with the references more often than chance, so scores are not all ~0."""
    rng = np.random.default_rng(seed)
    references = rng.integers(0, num_classes, n)
    predictions = np.where(rng.random(n) < 0.6, references, rng.integers(0, num_classes, n))
    return predictions, references


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("num_classes", [2, 4])
def test_classification_metrics_equal_sklearn(seed, num_classes):
    predictions, references = _labels(seed, num_classes)
    names = ["accuracy", "matthews_correlation"] + (["f1"] if num_classes == 2 else [])
    scores = compute_metrics(names, predictions, references)
    expected = {
        "accuracy": accuracy_score(references, predictions),
        "matthews_correlation": matthews_corrcoef(references, predictions),
    }
    if num_classes == 2:
        expected["f1"] = f1_score(references, predictions)
    assert scores == pytest.approx(expected, abs=1e-12)
    assert all(type(v) is float for v in scores.values())


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("average", ["macro", "micro", "weighted"])
def test_multiclass_f1_average_equals_sklearn(seed, average):
    predictions, references = _labels(seed, 4)
    scores = compute_metrics(["f1"], predictions.tolist(), references.tolist(), {"f1": {"average": average}})
    assert scores == {"f1": pytest.approx(f1_score(references, predictions, average=average), abs=1e-12)}


def test_f1_per_class_scores_are_flattened():
    predictions, references = _labels(0, 3)
    scores = compute_metrics(["f1"], predictions, references, {"f1": {"average": None}})
    expected = f1_score(references, predictions, average=None)
    assert scores == pytest.approx({f"f1_{i}": v for i, v in enumerate(expected)}, abs=1e-12)


@pytest.mark.parametrize("seed", SEEDS)
def test_correlations_equal_scipy(seed):
    rng = np.random.default_rng(seed)
    references = rng.normal(size=200) * 1.7 + 2.5
    predictions = 0.5 * references + rng.normal(size=200)
    scores = compute_metrics(["pearsonr", "spearmanr"], predictions, references)
    expected = {
        "pearsonr": pearsonr(references, predictions).statistic,
        "spearmanr": spearmanr(references, predictions).statistic,
    }
    # The bundled modules read float64; Hugging Face's own pearsonr casts to float32 and would miss at this tolerance.
    assert scores == pytest.approx(expected, abs=1e-12)
    assert all(type(v) is float for v in scores.values())


# Hand-computed case (default mode, i.e. conlleval conventions as in Hugging Face's seqeval metric):
#   sentence 1  gold PER[0-1] LOC[3]    predicted PER[0-1] ORG[3]   -> PER right, LOC missed, ORG spurious
#   sentence 2  gold ORG[0-2] PER[4]    predicted ORG[0-1] PER[4]   -> ORG wrong span (missed + spurious), PER right
#   sentence 3  gold LOC[1-2]           predicted I-LOC I-LOC       -> I- after O opens LOC[1-2]: right
#   sentence 4  no entities             predicted MISC[0]           -> MISC spurious
# gold entities 5 (PER 2, LOC 2, ORG 1), predicted 6, correct 3 (PER, PER, LOC):
#   precision 3/6 = 0.5, recall 3/5 = 0.6, f1 = 2 * 0.5 * 0.6 / 1.1 = 6/11
#   PER: 2/2 right -> f1 1;  LOC: P 1/1, R 1/2 -> f1 2/3;  ORG: 0 right -> f1 0;  MISC: none gold -> f1 0
# tokens: 4/5 + 4/5 + 3/4 + 1/2 = 12 of 16 equal -> accuracy 0.75
SEQEVAL_REFERENCES = [
    ["B-PER", "I-PER", "O", "B-LOC", "O"],
    ["B-ORG", "I-ORG", "I-ORG", "O", "B-PER"],
    ["O", "B-LOC", "I-LOC", "O"],
    ["O", "O"],
]
SEQEVAL_PREDICTIONS = [
    ["B-PER", "I-PER", "O", "B-ORG", "O"],
    ["B-ORG", "I-ORG", "O", "O", "B-PER"],
    ["O", "I-LOC", "I-LOC", "O"],
    ["B-MISC", "O"],
]


@pytest.mark.filterwarnings("ignore::UserWarning")  # seqeval warns that MISC recall is undefined (no gold MISC)
def test_seqeval_hand_computed():
    scores = compute_metrics(["seqeval"], SEQEVAL_PREDICTIONS, SEQEVAL_REFERENCES)
    assert scores == pytest.approx({
        "precision": 0.5, "recall": 0.6, "f1": 6 / 11, "accuracy": 0.75,
        "PER_f1": 1.0, "LOC_f1": 2 / 3, "ORG_f1": 0.0, "MISC_f1": 0.0,
    })


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_seqeval_strict_iob2_rejects_entity_opened_by_i_tag():
    # Strict IOB2 drops sentence 3's I-LOC I-LOC: predicted 5, correct 2 -> P = R = F1 = 2/5.
    options = {"seqeval": {"mode": "strict", "scheme": "IOB2"}}
    scores = compute_metrics(["seqeval"], SEQEVAL_PREDICTIONS, SEQEVAL_REFERENCES, options)
    assert (scores["precision"], scores["recall"], scores["f1"]) == pytest.approx((0.4, 0.4, 0.4))
    assert scores["LOC_f1"] == 0.0


def test_seqeval_module_keeps_hugging_face_layout():
    result = load_metric("seqeval").compute(predictions=[["B-PER", "I-PER", "O"]], references=[["B-PER", "I-PER", "O"]])
    assert result == {
        "PER": {"precision": 1.0, "recall": 1.0, "f1": 1.0, "number": 1},
        "overall_precision": 1.0, "overall_recall": 1.0, "overall_f1": 1.0, "overall_accuracy": 1.0,
    }


def test_seqeval_sentence_length_mismatch():
    with pytest.raises(ValueError, match="sentence 1: 2 predicted tags but 3 reference tags"):
        compute_metrics(["seqeval"], [["O"], ["O", "O"]], [["O"], ["O", "O", "O"]])


def test_unknown_metric_names_valid_choices():
    with pytest.raises(ValueError) as info:
        load_metric("acuracy")
    message = str(info.value)
    assert "Unknown metric 'acuracy'" in message and "Did you mean 'accuracy'?" in message
    assert f"Valid choices: {', '.join(METRICS)}." in message
    with pytest.raises(ValueError, match="Valid choices: accuracy, f1,"):
        compute_metrics(["accuracy", "pearson"], [1], [1])


@pytest.mark.parametrize(
    "names, predictions, references, message",
    [
        (["accuracy"], [0, 1], [0, 1, 1], "2 predictions but 3 references"),
        (["accuracy"], [], [], "no predictions to score"),
        ([], [0], [0], "no metrics requested"),
        (["f1", "seqeval"], [["O"]], [["O"]], "seqeval scores tag sequences"),
    ],
)
def test_bad_inputs_raise_clear_errors(names, predictions, references, message):
    with pytest.raises(ValueError, match=message):
        compute_metrics(names, predictions, references)


def test_options_for_unrequested_metric_are_rejected():
    with pytest.raises(ValueError, match="options given for metrics not requested"):
        compute_metrics(["accuracy"], [0], [0], {"f1": {"average": "macro"}})


def test_colliding_keys_are_rejected():
    options = {"pearsonr": {"return_pvalue": True}, "spearmanr": {"return_pvalue": True}}
    with pytest.raises(ValueError, match="two metrics report 'p-value'"):
        compute_metrics(["pearsonr", "spearmanr"], [0.1, 0.5, 0.2], [0.0, 1.0, 0.5], options)


def test_load_metric_is_cached():
    assert load_metric("accuracy") is load_metric("accuracy")


def test_loads_offline_into_empty_cache(tmp_path, monkeypatch):
    """With HF_HUB_OFFLINE=1, sockets refused and empty evaluate caches, every bundled metric still loads and scores.

    In-process (a fresh interpreter would re-import transformers, ~8 s): evaluate reads its cache paths and offline
    flag at import, so they are patched on ``evaluate.config``, and ``evaluate_modules`` is hidden from ``sys.modules``
    so the metric scripts really are imported from the new cache.
    """
    import socket

    import evaluate

    def refuse(*args, **kwargs):
        raise OSError("network access attempted while offline")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(evaluate.config, "HF_EVALUATE_OFFLINE", True)
    monkeypatch.setattr(evaluate.config, "HF_MODULES_CACHE", tmp_path / "modules")
    monkeypatch.setattr(evaluate.config, "HF_METRICS_CACHE", tmp_path / "metrics")
    monkeypatch.syspath_prepend(str(tmp_path / "modules"))
    for name in [m for m in sys.modules if m.split(".")[0] == "evaluate_modules"]:
        monkeypatch.delitem(sys.modules, name)

    with pytest.raises(FileNotFoundError, match="Hugging Face Hub"):
        evaluate.load("f1")  # the Hub name: why the modules are bundled
    for name in METRICS:
        module = load_metric.__wrapped__(name)  # bypass the per-process cache
        assert sys.modules[type(module).__module__].__file__.startswith(str(tmp_path / "modules"))
    f1 = load_metric.__wrapped__("f1").compute(predictions=[0, 1, 1, 0], references=[0, 1, 0, 0])
    assert f1 == {"f1": pytest.approx(2 / 3)}
    assert not list((tmp_path / "metrics").rglob("*.arrow"))  # keep_in_memory: no Arrow cache files
