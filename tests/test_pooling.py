"""Pooling defaults to the model's own where it declares one (a sentence-transformers pooling config), else [CLS];
the model records which and why, and keeps both when saved."""

import json
import shutil

import pytest

from layertune import LanguageModel, TextClassifier
from layertune.specs import EncoderSpec
from layertune.model_paths import default_pooling

MINILM = "sentence-transformers/all-MiniLM-L6-v2"


def sentence_transformers_folder(folder, pooling_config: dict, pooling_path: str = "1_Pooling"):
    """``folder`` made a sentence-transformers model: modules.json naming its pooling module, and that module's
    config."""
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": pooling_path, "type": "sentence_transformers.models.Pooling"}]
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / pooling_path).mkdir(exist_ok=True)
    (folder / pooling_path / "config.json").write_text(json.dumps(pooling_config))
    return folder


@pytest.fixture
def mean_pooled_bert(tiny_bert, tmp_path):
    """A tiny BERT that declares mean pooling as all-MiniLM-L6-v2 does (legacy flags)."""
    folder = shutil.copytree(tiny_bert, tmp_path / "st-bert")
    return sentence_transformers_folder(folder, {"word_embedding_dimension": 32, "pooling_mode_cls_token": False,
                                                 "pooling_mode_mean_tokens": True})


def test_the_packaged_all_minilm_pools_as_it_was_trained(tiny_bert):
    lm = LanguageModel(MINILM, tunable_layers=0)
    assert lm.pooling == "mean"
    assert lm.pooling_source == "the model's own: its sentence-transformers pooling (1_Pooling/config.json) is mean"
    assert "pooling='mean' (the model's own" in repr(lm) and EncoderSpec.of(lm).pooling == "mean"
    plain = LanguageModel(tiny_bert, tunable_layers=0)  # a plain Hugging Face folder declares nothing
    assert plain.pooling == "cls" and plain.pooling_source.startswith("default [CLS]: the model declares no pooling")


def test_an_explicit_pooling_wins(mean_pooled_bert):
    lm = LanguageModel(mean_pooled_bert, tunable_layers=0, pooling="cls")
    assert (lm.pooling, lm.pooling_source) == ("cls", "given")
    assert "pooling='cls'," in repr(lm)


@pytest.mark.parametrize(("config", "expected"), [
    ({"pooling_mode": "cls"}, ("cls", "is cls")),  # sentence-transformers >= 6
    ({"pooling_mode": ["mean"]}, ("mean", "is mean")),
    ({"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False}, ("cls", "is cls")),
    ({"word_embedding_dimension": 32}, ("mean", "is mean")),  # no flag set: sentence-transformers pools mean
    ({"pooling_mode_max_tokens": True}, ("cls", "(1_Pooling/config.json: max) is not one layertune has")),
    ({"pooling_mode": ["cls", "mean"]}, ("cls", "(1_Pooling/config.json: cls+mean) is not one layertune has")),
])
def test_the_declared_mode_is_read_as_sentence_transformers_reads_it(tiny_bert, tmp_path, config, expected):
    folder = sentence_transformers_folder(shutil.copytree(tiny_bert, tmp_path / "m"), config)
    pooling, source = default_pooling(folder)
    assert pooling == expected[0] and expected[1] in source, source


def test_a_hub_model_declares_its_pooling_in_files_fetched_like_its_config(fake_hub, tmp_path):
    fake_hub.root = tmp_path
    for name in ("st", "plain"):
        (tmp_path / "org" / name).mkdir(parents=True)
    sentence_transformers_folder(tmp_path / "org" / "st", {"pooling_mode": "mean"}, pooling_path="pool")
    assert default_pooling("org/st", revision="abc")[0] == "mean"
    assert ("org/st", "pool/config.json", "abc") in fake_hub.asked
    assert default_pooling("org/plain") == default_pooling("org/missing") == (
        "cls", "default [CLS]: the model declares no pooling (it has no sentence-transformers modules.json)")


def test_a_saved_model_reloads_with_its_pooling_and_why(mean_pooled_bert, tmp_path):
    model = TextClassifier(LanguageModel(mean_pooled_bert, tunable_layers=1), 2)
    model.save(tmp_path / "saved")
    shutil.rmtree(mean_pooled_bert / "1_Pooling")  # what the base folder declares now does not matter
    loaded = TextClassifier.from_pretrained(tmp_path / "saved").encoder
    assert (loaded.pooling, loaded.pooling_source) == ("mean", model.encoder.pooling_source)
    assert loaded.pooling_source.startswith("the model's own")


def test_a_cells_default_pooling_resolves_as_the_librarys(mean_pooled_bert):
    spec = EncoderSpec(model=str(mean_pooled_bert), tunable_layers=0)
    assert spec.pooling is None and spec.build().pooling == "mean"
    assert EncoderSpec(model=str(mean_pooled_bert), tunable_layers=0, pooling="pooler").build().pooling == "pooler"
