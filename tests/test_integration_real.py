"""Real pretrained encoder on real GLUE data (from the mirror): the library learns, and fast paths are fast."""

import pytest
import transformers

from layertune import LanguageModel, ModelTrainer, TextClassifier, load_corpus

pytestmark = pytest.mark.integration
MINILM = "sentence-transformers/all-MiniLM-L6-v2"


@pytest.fixture(scope="module")
def sst2(data_mirror):
    return load_corpus("sst2", data_mirror=data_mirror, train_size=400, dev_size=300, seed=0)


def train(corpus, tunable_layers, tmp_path, **arguments):
    transformers.set_seed(0)
    model = TextClassifier(LanguageModel(MINILM, tunable_layers=tunable_layers, pooling="mean"), 2)
    return ModelTrainer(model, corpus, cache_dir=tmp_path).train(progress=False, batch_size=16, seed=0, **arguments)


@pytest.mark.slow
def test_minilm_learns_sst2_and_head_only_is_faster(sst2, tmp_path):
    full = train(sst2, "all", tmp_path, learning_rate=1e-4, epochs=2)
    head = train(sst2, 0, tmp_path, learning_rate=1e-4, head_learning_rate=3e-3, epochs=2)
    assert full.best_metrics["eval_accuracy"] > 0.70, full.history
    assert head.best_metrics["eval_accuracy"] > 0.60, head.history
    assert head.frozen_prefix_cache["used"] and not full.frozen_prefix_cache["used"]
    full_epoch = min(h["epoch_time_s"] for h in full.history)
    head_epoch = min(h["epoch_time_s"] for h in head.history)
    assert head_epoch < full_epoch / 2, (head_epoch, full_epoch)
    assert full.drift.query("part == 'embeddings'")["mean_abs_change"].gt(0).all()
    assert head.drift.query("part != 'head'")["mean_abs_change"].eq(0).all()


def test_same_seed_same_real_metrics(sst2, tmp_path):
    runs = [train(sst2, 1, tmp_path, learning_rate=1e-4, epochs=1) for _ in range(2)]
    assert runs[0].best_metrics == runs[1].best_metrics
