"""The references beside a study's cells (`layertune.probes`), on real data and a real model."""

from __future__ import annotations

import pytest

from layertune import LanguageModel, ModelTrainer, TextClassifier
from layertune.corpora import load_corpus
from layertune.probes import linear_probe, no_model_baseline, untrained_cosine
from layertune.training_config import TrainingConfig

# The head alone, as the default studies train it: cheap epochs from the frozen-prefix cache, so many of them.
HEAD_ONLY = dict(learning_rate=1e-4, head_learning_rate=1e-2, batch_size=16, epochs=100, early_stopping_patience=10,
                 weight_decay=0.0, warmup_ratio=0.0, max_length=64, seed=1, mixed_precision="no")


@pytest.fixture(scope="module")
def sst2(data_mirror):
    return load_corpus("sst2", train_size=600, validation_size=300, dev_size=600, seed=42, data_mirror=data_mirror)


def test_a_converged_head_only_cell_reaches_its_linear_probe(minilm_l3, sst2, tmp_path):
    """The head alone trains a linear layer on the probe's very features; trained until the validation slice stops
    improving, it scores within a point of scikit-learn's fit (on the same dev examples). Fails when training stops
    short (a few epochs at a small rate: the head is far below), when the probe reads other features than the head
    (another pooling), or when either chooses on dev."""
    args = dict(HEAD_ONLY)
    probe = linear_probe(LanguageModel(str(minilm_l3), tunable_layers=0, pooling="mean"), sst2,
                         TrainingConfig(**args), cache_dir=tmp_path)
    model = TextClassifier(LanguageModel(str(minilm_l3), tunable_layers=0, pooling="mean"), 2)
    result = ModelTrainer(model, sst2, cache_dir=tmp_path).train(progress=False, **args)
    assert result.stopped_by == "early_stopping" and result.frozen_prefix_cache["used"]
    assert abs(result.best_score - probe.score) <= 0.01, (result.best_score, probe.score, probe.chosen)
    short = TextClassifier(LanguageModel(str(minilm_l3), tunable_layers=0, pooling="mean"), 2)
    undertrained = ModelTrainer(short, sst2, cache_dir=tmp_path).train(
        progress=False, **{**args, "epochs": 1, "early_stopping_patience": None, "head_learning_rate": 1e-4})
    assert undertrained.best_score < probe.score - 0.05  # what the studies measured before: far below the probe


def test_the_probe_chooses_its_regularisation_on_the_validation_slice(minilm_l3, sst2, data_mirror, tmp_path):
    lm = LanguageModel(str(minilm_l3), tunable_layers=0, pooling="mean")
    probe = linear_probe(lm, sst2, TrainingConfig(**HEAD_ONLY), cache_dir=tmp_path)
    scores = probe.chosen["validation_scores"]
    assert probe.chosen["C"] == max(map(float, scores), key=lambda c: (scores[str(c)], -c))
    # The same fit with no penalty, scored on the slice too: on 600 sentences and 384 features it overfits, below
    # the penalty the slice chose
    assert 0.5 < probe.chosen["unpenalised_validation_score"] < max(scores.values()) - 0.03, probe.chosen
    assert len(probe.predictions["predictions"]) == len(sst2.dev) == 600
    with pytest.raises(ValueError, match="chooses its regularisation on a validation slice"):
        linear_probe(lm, load_corpus("sst2", train_size=100, data_mirror=data_mirror), cache_dir=tmp_path)
    with pytest.raises(ValueError, match="build the LanguageModel with tunable_layers=0, not 2"):
        linear_probe(LanguageModel(str(minilm_l3), tunable_layers=2), sst2, cache_dir=tmp_path)


def test_untrained_cosine_and_the_majority_class(minilm_l3, data_mirror, sst2):
    stsb = load_corpus("stsb", dev_size=300, seed=42, data_mirror=data_mirror)
    cosine = untrained_cosine(LanguageModel(str(minilm_l3), tunable_layers=0, pooling="mean"), stsb)
    assert cosine.score > 0.7  # a sentence-transformers model ranks similar pairs without any training
    majority = no_model_baseline(sst2)
    assert majority.chosen["class"] == "positive" and 0.45 < majority.score < 0.55
    assert no_model_baseline(stsb) is None
    with pytest.raises(ValueError, match="untrained_cosine scores sentence pairs"):
        untrained_cosine(LanguageModel(str(minilm_l3), tunable_layers=0), sst2)


def test_a_studys_references_are_computed_again_when_any_code_or_precision_they_depend_on_changes(
        tiny_bert, tmp_path, monkeypatch):
    """The evaluate stage keeps a study's references in the feature cache. Their key had the probes' own source
    only: an edit to what the probes import (the metrics, pooling, tokenization) reran the stage, which scored the
    cells with the new code and read the probes back as the old code had computed them; so did a cache folder
    moved to a machine that computes in another precision."""
    import dataclasses
    from types import SimpleNamespace

    from layertune import probes
    from layertune.study import StudySpec
    from pipelines import provenance
    from pipelines.evaluate.nodes import reference_scores
    from tests.conftest import toy_sentiment_corpus

    corpus = toy_sentiment_corpus(48, 16)
    corpus = dataclasses.replace(corpus, name="sst2", train=corpus.train.select(range(16, 48)),
                                 validation=corpus.train.select(range(16)))
    spec = StudySpec.model_validate({"report": {"kind": "layers"}, "tasks": ["sst2"],
                                     "encoders": {"tiny": str(tiny_bert)}, "tunable_layers": [0], "seeds": [1],
                                     "training": {"mixed_precision": "auto", "max_length": 32}})
    plan, corpora = SimpleNamespace(spec=spec, cells=[]), {"sst2": lambda: corpus}
    computed = []
    monkeypatch.setattr(probes, "study_references", lambda *args, study=probes.study_references, **kwargs:
                        computed.append(1) or study(*args, **kwargs))

    first = reference_scores(plan, corpora, tmp_path)
    assert "linear_probe" in first["sst2"]["encoders"]["tiny"] and len(computed) == 1
    assert reference_scores(plan, corpora, tmp_path) == first and len(computed) == 1  # unchanged: from the cache

    digest = provenance.code_digest
    monkeypatch.setattr(provenance, "code_digest", lambda path: digest(path) + ("edited" if path.name == "metrics.py"
                                                                                else ""))
    reference_scores(plan, corpora, tmp_path)
    assert len(computed) == 2  # metrics.py, which the probes import, was edited
    monkeypatch.setattr(provenance, "code_digest", digest)

    import layertune.training_config

    other = {"no": "bf16", "bf16": "no"}[layertune.training_config.resolve_mixed_precision("auto", "cpu")]
    monkeypatch.setattr(layertune.training_config, "resolve_mixed_precision", lambda setting, device: other)
    reference_scores(plan, corpora, tmp_path)
    assert len(computed) == 3  # the same folder on a machine where "auto" is another precision
