"""Metrics equal scikit-learn, SciPy and seqeval, for a score and for every bootstrap resample."""

import warnings

import numpy as np
import pytest
from scipy.stats import pearsonr, spearmanr
from seqeval.metrics import accuracy_score as token_accuracy
from seqeval.metrics import classification_report
from sklearn.metrics import accuracy_score, f1_score, matthews_corrcoef

from layertune.metrics import compute_metrics, metric_for, resampled_scores

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
    scores = compute_metrics(names, predictions.tolist(), references.tolist())
    expected = {
        "accuracy": accuracy_score(references, predictions),
        "matthews_correlation": matthews_corrcoef(references, predictions),
    }
    if num_classes == 2:
        expected["f1"] = f1_score(references, predictions)
    assert scores == pytest.approx(expected, abs=1e-12)
    assert all(type(v) is float for v in scores.values())


def test_degenerate_predictions_score_zero_like_sklearn():
    references = [0, 1, 1, 0, 1]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = {"f1": f1_score(references, [0] * 5), "matthews_correlation": matthews_corrcoef(references, [1] * 5)}
    assert compute_metrics(["f1"], [0] * 5, references)["f1"] == expected["f1"] == 0.0
    assert compute_metrics(["matthews_correlation"], [1] * 5, references)["matthews_correlation"] == 0.0


@pytest.mark.parametrize("seed", SEEDS)
def test_correlations_equal_scipy(seed):
    rng = np.random.default_rng(seed)
    references = np.round(rng.normal(size=200) * 1.7 + 2.5, 1)  # rounded: ties, as in STS-B's scores
    predictions = 0.5 * references + rng.normal(size=200)
    scores = compute_metrics(["pearsonr", "spearmanr"], predictions, references)
    assert scores == pytest.approx({"pearsonr": pearsonr(references, predictions).statistic,
                                    "spearmanr": spearmanr(references, predictions).statistic}, abs=1e-10)


def test_every_resample_is_scored_as_its_own_data():
    """A resample's score is the score of the examples it drew (accuracy, F1, MCC, both correlations)."""
    rng = np.random.default_rng(0)
    predictions, references = _labels(1, 2, n=80)
    values = rng.normal(size=80)
    targets = np.round(values + rng.normal(size=80), 1)
    indices = rng.integers(0, 80, (5, 80))
    classified = resampled_scores(["accuracy", "f1", "matthews_correlation"], predictions, references, indices)
    correlated = resampled_scores(["pearsonr", "spearmanr"], values, targets, indices)
    for row, drawn in enumerate(indices):
        assert classified["accuracy"][row] == pytest.approx(accuracy_score(references[drawn], predictions[drawn]))
        assert classified["f1"][row] == pytest.approx(f1_score(references[drawn], predictions[drawn]))
        assert classified["matthews_correlation"][row] == pytest.approx(
            matthews_corrcoef(references[drawn], predictions[drawn]))
        assert correlated["pearsonr"][row] == pytest.approx(pearsonr(targets[drawn], values[drawn]).statistic)
        assert correlated["spearmanr"][row] == pytest.approx(spearmanr(targets[drawn], values[drawn]).statistic)


SEQEVAL_PREDICTIONS = [
    ["B-PER", "I-PER", "O", "B-LOC"],
    ["B-ORG", "O", "B-PER"],
    ["O", "I-LOC", "I-LOC", "O"],
    ["B-MISC", "O"],
]
SEQEVAL_REFERENCES = [
    ["B-PER", "I-PER", "O", "B-LOC"],
    ["B-ORG", "I-ORG", "B-PER"],
    ["O", "B-LOC", "I-LOC", "O"],
    ["O", "O"],
]


def _seqeval_reference(predictions, references) -> dict:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = classification_report(references, predictions, output_dict=True)
    overall = report.pop("micro avg")
    for name in ("macro avg", "weighted avg"):
        report.pop(name)
    return {"precision": overall["precision"], "recall": overall["recall"], "f1": overall["f1-score"],
            "accuracy": token_accuracy(references, predictions),
            **{f"{kind}_f1": scores["f1-score"] for kind, scores in report.items()}}


def test_seqeval_hand_computed_and_equal_to_seqeval():
    # Predicted entities: PER, LOC | ORG, PER | LOC (conlleval: I-LOC after O opens one) | MISC = 6; gold 5;
    # correct 4 (the one-word ORG is not the gold two-word ORG). Tags right: 4 + 2 + 3 + 1 of 13.
    scores = compute_metrics(["seqeval"], SEQEVAL_PREDICTIONS, SEQEVAL_REFERENCES)
    assert scores == pytest.approx({"precision": 4 / 6, "recall": 4 / 5, "f1": 8 / 11, "accuracy": 10 / 13,
                                    "PER_f1": 1.0, "LOC_f1": 1.0, "ORG_f1": 0.0, "MISC_f1": 0.0})
    assert scores == pytest.approx(_seqeval_reference(SEQEVAL_PREDICTIONS, SEQEVAL_REFERENCES))


@pytest.mark.parametrize("seed", SEEDS)
def test_seqeval_on_random_tag_sequences(seed):
    rng = np.random.default_rng(seed)
    tags = ["O", "O", "O", "B-PER", "I-PER", "B-LOC", "I-LOC", "B-ORG", "I-ORG"]
    references = [[tags[i] for i in rng.integers(0, len(tags), rng.integers(1, 12))] for _ in range(60)]
    predictions = [[tag if rng.random() < 0.7 else tags[rng.integers(0, len(tags))] for tag in sentence]
                   for sentence in references]
    assert compute_metrics(["seqeval"], predictions, references) == pytest.approx(
        _seqeval_reference(predictions, references))


def test_metric_for_a_tasks_main_key():
    assert metric_for("accuracy", ("accuracy", "f1")) == ["accuracy"]
    assert metric_for("f1", ("seqeval",)) == ["seqeval"]
    with pytest.raises(ValueError, match="none of the metrics"):
        metric_for("spearmanr", ("accuracy",))


def test_seqeval_sentence_length_mismatch():
    with pytest.raises(ValueError, match="sentence 1: 2 predicted tags but 3 reference tags"):
        compute_metrics(["seqeval"], [["O"], ["O", "O"]], [["O"], ["O", "O", "O"]])


@pytest.mark.parametrize(
    ("names", "predictions", "references", "message"),
    [
        (["acuracy"], [1], [1], "Did you mean 'accuracy'"),
        ("accuracy", [1], [1], "not the string"),
        ([], [1], [1], "no metrics requested"),
        (["accuracy"], [1, 0], [1], "2 predictions but 1 references"),
        (["accuracy"], [], [], "empty"),
        (["seqeval", "accuracy"], [["O"]], [["O"]], "separately"),
        (["f1"], [0, 2], [0, 1], "binary F1 of class 1"),
    ],
)
def test_bad_inputs_raise_clear_errors(names, predictions, references, message):
    with pytest.raises((ValueError, TypeError), match=message):
        compute_metrics(names, predictions, references)
