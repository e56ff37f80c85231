"""Training until it stops improving: the validation slice carved from train picks the epoch and stops the run, dev
is scored once with the weights kept; precision decided by the CPU; the linear probe a head-only cell must reach."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from tests.conftest import toy_sentiment_corpus
from layertune import LanguageModel, ModelTrainer, TextClassifier, TextRegressor
from layertune.corpora import load_corpus
from layertune.trainer import Selection
from layertune.training_config import TrainingConfig, autocast_context, cpu_has_native_bf16, resolve_mixed_precision

FAST = dict(batch_size=8, learning_rate=1e-3, seed=3, frozen_prefix_cache=False, mixed_precision="no")


def with_validation(corpus, size: int = 24):
    """``corpus`` with its first ``size`` training examples as the validation slice."""
    return dataclasses.replace(corpus, validation=corpus.train.select(range(size)),
                               train=corpus.train.select(range(size, len(corpus.train))))


def contrary(corpus):
    """``corpus`` whose validation labels say the opposite of train's rule: the better the model learns train, the
    worse it scores there, so the validation slice peaks at the first epoch and declines (an overfit, by design)."""
    return dataclasses.replace(corpus, validation=corpus.validation.map(lambda row: {"label": 1 - row["label"]}))


def classifier(model_dir, tunable_layers=1):
    return TextClassifier(LanguageModel(model_dir, tunable_layers=tunable_layers), 2,
                          label_names=["negative", "positive"])


def scored_splits(trainer: ModelTrainer, monkeypatch) -> list[int]:
    """Records the size of every split `evaluate` scores, in order."""
    sizes, evaluate = [], trainer.evaluate

    def spy(loader, accelerator):
        sizes.append(len(loader.dataset))
        return evaluate(loader, accelerator)

    monkeypatch.setattr(trainer, "evaluate", spy)
    return sizes


def test_validation_slice_picks_the_epoch_and_dev_is_scored_once_after(tiny_bert, tmp_path, monkeypatch):
    corpus = with_validation(toy_sentiment_corpus(64, 40), 24)  # validation 24, dev 40: told apart by size
    trainer = ModelTrainer(classifier(tiny_bert), corpus, cache_dir=tmp_path)
    sizes = scored_splits(trainer, monkeypatch)
    result = trainer.train(progress=False, epochs=4, **FAST)
    assert sizes == [24, 24, 24, 24, 40]  # the slice after every epoch, dev once, at the end
    assert all("validation_accuracy" in record and "eval_accuracy" not in record for record in result.history)
    assert result.selection_split == "validation" and result.selection_metric == "validation_accuracy"
    assert result.best_metrics.keys() == {"eval_loss", "eval_accuracy"}  # dev's scores, of the weights kept
    assert len(result.predictions["dev"]["predictions"]) == 40


def test_the_weights_kept_are_the_best_validation_epochs(tiny_bert, tmp_path):
    """Dev set to the validation examples themselves: dev's score after training is the kept epoch's validation
    score to the last bit, the best epoch's (and the last epoch's with load_best_model_at_end=False)."""
    corpus = contrary(with_validation(toy_sentiment_corpus(64, 8), 24))
    corpus = dataclasses.replace(corpus, dev=corpus.validation)
    for keep_best in (True, False):
        model = classifier(tiny_bert, "all")
        result = ModelTrainer(model, corpus, cache_dir=tmp_path).train(
            progress=False, epochs=6, metric_for_best_model="loss", load_best_model_at_end=keep_best,
            **{**FAST, "learning_rate": 3e-3})
        losses = [record["validation_loss"] for record in result.history]
        kept = losses.index(min(losses)) if keep_best else len(losses) - 1
        assert result.best_epoch == kept + 1
        assert result.best_metrics["eval_loss"] == losses[kept]
    assert losses.index(min(losses)) != len(losses) - 1, "the toy run should overfit: best != last"


def test_early_stopping_stops_after_the_patience(tiny_bert, tmp_path):
    corpus = contrary(with_validation(toy_sentiment_corpus(64, 8), 24))
    result = ModelTrainer(classifier(tiny_bert, "all"), corpus, cache_dir=tmp_path).train(
        progress=False, epochs=30, early_stopping_patience=2, metric_for_best_model="loss",
        **{**FAST, "learning_rate": 3e-3})
    losses = [record["validation_loss"] for record in result.history]
    assert result.stopped_by == "early_stopping" and result.epochs_trained == len(result.history) < 30
    assert result.epochs_trained == result.best_epoch + 2  # two epochs without improvement, then stop
    assert min(losses[result.best_epoch:]) >= losses[result.best_epoch - 1]
    assert result.summary()["stopped_by"] == "early_stopping"


def test_a_run_that_never_stops_improving_is_stopped_by_the_maximum(tiny_bert, tmp_path):
    corpus = with_validation(toy_sentiment_corpus(64, 8), 24)
    result = ModelTrainer(classifier(tiny_bert), corpus, cache_dir=tmp_path).train(
        progress=False, epochs=2, early_stopping_patience=5, **FAST)
    assert result.stopped_by == "max_epochs" and result.epochs_trained == 2


def test_stopping_without_a_validation_slice_or_on_an_unknown_metric_fails_before_training(tiny_bert, tmp_path):
    trainer = ModelTrainer(classifier(tiny_bert), toy_sentiment_corpus(), cache_dir=tmp_path)
    with pytest.raises(ValueError, match=r"early_stopping_patience=2 stops on a validation slice .* validation_size"):
        trainer.train(progress=False, early_stopping_patience=2, **FAST)
    corpus = with_validation(toy_sentiment_corpus())
    with pytest.raises(ValueError, match=r"metric_for_best_model='f1x' is not a metric of 'toy'.*Valid choices: "
                                         r"loss, accuracy"):
        ModelTrainer(classifier(tiny_bert), corpus).train(progress=False, metric_for_best_model="f1x", **FAST)
    with pytest.raises(ValueError, match="eval_strategy must be 'epoch'"):
        TrainingConfig(early_stopping_patience=2, eval_strategy="end")


def test_selection_names_and_directions():
    corpus = with_validation(toy_sentiment_corpus())
    accuracy = Selection.of(TrainingConfig(metric_for_best_model="eval_accuracy"), corpus)
    assert (accuracy.split, accuracy.key) == ("validation", "validation_accuracy")
    assert accuracy.improves({"validation_accuracy": 0.6}, {"validation_accuracy": 0.5})
    assert not accuracy.improves({"validation_accuracy": 0.5}, {"validation_accuracy": 0.5})  # strictly better
    loss = Selection.of(TrainingConfig(metric_for_best_model="loss"), toy_sentiment_corpus())
    assert (loss.split, loss.key) == ("dev", "eval_loss")  # no slice: dev, as before slices existed
    assert loss.improves({"eval_loss": 0.4}, {"eval_loss": 0.5})


def test_a_nan_validation_score_is_never_the_best_even_at_the_first_epoch(tiny_bert, tmp_path, monkeypatch):
    """A NaN score (Spearman's of constant predictions) compared as a number was kept as the best when it came
    first: nothing beats NaN, so the run ended on the first epoch's weights however much it learned after."""
    nan = float("nan")
    accuracy = Selection.of(TrainingConfig(), with_validation(toy_sentiment_corpus()))
    assert accuracy.improves({"validation_accuracy": 0.1}, {"validation_accuracy": nan})
    assert not accuracy.improves({"validation_accuracy": nan}, {"validation_accuracy": 0.1})
    assert not accuracy.improves({"validation_accuracy": nan}, {"validation_accuracy": nan})

    corpus = with_validation(toy_sentiment_corpus(64, 8), 24)
    trainer = ModelTrainer(classifier(tiny_bert), corpus, cache_dir=tmp_path)
    scripted, evaluate = iter([nan, 0.6, 0.7, 0.65, 0.5]), trainer.evaluate

    def scored(loader, accelerator):  # the validation slice's accuracy as scripted; dev's as it is
        scores, predictions = evaluate(loader, accelerator)
        return ({**scores, "eval_accuracy": next(scripted)} if len(loader.dataset) == 24 else scores), predictions

    monkeypatch.setattr(trainer, "evaluate", scored)
    result = trainer.train(progress=False, epochs=5, early_stopping_patience=2, **FAST)
    assert (result.best_epoch, result.epochs_trained, result.stopped_by) == (3, 5, "early_stopping")


def test_a_regressor_starts_from_the_mean_training_target(tiny_bert):
    corpus = toy_sentiment_corpus(regression=True)
    model = TextRegressor(LanguageModel(tiny_bert, tunable_layers=0))
    model.begin_training(0, targets=corpus.train["label"])
    mean = sum(corpus.train["label"]) / len(corpus.train)
    assert model.head[-1].bias.item() == pytest.approx(mean)
    assert mean == pytest.approx(2.5)  # not 0, where the head would start without it


def test_load_corpus_carves_the_same_stratified_validation_slice_whatever_the_train_size(data_mirror):
    small = load_corpus("sst2", train_size=200, validation_size=100, seed=42, data_mirror=data_mirror)
    large = load_corpus("sst2", train_size=400, validation_size=100, seed=42, data_mirror=data_mirror)
    assert small.validation["sentence"] == large.validation["sentence"]
    full = load_corpus("sst2", seed=42, data_mirror=data_mirror)
    assert not set(small.validation["sentence"]) & set(large.train["sentence"])  # never trained on
    assert not set(small.validation["sentence"]) & set(full.dev["sentence"])  # never dev
    share = sum(small.validation["label"]) / 100
    assert abs(share - sum(full.train["label"]) / len(full.train)) < 0.01  # stratified by label
    with pytest.raises(ValueError, match=r"validation_size must be a positive int or None, not 0"):
        load_corpus("sst2", validation_size=0, data_mirror=data_mirror)


# ----------------------------------------------------------------------------------------------- precision


@pytest.mark.parametrize("native", [True, False])
def test_auto_computes_in_bfloat16_only_on_a_cpu_that_has_it(monkeypatch, native):
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: native)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    assert cpu_has_native_bf16() is native
    assert resolve_mixed_precision("auto", "cpu") == ("bf16" if native else "no")
    assert resolve_mixed_precision("no", "cpu") == "no"
    if native:
        assert resolve_mixed_precision("bf16", "cpu") == "bf16"
    else:
        with pytest.raises(ValueError, match="this CPU has no native bfloat16"):
            resolve_mixed_precision("bf16", "cpu")


def test_amx_alone_counts_as_native_bfloat16(monkeypatch):
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    assert resolve_mixed_precision("auto", "cpu") == "bf16"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's precision; a GPU decides by its own")
def test_a_cells_record_names_the_precision_it_trained_in(tiny_bert, tmp_path, monkeypatch):
    corpus = with_validation(toy_sentiment_corpus(32, 8), 8)
    for native, expected in ((False, "no"), (True, "bf16")):
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: native)
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
        ModelTrainer(classifier(tiny_bert), corpus, cache_dir=tmp_path).train(
            tmp_path / expected, progress=False, epochs=1, **{**FAST, "mixed_precision": "auto"})
        assert json.loads((tmp_path / expected / "metrics.json").read_text())["mixed_precision"] == expected


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's attention kernels")
def test_a_bfloat16_run_on_cpu_attends_with_the_math_kernel_and_a_float32_run_as_torch_chooses(tiny_bert, tmp_path,
                                                                                                monkeypatch):
    """The fused CPU kernel's bf16 backward is ~10x slower than its float32 one: a bf16 run uses the math kernel in
    every forward (training and scoring alike, as the frozen-prefix pass); a float32 run keeps the fused kernel."""
    seen = []  # (precision, whether gradients flow, whether the fused kernel may run) at each attention call
    attend = torch.nn.functional.scaled_dot_product_attention

    def spy(*args, **kwargs):
        seen.append((precision, torch.is_grad_enabled(), torch.backends.cuda.flash_sdp_enabled()))
        return attend(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True)
    corpus = with_validation(toy_sentiment_corpus(32, 8), 8)
    for precision in ("bf16", "no"):
        ModelTrainer(classifier(tiny_bert, "all"), corpus, cache_dir=tmp_path).train(
            progress=False, epochs=1, **{**FAST, "mixed_precision": precision})
    assert set(seen) == {("bf16", True, False), ("bf16", False, False), ("no", True, True), ("no", False, True)}
    assert torch.backends.cuda.flash_sdp_enabled()  # left as it was


def test_every_forward_of_a_bfloat16_run_on_cpu_runs_under_autocast_and_the_math_kernel():
    """What the frozen-prefix pass, the probes and the trainer compute under (`autocast_context`)."""
    cpu = torch.device("cpu")
    with autocast_context(cpu, torch.bfloat16):
        assert torch.is_autocast_enabled("cpu") and not torch.backends.cuda.flash_sdp_enabled()
    with autocast_context(cpu, None):
        assert not torch.is_autocast_enabled("cpu") and torch.backends.cuda.flash_sdp_enabled()
    assert not torch.is_autocast_enabled("cpu") and torch.backends.cuda.flash_sdp_enabled()  # left as they were


def test_eval_strategy_end_scores_the_slice_once_then_dev(tiny_bert, tmp_path, monkeypatch):
    corpus = with_validation(toy_sentiment_corpus(64, 40), 24)
    trainer = ModelTrainer(classifier(tiny_bert), corpus, cache_dir=tmp_path)
    sizes = scored_splits(trainer, monkeypatch)
    result = trainer.train(progress=False, epochs=3, eval_strategy="end", **FAST)
    assert sizes == [24, 40] and result.best_epoch == 3  # the last epoch's weights, scored once on each
    assert "validation_accuracy" in result.history[-1] and "validation_accuracy" not in result.history[0]


def test_predict_scores_dev_and_never_prepares_the_slice(tiny_bert, tmp_path, monkeypatch):
    corpus = with_validation(toy_sentiment_corpus(64, 40), 24)
    trainer = ModelTrainer(classifier(tiny_bert), corpus, cache_dir=tmp_path)
    trainer.train(progress=False, epochs=1, **FAST)
    prepared = []
    encoder = trainer.model.encoder
    original = encoder.prepare_examples

    def spy(prepared_corpus, *args, **kwargs):
        prepared.append(prepared_corpus)
        return original(prepared_corpus, *args, **kwargs)

    monkeypatch.setattr(encoder, "prepare_examples", spy)
    predicted = trainer.predict(**FAST)
    assert list(predicted) == ["dev"] and len(predicted["dev"]["predictions"]) == 40
    assert prepared[0].validation is None
