import json

import pytest
import torch
import transformers

from layertune import LanguageModel, TaskModel, TextClassifier, TextRegressor


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
         "corrupt or partial"),
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
    from layertune.token_classification import TokenClassifier

    TokenClassifier(LanguageModel(tiny_bert, tunable_layers=1), 3, label_names=["O", "B-PER", "I-PER"]).save(
        tmp_path / "ner")
    assert type(TaskModel.from_pretrained(tmp_path / "ner")).__name__ == "TokenClassifier"
