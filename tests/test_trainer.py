import json

import pytest
import torch
import transformers

from layertune import LanguageModel, ModelTrainer, TaskModel, TextClassifier, TextRegressor
from tests.conftest import ARCHITECTURES, toy_sentiment_corpus

FAST = dict(epochs=2, batch_size=8, learning_rate=1e-3, seed=3)


def build(model_dir, tunable_layers, seed=0, **kwargs):
    transformers.set_seed(seed)
    return TextClassifier(LanguageModel(model_dir, tunable_layers=tunable_layers, **kwargs), 2,
                          label_names=["negative", "positive"])


@pytest.mark.parametrize("architecture", ARCHITECTURES)
@pytest.mark.parametrize("cache", [False, "auto"])
def test_frozen_parameters_bit_identical_and_tunable_ones_changed(tiny_model_dirs, tmp_path, architecture, cache):
    model = build(tiny_model_dirs[architecture], tunable_layers=2)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ModelTrainer(model, toy_sentiment_corpus(16, 8), cache_dir=tmp_path).train(
        progress=False, frozen_prefix_cache=cache, **{**FAST, "epochs": 1})
    for name, parameter in model.named_parameters():
        if parameter.requires_grad:
            assert not torch.equal(parameter, before[name]), f"{name} is tunable but did not change"
        else:
            assert torch.equal(parameter, before[name]), f"{name} is frozen but changed"
    assert any(p.requires_grad for n, p in model.named_parameters() if n.startswith("encoder."))


def test_same_seed_same_metrics_and_drift(tiny_bert, toy_corpus, tmp_path):
    runs = [ModelTrainer(build(tiny_bert, 1), toy_corpus, cache_dir=tmp_path).train(progress=False, **FAST)
            for _ in range(2)]
    assert [h["eval_loss"] for h in runs[0].history] == [h["eval_loss"] for h in runs[1].history]
    assert runs[0].best_metrics == runs[1].best_metrics
    assert runs[0].drift["mean_abs_change"].tolist() == runs[1].drift["mean_abs_change"].tolist()


@pytest.mark.parametrize("architecture", ["bert", "distilbert", "deberta-v2", "electra"])
def test_cached_and_uncached_training_are_the_same_computation(tiny_model_dirs, toy_corpus, tmp_path, architecture):
    histories = []
    for cache in (False, "auto"):
        result = ModelTrainer(build(tiny_model_dirs[architecture], 2, pooling="mean"), toy_corpus,
                              cache_dir=tmp_path).train(progress=False, frozen_prefix_cache=cache, **FAST)
        histories.append(result.history)
        assert result.frozen_prefix_cache["used"] == (cache == "auto")
    for uncached, cached in zip(*histories):
        assert cached["train_loss"] == pytest.approx(uncached["train_loss"], abs=1e-5)
        assert cached["eval_loss"] == pytest.approx(uncached["eval_loss"], abs=1e-5)


def test_cache_is_off_where_it_cannot_be_exact(tiny_bert, toy_corpus, tmp_path):
    trainer = lambda model: ModelTrainer(model, toy_corpus, cache_dir=tmp_path)  # noqa: E731
    full = trainer(build(tiny_bert, "all")).train(progress=False, **FAST)
    assert not full.frozen_prefix_cache["used"] and "every layer trains" in full.frozen_prefix_cache["reason"]
    noisy = trainer(build(tiny_bert, 1, frozen_dropout=True)).train(progress=False, **FAST)
    assert not noisy.frozen_prefix_cache["used"] and "dropout" in noisy.frozen_prefix_cache["reason"]
    with pytest.raises(ValueError, match="cannot be honoured: every layer trains"):
        trainer(build(tiny_bert, "all")).train(progress=False, frozen_prefix_cache=True, **FAST)


def test_outputs_written_and_reloaded_model_predicts_identically(tiny_bert, toy_corpus, tmp_path):
    model = build(tiny_bert, 2)
    result = ModelTrainer(model, toy_corpus, cache_dir=tmp_path / "cache").train(tmp_path / "run", progress=False,
                                                                                **FAST)
    assert {p.name for p in (tmp_path / "run").iterdir()} == {
        "metrics.json", "history.json", "run_info.json", "drift.csv", "best-model"}
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["eval_accuracy"] == result.best_metrics["eval_accuracy"]
    assert len(json.loads((tmp_path / "run" / "history.json").read_text())) == FAST["epochs"]
    sentences = ["the movie was great", "a film so awful", "story"]
    reloaded = TaskModel.from_pretrained(tmp_path / "run" / "best-model")
    assert isinstance(reloaded, TextClassifier) and reloaded.encoder.tunable_layers == 2
    model.eval()
    assert reloaded.predict(sentences) == model.predict(sentences)
    batch = model.encoder.tokenize(sentences)
    torch.testing.assert_close(reloaded(batch), model(batch), atol=0, rtol=0)


def test_best_epoch_weights_are_restored(tiny_bert, toy_corpus, tmp_path):
    model = build(tiny_bert, 2)
    result = ModelTrainer(model, toy_corpus, cache_dir=tmp_path).train(progress=False, **{**FAST, "epochs": 4})
    best = max(h["eval_accuracy"] for h in result.history)
    assert result.best_metrics["eval_accuracy"] == best
    assert result.history[result.best_epoch - 1]["eval_accuracy"] == best


def test_head_learning_rate_reaches_the_optimizer(tiny_bert, toy_corpus, tmp_path):
    trainer = ModelTrainer(build(tiny_bert, 1), toy_corpus)
    from layertune.trainer import TrainingArguments

    groups = trainer._parameter_groups(TrainingArguments(learning_rate=2e-5, head_learning_rate=2e-3))
    head_ids = {id(p) for p in trainer.model.head_parameters()}
    for group in groups:
        is_head = {id(p) in head_ids for p in group["params"]}
        assert len(is_head) == 1
        assert group["lr"] == (2e-3 if is_head.pop() else 2e-5)


def test_regressor_trains_on_a_score(tiny_bert, tmp_path):
    transformers.set_seed(0)
    model = TextRegressor(LanguageModel(tiny_bert, tunable_layers=1))
    result = ModelTrainer(model, toy_sentiment_corpus(regression=True), cache_dir=tmp_path).train(progress=False,
                                                                                                 **FAST)
    assert set(result.best_metrics) == {"eval_loss", "eval_spearmanr", "eval_pearsonr"}
    assert all(isinstance(v, float) for v in model.predict(["great", "awful"]))


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"learning_rate": -1.0}, "learning rates must be positive"),
        ({"epochs": 0}, "epochs"),
        ({"batch_size": "big"}, "batch_size"),
        ({"learnig_rate": 1e-3}, "learnig_rate"),
        ({"frozen_prefix_cache": "sometimes"}, "frozen_prefix_cache"),
    ],
)
def test_bad_training_arguments_fail_before_training(tiny_bert, toy_corpus, tmp_path, arguments, message):
    trainer = ModelTrainer(build(tiny_bert, 1), toy_corpus, cache_dir=tmp_path)
    with pytest.raises(ValueError, match=message):
        trainer.train(tmp_path / "run", progress=False, **arguments)
    assert not (tmp_path / "run").exists()


def test_interrupted_training_leaves_no_output(tiny_bert, toy_corpus, tmp_path, monkeypatch):
    trainer = ModelTrainer(build(tiny_bert, 1), toy_corpus, cache_dir=tmp_path / "cache")

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(trainer, "evaluate", interrupted)
    with pytest.raises(KeyboardInterrupt):
        trainer.train(tmp_path / "run", progress=False, **FAST)
    assert not (tmp_path / "run").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".run")]


def test_model_and_corpus_must_fit(tiny_bert, toy_corpus):
    with pytest.raises(ValueError, match="3 classes"):
        ModelTrainer(TextClassifier(LanguageModel(tiny_bert, 0), 3), toy_corpus)
    with pytest.raises(ValueError, match="regression"):
        ModelTrainer(TextRegressor(LanguageModel(tiny_bert, 0)), toy_corpus)


def test_optimizer_is_fused_adamw_except_under_fp16():
    from layertune.trainer import _adamw

    groups = [{"params": [torch.nn.Parameter(torch.zeros(3))], "lr": 1e-3, "weight_decay": 0.0}]
    assert _adamw(groups).defaults["fused"] is True  # Trainer's default kernel: one update for all tensors
    assert not _adamw(groups, fused=False).defaults["fused"]  # fp16: accelerate must see skipped steps
