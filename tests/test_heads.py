import json

import pytest
import safetensors.torch
import torch
import transformers

from layertune import LanguageModel, TaskModel, TextClassifier, TextRegressor, TokenClassifier


def flip_last_byte(data: bytes) -> bytes:
    return data[:-1] + bytes([data[-1] ^ 1])


@pytest.fixture
def saved(tiny_bert, tmp_path):
    transformers.set_seed(0)
    model = TextClassifier(LanguageModel(tiny_bert, tunable_layers=1), 2, label_names=["no", "yes"], head="mlp")
    return model, model.save(tmp_path / "model")


def test_round_trip_keeps_head_labels_and_outputs(saved):
    model, path = saved
    reloaded = TextClassifier.from_pretrained(path)
    assert reloaded.head_settings == model.head_settings and reloaded.label_names == ["no", "yes"]
    pairs = [("the movie", "a film"), ("great", "awful")]
    model.eval()
    assert reloaded.predict(pairs) == model.predict(pairs)
    assert set(reloaded.predict(["good"])) <= {"no", "yes"}
    batch = model.encoder.tokenize(pairs)
    torch.testing.assert_close(reloaded(batch), model(batch), rtol=0, atol=0)


def test_saved_folder_holds_no_pickle(saved):
    _, path = saved
    files = {p.name for p in path.rglob("*") if p.is_file()}
    assert "model.safetensors" in files and "config.json" in files
    assert not [f for f in files if f.endswith((".bin", ".pt", ".pkl", ".pth"))]


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda p: (p / "model.safetensors").unlink(), "missing model.safetensors"),
        (lambda p: (p / "model.safetensors").write_bytes((p / "model.safetensors").read_bytes()[:100]),
         "does not match the checksum"),
        (lambda p: (p / "model.safetensors").write_bytes(flip_last_byte((p / "model.safetensors").read_bytes())),
         "does not match the checksum"),
        (lambda p: (p / "config.json").write_text("{not json"), "config.json is corrupt"),
        (lambda p: (p / "config.json").write_text(json.dumps({"class": "Nope"})), "not a layertune model config"),
    ],
)
def test_corrupt_or_partial_saved_model_is_a_clear_error(saved, damage, message):
    _, path = saved
    damage(path)
    with pytest.raises(ValueError, match=message):
        TaskModel.from_pretrained(path)


def test_loading_the_wrong_class_is_refused(saved):
    with pytest.raises(ValueError, match="holds a TextClassifier, not a TextRegressor"):
        TextRegressor.from_pretrained(saved[1])


def test_failed_save_leaves_nothing(tiny_bert, tmp_path, monkeypatch):
    model = TextRegressor(LanguageModel(tiny_bert, tunable_layers=0))
    monkeypatch.setattr("safetensors.torch.save_file", lambda *a, **k: (_ for _ in ()).throw(OSError("disk full")))
    with pytest.raises(OSError, match="disk full"):
        model.save(tmp_path / "model")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda lm: TextClassifier(lm, 1), "num_classes must be an int >= 2"),
        (lambda lm: TextClassifier(lm, 2, head="transformer"), "Valid choices: linear, mlp"),
    ],
)
def test_bad_head_arguments(tiny_bert, build, message):
    with pytest.raises(ValueError, match=message):
        build(LanguageModel(tiny_bert, tunable_layers=0))


def test_base_class_loads_a_saved_token_classifier(tiny_bert, tmp_path):
    TokenClassifier(LanguageModel(tiny_bert, tunable_layers=1), 3, label_names=["O", "B-PER", "I-PER"]).save(
        tmp_path / "ner")
    assert type(TaskModel.from_pretrained(tmp_path / "ner")).__name__ == "TokenClassifier"


def test_predict_gives_label_names_or_ids(saved):
    model, _ = saved
    names = model.predict(["great", "awful"])
    ids = model.predict(["great", "awful"], return_ids=True)
    assert set(names) <= {"no", "yes"} and names == [["no", "yes"][i] for i in ids]


def test_predict_refuses_a_bare_string(saved):
    with pytest.raises(TypeError, match=r"not one str: wrap it in a list, e.g. predict\(\['great film'\]\)"):
        saved[0].predict("great film")


@pytest.mark.parametrize("form", ["specs", "earlier"])
@pytest.mark.parametrize("model_type", ["bert", "evil-bert"])
def test_a_saved_folder_cannot_turn_on_remote_code(saved, tmp_path, model_type, form):
    """A folder that asks for remote code (auto_map to a module beside it that would write a marker file, a trust
    flag in its own settings) never runs that module: trust comes from the caller only. A model type transformers
    knows loads with its own class; an unknown one is refused, saying why."""
    _, path = saved
    marker = tmp_path / "marker"
    (path / "encoder" / "evil.py").write_text(
        f"open({str(marker)!r}, 'w').write('ran')\n"
        "from transformers import BertConfig\nclass EvilConfig(BertConfig):\n    model_type = 'bert'\n")
    encoder_config = json.loads((path / "encoder" / "config.json").read_text())
    encoder_config.update(auto_map={"AutoConfig": "evil.EvilConfig"}, model_type=model_type)
    (path / "encoder" / "config.json").write_text(json.dumps(encoder_config))
    config = json.loads((path / "config.json").read_text())
    config["encoders"][0]["trust_remote_code"] = True
    if form == "earlier":  # the config.json of before the specs were its form: an `encoder` settings dict
        spec = config["encoders"][0]
        config = {**{k: v for k, v in config.items() if k not in ("encoders", "combine", "head", "pooling_source")},
                  **config["head"], "encoder": {
                      "name": spec["model"], "revision": None, "tunable_layers": spec["tunable_layers"],
                      "pooling": spec["pooling"], "freeze_embeddings": False, "frozen_dropout": False,
                      "trust_remote_code": True}}
    (path / "config.json").write_text(json.dumps(config))
    if model_type == "bert":
        assert TaskModel.from_pretrained(path).predict(["great"]) in (["no"], ["yes"])
    else:
        with pytest.raises(ValueError, match="needs code that ships with the model .* pass trust_remote_code=True"):
            TaskModel.from_pretrained(path)
    assert not marker.exists()


def test_a_head_only_model_stores_about_its_head(tiny_bert, tmp_path):
    model = TextClassifier(LanguageModel(tiny_bert, tunable_layers=0), 2, label_names=["no", "yes"])
    path = model.save(tmp_path / "model")
    head_bytes = sum(p.numel() * p.element_size() for p in model.head.parameters())
    assert (path / "model.safetensors").stat().st_size < head_bytes + 1024  # the head and a header
    assert sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) < head_bytes + 8192
    reloaded = TaskModel.from_pretrained(path)
    batch = model.encoder.tokenize(["the movie was great"])
    torch.testing.assert_close(reloaded(batch), model.eval()(batch), rtol=0, atol=0)


def test_full_fine_tuning_stores_everything(tiny_bert, tmp_path):
    model = TextRegressor(LanguageModel(tiny_bert, tunable_layers="all"))
    path = model.save(tmp_path / "model")
    config = json.loads((path / "config.json").read_text())
    assert config["weights"]["base"] is None and (path / "encoder" / "tokenizer.json").is_file()
    assert set(safetensors.torch.load_file(path / "model.safetensors")) == set(model.state_dict())


def test_a_different_base_model_is_refused(tiny_bert, tmp_path):
    import shutil

    from layertune.testing import make_tiny_model

    base = shutil.copytree(tiny_bert, tmp_path / "base")
    model = TextClassifier(LanguageModel(base, tunable_layers=1), 2)
    path = model.save(tmp_path / "model")
    make_tiny_model(base, "bert", seed=7)  # the same name now holds other weights
    with pytest.raises(ValueError, match="base weights found for .* differ from the ones the model .* was trained on"):
        TaskModel.from_pretrained(path)


def test_a_config_that_does_not_fit_the_weights_is_named(saved):
    _, path = saved
    config = json.loads((path / "config.json").read_text())
    config["num_classes"], config["label_names"] = 3, None
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="model.safetensors does not fit its config.json .* size"):
        TaskModel.from_pretrained(path)


def test_weights_the_base_checkpoint_lacks_are_stored_not_referenced(tmp_path):
    """A checkpoint without a pooler (paraphrase-MiniLM-L3-v2 is one) gets a random pooler at every load: it is
    stored with the trained tensors, so the model reloads exactly."""
    from layertune.testing import build_tokenizer

    folder = tmp_path / "no-pooler"
    tokenizer = build_tokenizer(folder)
    config = transformers.BertConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2,
                                     num_attention_heads=2, intermediate_size=64, max_position_embeddings=64)
    transformers.BertModel(config, add_pooling_layer=False).save_pretrained(folder)
    model = TextClassifier(LanguageModel(folder, tunable_layers=1), 2)
    assert {"model.pooler.dense.weight", "model.pooler.dense.bias"}.isdisjoint(model.encoder.base_tensors())
    path = model.save(tmp_path / "model")
    stored = safetensors.torch.load_file(path / "model.safetensors")
    assert "encoder.model.pooler.dense.weight" in stored and "encoder.model.embeddings.word_embeddings.weight" not in stored
    batch = model.encoder.tokenize(["the movie was great"])
    torch.testing.assert_close(TaskModel.from_pretrained(path)(batch), model.eval()(batch), rtol=0, atol=0)


def test_a_regressor_s_loss_is_computed_in_float32_whatever_its_outputs_dtype(tiny_bert):
    """Under bf16 the outputs come in bf16 (after training, the forward is no longer accelerate's, which cast them
    back): the targets must not be rounded to bf16 (2.7 becomes 2.703125), or the loss scored after training
    differs from the one each epoch recorded."""
    model = TextRegressor(LanguageModel(tiny_bert, tunable_layers=0))
    targets, outputs = torch.tensor([2.7, 1.3, 4.1]), torch.tensor([[2.5], [1.0], [4.0]])
    expected = torch.nn.functional.mse_loss(outputs.squeeze(-1), targets)
    assert model.loss(outputs.bfloat16(), targets) == torch.nn.functional.mse_loss(
        outputs.bfloat16().float().squeeze(-1), targets)
    assert model.loss(outputs, targets) == expected and model.loss(outputs, targets).dtype == torch.float32
