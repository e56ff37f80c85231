"""Tuning methods (top-K, LoRA, IA3, BitFit): each trains what it should (peft's own figures), the frozen-prefix cache
stays exact for the top-K variants, saved adapters reload, merged weights predict the same, bad settings fail first."""

import copy
import json
import re

import pytest
import safetensors.torch
import torch
import transformers
from peft import IA3Config, LoraConfig, get_peft_model
from peft.tuners.tuners_utils import BaseTunerLayer
from peft.utils import constants
from pydantic import ValidationError
from torch import nn

from layertune import (
    IA3,
    BitFit,
    LanguageModel,
    Lora,
    ModelTrainer,
    TaskModel,
    TextClassifier,
    TopK,
)
from layertune.specs import CellSpec, EncoderSpec
from layertune.cli import main
from layertune.errors import describe_validation_error
from layertune.frozen_prefix import FrozenPrefixCache
from layertune.tokenization import tokenize_corpus
from layertune.training_config import cache_decision
from layertune.tuning_methods import METHODS, tuning_method
from tests.conftest import ARCHITECTURES, device_of, outputs, toy_sentiment_corpus
from tests.test_cli import data_folder

MINILM = "sentence-transformers/all-MiniLM-L6-v2"
# The tiny architectures peft has no default LoRA modules for: their query and value projections, named.
OWN_LORA_TARGETS = {"distilbert": ["q_lin", "v_lin"], "mpnet": ["q", "v"]}
IA3_ARCHITECTURES = [a for a in ARCHITECTURES if a in constants.TRANSFORMERS_MODELS_TO_IA3_TARGET_MODULES_MAPPING]
TEXTS = ["the movie was great", "awful plot", "a fun , dull story !", "i love this film"]


def trainable(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters() if p.requires_grad)


def total(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def peft_figures(path, config) -> tuple[int, int]:
    """What peft's own recipe reports (`print_trainable_parameters`' figures) for the plain model and ``config``."""
    return get_peft_model(transformers.AutoModel.from_pretrained(path), config).get_nb_trainable_parameters()


def layer_of(lm: LanguageModel, name: str) -> int:
    return int(lm.parameter_parts()[name].removeprefix("layer."))


def logits(model: TaskModel, texts=TEXTS) -> torch.Tensor:
    model.eval()
    return outputs(model, model.encoder.tokenize(texts))


# ------------------------------------------------------------------------------------------ what trains


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_lora_trains_what_peft_counts_on_all_layers_and_on_the_top_k(tiny_model_dirs, architecture):
    path, targets = tiny_model_dirs[architecture], OWN_LORA_TARGETS.get(architecture)
    everywhere = LanguageModel(path, method=Lora(r=4, alpha=8, target_modules=targets))
    assert (trainable(everywhere), total(everywhere)) == peft_figures(
        path, LoraConfig(r=4, lora_alpha=8, target_modules=targets))

    top = LanguageModel(path, tunable_layers=2, method=Lora(r=4, alpha=8, target_modules=targets))
    assert (trainable(top), total(top)) == peft_figures(
        path, LoraConfig(r=4, lora_alpha=8, target_modules=targets, layers_to_transform=[2, 3], layers_pattern="layer"))
    adapted = [name for name, p in top.named_parameters() if p.requires_grad]
    assert adapted and all("lora_" in name for name in adapted)
    assert {layer_of(top, name) for name in adapted} == {2, 3}  # the top two of four layers, each of them
    # rank 4 on two 32x32 projections per layer: 2 layers x 2 modules x 4 x (32 + 32)
    assert trainable(top) == 2 * 2 * 4 * (32 + 32) and trainable(everywhere) == 2 * trainable(top)


@pytest.mark.parametrize("architecture", IA3_ARCHITECTURES)
def test_ia3_trains_what_peft_counts_on_all_layers_and_on_the_top_k(tiny_model_dirs, architecture):
    path = tiny_model_dirs[architecture]
    everywhere = LanguageModel(path, method="ia3")
    assert (trainable(everywhere), total(everywhere)) == peft_figures(path, IA3Config())

    top = LanguageModel(path, tunable_layers=2, method=IA3())
    # IA3Config has no layers_to_transform: peft's recipe restricts it with a regular expression.
    modules = "|".join(map(re.escape, constants.TRANSFORMERS_MODELS_TO_IA3_TARGET_MODULES_MAPPING[architecture]))
    restricted = IA3Config(target_modules=rf".*\.layer\.(2|3)\.(.*\.)?({modules})", feedforward_modules=r".*output\.dense")
    assert (trainable(top), total(top)) == peft_figures(path, restricted)
    adapted = [name for name, p in top.named_parameters() if p.requires_grad]
    assert adapted and all("ia3_" in name for name in adapted)
    assert {layer_of(top, name) for name in adapted} == {2, 3}


@pytest.mark.parametrize("architecture", ARCHITECTURES)
@pytest.mark.parametrize("tunable_layers", [1, "all"])
def test_bitfit_trains_the_biases_of_the_tuned_layers_only(tiny_model_dirs, architecture, tunable_layers):
    lm = LanguageModel(tiny_model_dirs[architecture], tunable_layers=tunable_layers, method="bitfit")
    pooler = {f"model.pooler.{name}" for name, _ in (lm.pooler.named_parameters() if lm.pooler else ())}
    biases = {name: p.numel() for name, p in lm.named_parameters() if name.endswith(".bias") and name not in pooler}
    if tunable_layers == 1:
        biases = {name: n for name, n in biases.items() if lm.parameter_parts()[name] == "layer.3"}
    assert {name for name, p in lm.named_parameters() if p.requires_grad} == set(biases)
    assert trainable(lm) == sum(biases.values()) > 0
    if tunable_layers == "all":
        assert any(lm.parameter_parts()[name] == "embeddings" for name in biases)  # the embeddings' biases too


def test_the_pooler_follows_the_method(tiny_bert):
    """pooling='pooler': top-K trains it whole, BitFit its bias; LoRA and IA3 leave it frozen, as peft's recipe (whose
    modules_to_save is the task head) does."""
    def pooler_trains(method):
        lm = LanguageModel(tiny_bert, tunable_layers=2, method=method, pooling="pooler")
        return {name for name, p in lm.pooler.named_parameters() if p.requires_grad}

    assert pooler_trains("top_k") == {"dense.weight", "dense.bias"}
    assert pooler_trains("bitfit") == {"dense.bias"}
    assert pooler_trains("lora") == pooler_trains("ia3") == set()


def test_a_method_by_name_is_the_method_with_its_defaults_and_saves_as_a_mapping():
    assert tuning_method("lora") == Lora() == Lora(r=8, alpha=16, dropout=0.1)
    assert tuning_method({"name": "ia3"}) == IA3() and tuning_method("bitfit") == BitFit()
    assert tuning_method(Lora(r=2).model_dump()) == Lora(r=2)
    spec = EncoderSpec(model="m", tunable_layers=2, method="lora")
    assert EncoderSpec.model_validate_json(spec.model_dump_json()) == spec and spec.method == Lora()
    assert EncoderSpec(model="m").method == TopK()


def test_full_fine_tuning_is_still_the_default(tiny_bert):
    lm = LanguageModel(tiny_bert)
    assert lm.method == TopK() and lm.tunable_layers == "all" and trainable(lm) == total(lm) - total(lm.pooler)
    assert EncoderSpec.of(lm).method == TopK()


# ------------------------------------------------------------------------------------------ the cache


def record_steps(monkeypatch) -> list[float]:
    steps = []
    train_epoch = ModelTrainer._train_epoch
    monkeypatch.setattr(ModelTrainer, "_train_epoch", lambda self, *a: steps.extend(out := train_epoch(self, *a)) or out)
    return steps


def train_toy(path, method, tunable_layers, tmp_path, frozen_prefix_cache="auto", epochs=2):
    transformers.set_seed(1)
    model = TextClassifier(LanguageModel(path, tunable_layers=tunable_layers, method=method, pooling="mean",
                                         hidden_dropout_prob=0.1), 2, label_names=["negative", "positive"])
    result = ModelTrainer(model, toy_sentiment_corpus(48, 16), cache_dir=tmp_path / "cache").train(
        seed=1, epochs=epochs, batch_size=8, learning_rate=1e-2, frozen_prefix_cache=frozen_prefix_cache,
        mixed_precision="no", progress=False)  # float32: cached and plain runs compared to 1e-5 on any device
    return model, result


@pytest.mark.parametrize("method", ["lora", "ia3", "bitfit"])
@pytest.mark.parametrize("architecture", ["bert", "deberta-v2", "roberta"])
def test_top_k_methods_train_alike_from_cached_states_and_without(tiny_model_dirs, tmp_path, monkeypatch, method,
                                                                  architecture):
    path = tiny_model_dirs[architecture]
    steps = record_steps(monkeypatch)
    cached_model, cached = train_toy(path, method, 2, tmp_path, True)
    cached_steps = list(steps)
    steps.clear()
    _, plain = train_toy(path, method, 2, tmp_path, False)
    assert cached.frozen_prefix_cache["used"] and cached.frozen_prefix_cache["boundary"] == 2
    assert not plain.frozen_prefix_cache["used"]
    assert len(cached_steps) == len(steps) == 12
    torch.testing.assert_close(torch.tensor(steps), torch.tensor(cached_steps), rtol=1e-5, atol=0)
    for before, after in zip(cached.history, plain.history):
        assert after["eval_loss"] == pytest.approx(before["eval_loss"], rel=1e-5)
    assert plain.predictions == cached.predictions
    # The bottom of the network never moved: the cache stays valid, and the trained tensors are the top's.
    base = LanguageModel(path, method="top_k").state_dict()
    for name, tensor in cached_model.encoder.state_dict().items():
        if name in base and not name.startswith(("model.encoder.layer.2.", "model.encoder.layer.3.")):
            assert torch.equal(tensor.cpu(), base[name]), name  # on the CPU: the run may have used a GPU
    assert set(cached.drift.query("mean_abs_change > 0")["part"]) <= {"layer.2", "layer.3", "head"}


def test_the_states_below_the_top_k_are_the_same_cache_entry_for_every_method(tiny_bert, tmp_path):
    tokenized = tokenize_corpus(toy_sentiment_corpus(8, 4), LanguageModel(tiny_bert).tokenizer)["train"]
    cache = FrozenPrefixCache(tmp_path, progress=False)
    keys = {method: cache.key(LanguageModel(tiny_bert, 2, method=method), tokenized, 2) for method in METHODS}
    assert len(set(keys.values())) == 1, keys


@pytest.mark.parametrize("method", ["lora", "ia3", "bitfit"])
def test_a_method_on_every_layer_has_nothing_to_cache_and_says_why(tiny_bert, tmp_path, method):
    lm = LanguageModel(tiny_bert, method=method)
    assert lm.frozen_prefix_layers is None
    used, reason = cache_decision(lm.frozen_prefix_layers, lm.frozen_dropout, "auto", method=method)
    assert not used and f"{method} changes every layer (tunable_layers='all')" in reason and "top K" in reason
    with pytest.raises(ValueError, match=r"frozen_prefix_cache=True cannot be honoured: .* no layer's output is fixed"):
        cache_decision(None, False, True, method=method)
    if method != "bitfit":  # LoRA and IA3 leave the embeddings alone: they run as constants (eval mode)
        assert lm.frozen_modules() == [lm.embeddings]


# ------------------------------------------------------------------------------------------ saving, merging


@pytest.mark.parametrize("method", ["lora", "ia3", "bitfit"])
@pytest.mark.parametrize("tunable_layers", [2, "all"])
def test_a_saved_model_stores_what_it_trained_and_reloads_to_the_same_predictions(tiny_bert, tmp_path, method,
                                                                                   tunable_layers):
    model, _ = train_toy(tiny_bert, method, tunable_layers, tmp_path, epochs=1)
    model.save(tmp_path / "model")
    stored = safetensors.torch.load_file(tmp_path / "model" / "model.safetensors")
    assert set(stored) == {name for name, p in model.named_parameters() if p.requires_grad}
    if method != "bitfit":
        assert all(f"{method}_" in name or name.startswith("head.") for name in stored)
    config = json.loads((tmp_path / "model" / "config.json").read_text())
    assert config["encoders"][0]["method"] == tuning_method(method).model_dump(mode="json")
    assert config["weights"]["base"]["frozen_xxh3"]  # the frozen rest: the base model's, by name and content hash
    assert not (tmp_path / "model" / "encoder" / "tokenizer.json").exists()

    loaded = TaskModel.from_pretrained(tmp_path / "model").to(device_of(model))  # compared where it trained
    assert loaded.encoder.method == tuning_method(method) and trainable(loaded) == trainable(model)
    assert torch.equal(logits(loaded), logits(model))
    assert loaded.predict(TEXTS) == model.predict(TEXTS)


@pytest.mark.parametrize("method", ["lora", "ia3", "bitfit"])
@pytest.mark.parametrize("tunable_layers", [2, "all"])
def test_merged_weights_predict_the_same_without_peft_and_save_as_a_top_k_model(tiny_bert, tmp_path, method,
                                                                               tunable_layers):
    model, _ = train_toy(tiny_bert, method, tunable_layers, tmp_path, epochs=1)
    merged = copy.deepcopy(model).merge()
    assert merged.encoder.method == TopK() and merged.encoder.tunable_layers == tunable_layers
    assert not any(isinstance(m, BaseTunerLayer) for m in merged.modules())
    assert type(merged.encoder.layers[3].attention.self.value) is nn.Linear
    assert any(isinstance(m, BaseTunerLayer) for m in model.modules()) == (method != "bitfit")  # the copy merged
    torch.testing.assert_close(logits(merged), logits(model), atol=1e-5, rtol=0)

    merged.save(tmp_path / "merged")
    stored = safetensors.torch.load_file(tmp_path / "merged" / "model.safetensors")
    if tunable_layers == 2:  # the top two layers in plain weights, and the head; the rest is the base model's
        parts = merged.parameter_parts()
        assert {parts[name] for name in stored} == {"layer.2", "layer.3", "head"}
    reloaded = TaskModel.from_pretrained(tmp_path / "merged").to(device_of(merged))
    assert torch.equal(logits(reloaded), logits(merged))

    # Plain Hugging Face weights: transformers alone loads the merged encoder and computes the same states.
    merged.encoder.model.save_pretrained(tmp_path / "hf")
    plain = transformers.AutoModel.from_pretrained(tmp_path / "hf").eval().to(device_of(merged))
    batch = {k: v.to(device_of(merged)) for k, v in merged.encoder.tokenize(TEXTS).items()}
    with torch.no_grad():
        torch.testing.assert_close(plain(**batch).last_hidden_state, merged.encoder.model(**batch).last_hidden_state)


# ------------------------------------------------------------------------------------------ bad settings


@pytest.fixture
def no_loading(monkeypatch):
    """Loading a model fails the test: what is refused must be refused before it."""
    monkeypatch.setattr(transformers.AutoModel, "from_pretrained", lambda *a, **k: pytest.fail("model loaded"))


@pytest.mark.parametrize("arguments, message", [
    ({"method": "lorra"}, ("method: unknown tuning method 'lorra'. Did you mean 'lora'? Valid choices: top_k, lora, "
                           "ia3, bitfit.")),
    ({"method": {"name": "lora", "r": 0}}, "method.r: Input should be greater than 0 (got 0)"),
    ({"method": {"name": "lora", "rank": 4}}, "method.rank: unknown key."),
    ({"method": {"r": 4}}, "a tuning method needs its name"),
    ({"method": {"name": "ia3", "target_modules": ["key"], "feedforward_modules": ["value"]}},
     "feedforward_modules ['value'] are not in target_modules ['key']"),
    ({"method": "lora", "tunable_layers": 0}, ("tunable_layers=0 with method 'lora': lora adapts the tuned layers, "
                                               "and 0 tunes none. Use tunable_layers >= 1 or 'all' with lora, or "
                                               "method 'top_k' with tunable_layers=0")),
])
def test_bad_settings_fail_before_the_model_loads_naming_the_key(no_loading, arguments, message):
    with pytest.raises(ValueError) as error:
        LanguageModel("any/model", **{"tunable_layers": 2, **arguments})
    assert message in str(error.value)


def test_method_settings_that_do_not_fit_the_model_fail_before_its_weights_load(tiny_model_dirs, no_loading):
    """Target modules, IA3's feed-forward modules and LoRA's rank, checked on the model's structure from its config
    (tiny bert: 32 wide, feed-forward 64): the same error the plan gives, before any weight is read."""
    bert = tiny_model_dirs["bert"]
    with pytest.raises(ValueError, match=r"method.target_modules: 'qury' is not a linear module of .*layers .* Did you "
                                         r"mean 'query'\? Valid choices: .*attention.self.query"):
        LanguageModel(bert, 2, method=Lora(target_modules=["query", "qury"]))
    with pytest.raises(ValueError, match=r"method.target_modules: peft has no default lora modules for model type "
                                         r"'distilbert' .* Valid choices: .*q_lin"):
        LanguageModel(tiny_model_dirs["distilbert"], 2, method="lora")
    with pytest.raises(ValueError, match=r"method.r: 33 is above the smaller side of target module "
                                         r"'attention.self.query' .*\(32 x 32\).* Give r <= 32."):
        LanguageModel(bert, 2, method=Lora(r=33))
    with pytest.raises(ValueError, match=r"method.r: 40 .* target module 'intermediate.dense' .*\(32 x 64\)"):
        LanguageModel(bert, 2, method=Lora(r=40, target_modules=["intermediate.dense"]))
    with pytest.raises(ValueError, match=r"method.feedforward_modules: 'query' is not among the target modules of "
                                         r".* \('key', 'value', 'output.dense'\)"):
        LanguageModel(bert, 2, method=IA3(feedforward_modules=["query"]))
    config = json.loads((bert / "config.json").read_text())  # the config alone: no weights, no model folder
    Lora(r=32).check_model(config)  # the smaller side itself is a valid rank
    IA3(feedforward_modules=["output.dense"]).check_model(config)
    with pytest.raises(ValueError, match="method.target_modules: 'nonexistent' is not a linear module of the model"):
        Lora(target_modules=["nonexistent"]).check_model(config)


def test_a_passed_check_is_remembered_so_the_next_process_builds_nothing(tiny_model_dirs, tmp_path, monkeypatch):
    """The plan checks a study's methods at every `dvc repro`: once a check passed, the same check in a new process
    imports neither torch nor the model's code. A check that failed is not remembered, nor one of another rank."""
    import subprocess
    import sys

    monkeypatch.setenv("LAYERTUNE_CACHE", str(tmp_path))
    config = json.loads((tiny_model_dirs["bert"] / "config.json").read_text())
    Lora(r=8).check_model(config)
    assert len(list((tmp_path / "checks").iterdir())) == 1
    check = ("import json, sys; from layertune.tuning_methods import Lora; "
             f"Lora(r=8).check_model(json.loads({json.dumps(json.dumps(config))})); print('torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True)
    assert done.stdout.strip() == "False", done.stderr  # remembered: nothing built
    Lora(r=4).check_model(config)  # another setting is checked, and remembered
    for _ in range(2):  # above the layer's smaller side (32): refused each time
        with pytest.raises(ValueError, match="method.r: 33 is above the smaller side"):
            Lora(r=33).check_model(config)
    assert len(list((tmp_path / "checks").iterdir())) == 2


def test_a_model_whose_code_ships_with_it_is_checked_when_it_loads(tiny_model_dirs):
    """Its structure cannot be built without running its code: the plan-time check passes it on, runs nothing."""
    config = {**json.loads((tiny_model_dirs["bert"] / "config.json").read_text()), "model_type": "my-own-bert",
              "auto_map": {"AutoModel": "modeling.MyBert"}}
    Lora(target_modules=["nonexistent"]).check_model(config)


def test_a_method_that_needs_the_layers_count_is_refused_once_it_is_known(tiny_model_dirs):
    with pytest.raises(ValueError, match="tunable_layers=0 with method 'bitfit'"):
        LanguageModel(tiny_model_dirs["bert"], frozen_layers=4, method="bitfit")


def validation_lines(spec: dict) -> list[str]:
    with pytest.raises(ValidationError) as error:
        CellSpec.model_validate(spec)
    return describe_validation_error(error.value, schema=CellSpec)


def test_a_cell_spec_checks_its_method_with_the_key_named():
    def cell(**encoder):
        return {"corpus": {"task": "sst2"}, "encoders": [{"model": "m", "tunable_layers": 2, **encoder}]}

    assert validation_lines(cell(method="lorra"))[0].startswith(
        "encoders[0].method: unknown tuning method 'lorra'. Did you mean 'lora'?")
    assert validation_lines(cell(method={"name": "lora", "r": 0})) == [
        "encoders[0].method.r: Input should be greater than 0 (got 0)"]
    assert validation_lines(cell(method={"name": "lora", "dropout": 1.5})) == [
        "encoders[0].method.dropout: Input should be less than 1 (got 1.5)"]
    assert "tunable_layers=0 with method 'ia3'" in validation_lines(cell(method="ia3", tunable_layers=0))[0]
    assert CellSpec.model_validate(cell(method={"name": "lora", "r": 4})).encoders[0].method == Lora(r=4)


def test_train_cell_takes_a_method_by_name_or_with_settings(tiny_bert, tmp_path, capsys):
    common = ["train-cell", "--path", data_folder(tmp_path), "--model", str(tiny_bert), "--tunable-layers", "2",
              "--epochs", "1", "--batch-size", "8", "--cache-dir", str(tmp_path / "cache"),
              "--frozen-prefix-cache", "true"]  # LoRA on the top 2 reads the cache ("auto" weighs whether it pays)
    assert main([*common, "--method", "{name: lora, r: 2, target_modules: [query, value]}",
                 "--output-dir", str(tmp_path / "cell")]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["frozen_prefix_cache_used"] is True
    spec = CellSpec.model_validate_json((tmp_path / "cell" / "cell.json").read_text())
    assert spec.encoders[0].method == Lora(r=2, target_modules=["query", "value"])
    assert summary["trainable_parameters"] == 2 * 2 * 2 * (32 + 32) + 33 * 2  # adapters, and the head
    assert TaskModel.from_pretrained(tmp_path / "cell" / "model").encoder.method == spec.encoders[0].method

    assert main([*common, "--method", "{name: lora, r: 0}", "--output-dir", str(tmp_path / "bad")]) == 2
    assert "--method: r: Input should be greater than 0 (got 0)" in capsys.readouterr().err
    assert main([*common, "--method", "bitfit", "--tunable-layers", "0", "--output-dir", str(tmp_path / "bad")]) == 2
    assert "tunable_layers=0 with method 'bitfit'" in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()


# ------------------------------------------------------------------------------------------ a real model


@pytest.mark.integration
def test_real_minilm_learns_sst2_with_lora_on_the_top_layers_from_cached_states(data_mirror, tmp_path):
    from layertune import load_corpus

    corpus = load_corpus("sst2", data_mirror=data_mirror, train_size=400, dev_size=300, seed=0)
    transformers.set_seed(0)
    model = TextClassifier(LanguageModel(MINILM, tunable_layers=2, method=Lora(r=8), pooling="mean"), 2)
    result = ModelTrainer(model, corpus, cache_dir=tmp_path).train(
        learning_rate=3e-3, epochs=2, batch_size=16, seed=0, progress=False)
    assert result.frozen_prefix_cache["used"] and result.frozen_prefix_cache["boundary"] == 4
    # rank 8 on the 384x384 query and value projections of two layers, and the head
    assert result.trainable_parameters == 2 * 2 * 8 * (384 + 384) + 385 * 2
    assert result.best_metrics["eval_accuracy"] > 0.70, result.history
    model.save(tmp_path / "model")
    assert TaskModel.from_pretrained(tmp_path / "model").predict(TEXTS) == model.predict(TEXTS)
