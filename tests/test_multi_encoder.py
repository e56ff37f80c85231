"""MultiEncoder on two tiny random encoders of different architectures, vocabularies and hidden sizes."""

import datasets
import pytest
import torch
import transformers

from layertune import LanguageModel, ModelTrainer, TextClassifier, TextRegressor
from layertune.batching import Examples
from layertune.model_specs import CombineSpec, EncoderSpec
from layertune.multi_encoder import MultiEncoder, MultiExamples
from layertune.testing import make_tiny_model
from layertune.trainer import TrainingConfig
from tests.conftest import device_of, outputs, toy_sentiment_corpus

FAST = dict(epochs=1, batch_size=8, learning_rate=1e-3, seed=3)
SENTENCES = ["a great movie", "the quokka was awful", "guess who left ."]


@pytest.fixture(scope="module")
def encoder_dirs(tmp_path_factory):
    """A BERT with the base vocabulary, and a wider ELECTRA whose vocabulary has extra words."""
    root = tmp_path_factory.mktemp("multi")
    electra = make_tiny_model(root / "electra", "electra", seed=1, extra_words=("quokka", "wombat"),
                              hidden_size=48, intermediate_size=96)
    return make_tiny_model(root / "bert", "bert"), electra


def build(encoder_dirs, combine_method="dme", tunable_layers=(1, 2), seed=0, **options):
    transformers.set_seed(seed)
    lms = [LanguageModel(path, tunable_layers=k, pooling="mean") for path, k in zip(encoder_dirs, tunable_layers)]
    return TextClassifier(MultiEncoder(lms, combine_method, **options), 2, label_names=["negative", "positive"])


@pytest.mark.parametrize(("combine_method", "options", "width"),
                         [("concat", {}, 32 + 48), ("dme", {}, 48), ("dme", {"projection_size": 16}, 16)])
def test_combined_vector_shapes(encoder_dirs, combine_method, options, width):
    model = build(encoder_dirs, combine_method, **options).eval()
    batch = model.encoder.tokenize(SENTENCES)
    assert model.encoder.hidden_size == width
    assert model.encoder(batch).shape == (len(SENTENCES), width)
    assert model(batch).shape == (len(SENTENCES), 2)


def test_dme_attention_rows_sum_to_one(encoder_dirs):
    model = build(encoder_dirs, "dme")
    predictions, attention = model.predict_with_attention(SENTENCES * 3, batch_size=4)
    assert predictions == model.predict(SENTENCES * 3)
    assert torch.tensor(attention).shape == (9, 2)
    torch.testing.assert_close(torch.tensor(attention).sum(1), torch.ones(9))


def test_each_encoder_tokenizes_with_its_own_vocabulary(encoder_dirs):
    encoder = build(encoder_dirs).encoder
    batch = encoder.tokenize(["quokka"])
    electra = encoder.tokenizers[1]
    assert batch["lm1.input_ids"][0].tolist() == [electra.cls_token_id, electra.vocab["quokka"], electra.sep_token_id]
    assert batch["lm0.input_ids"].shape[1] > 3  # the BERT vocabulary spells it out in word pieces


def test_a_batch_pads_each_encoder_with_its_pad_id():
    def examples(rows, pad_id):
        data = datasets.Dataset.from_dict({"input_ids": rows, "attention_mask": [[1] * len(r) for r in rows],
                                           "labels": [0, 1]})
        return Examples(data, pad_id)

    multi = MultiExamples([examples([[5], [5, 6, 7]], 0), examples([[8, 9], [8]], 7)], ["lm0.", "lm1."])
    batch = multi.batch([0, 1])
    assert batch["lm0.input_ids"].tolist() == [[5, 0, 0], [5, 6, 7]]
    assert batch["lm1.input_ids"].tolist() == [[8, 9], [8, 7]]
    assert batch["labels"].tolist() == [0, 1] and multi.lengths == [2, 3]


def test_per_encoder_learning_rates_reach_the_optimizer(encoder_dirs):
    model = build(encoder_dirs, "dme")
    trainer = ModelTrainer(model, toy_sentiment_corpus(8, 4))
    groups = trainer._parameter_groups(TrainingConfig(learning_rate=[1e-4, 3e-5], head_learning_rate=1e-2))
    rate_of = {id(p): group["lr"] for group in groups for p in group["params"]}
    parts = model.parameter_parts()
    expected = {"lm0": 1e-4, "lm1": 3e-5, "head": 1e-2, "combine": 1e-2}
    trainable = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    assert len(rate_of) == sum(len(g["params"]) for g in groups) == len(trainable)
    for name, parameter in trainable:
        assert rate_of[id(parameter)] == expected[parts[name].split("/")[0]], name
    single = trainer._parameter_groups(TrainingConfig(learning_rate=2e-5, head_learning_rate=None))
    assert {group["lr"] for group in single} == {2e-5}  # None: the head and combination at the encoders' rate
    default = trainer._parameter_groups(TrainingConfig(learning_rate=2e-5))
    assert {group["lr"] for group in default} == {2e-5, 3e-3}  # the default head rate (it used to be learning_rate)


def test_parameter_parts_name_the_encoder(encoder_dirs):
    parts = set(build(encoder_dirs, "dme").parameter_parts().values())
    assert {"lm0/embeddings", "lm0/layer.3", "lm1/layer.0", "combine", "head"} <= parts


@pytest.mark.parametrize("combine_method", ["concat", "dme"])
def test_save_and_load_predict_identically(encoder_dirs, tmp_path, combine_method):
    transformers.set_seed(0)
    lms = [LanguageModel(encoder_dirs[0], tunable_layers=1), LanguageModel(encoder_dirs[1], tunable_layers="all", hidden_dropout_prob=0.3)]
    model = TextRegressor(MultiEncoder(lms, combine_method, dropout=0.2))
    ModelTrainer(model, toy_sentiment_corpus(16, 8, regression=True), cache_dir=tmp_path).train(progress=False,
                                                                                                **FAST)
    model.save(tmp_path / "saved")
    loaded = TextRegressor.from_pretrained(tmp_path / "saved").to(device_of(model))  # compared where trained
    assert [EncoderSpec.of(lm) for lm in loaded.encoder.language_models] == [EncoderSpec.of(lm) for lm in
                                                                             model.encoder.language_models]
    assert CombineSpec.of(loaded.encoder) == CombineSpec.of(model.encoder)
    assert loaded.encoder.language_models[1].model.config.hidden_dropout_prob == 0.3
    model.eval()
    batch = model.encoder.tokenize(SENTENCES)
    torch.testing.assert_close(outputs(loaded, batch), outputs(model, batch), atol=0, rtol=0)
    if combine_method == "dme":
        assert loaded.predict_with_attention(SENTENCES) == model.predict_with_attention(SENTENCES)


def test_a_model_saved_before_its_config_was_the_specs_still_loads(encoder_dirs, tmp_path):
    """config.json is the specs that build the model (an EncoderSpec per language model, a CombineSpec, the
    HeadSpec). A folder saved before, with an `encoder` settings dict and the head's fields at the top (the form
    below is what the code of 25c9497 wrote for this model), loads as it did."""
    import json

    transformers.set_seed(0)
    lms = [LanguageModel(encoder_dirs[0], tunable_layers=1, pooling="mean", method={"name": "lora", "r": 4}),
           LanguageModel(encoder_dirs[1], tunable_layers="all", hidden_dropout_prob=0.3)]
    model = TextClassifier(MultiEncoder(lms, "dme", dropout=0.2), 2, label_names=["no", "yes"], head="mlp").eval()
    path = model.save(tmp_path / "saved")
    config = json.loads((path / "config.json").read_text())
    assert [spec["model"] for spec in config["encoders"]] == [str(d) for d in encoder_dirs]
    assert config["combine"] == {"method": "dme", "dropout": 0.2, "projection_size": 48}
    assert config["head"] == {"head": "mlp", "head_hidden_size": None, "head_dropout": 0.1}
    old = {"class": "TextClassifier", "encoder": {"combine_method": "dme", "dropout": 0.2, "language_models": [
        {"freeze_embeddings": False, "frozen_dropout": False, "method": {"alpha": 16.0, "dropout": 0.1, "name": "lora",
         "r": 4, "target_modules": None}, "name": str(encoder_dirs[0]), "pooling": "mean", "pooling_source": "given",
         "revision": None, "tunable_layers": 1},
        {"freeze_embeddings": False, "frozen_dropout": False, "name": str(encoder_dirs[1]), "pooling": "cls",
         "pooling_source": "default [CLS]: the model declares no pooling", "revision": None, "tunable_layers": "all"}],
        "projection_size": 48}, "head": "mlp", "head_dropout": 0.1, "head_hidden_size": None,
        "label_names": ["no", "yes"], "num_classes": 2, "weights": config["weights"]}
    (path / "config.json").write_text(json.dumps(old))
    loaded = TextClassifier.from_pretrained(path)
    assert [EncoderSpec.of(lm).method for lm in loaded.encoder.language_models] == [lm.method for lm in lms]
    assert loaded.encoder.language_models[1].pooling_source.startswith("default [CLS]")
    assert loaded.encoder.language_models[1].model.config.hidden_dropout_prob == 0.3  # its HF config's
    assert loaded.head_settings == model.head_settings and loaded.label_names == ["no", "yes"]
    batch = model.encoder.tokenize(SENTENCES)
    torch.testing.assert_close(outputs(loaded, batch), outputs(model, batch), atol=0, rtol=0)


def test_frozen_prefix_cache_per_encoder_changes_nothing(encoder_dirs, tmp_path):
    corpus, runs = toy_sentiment_corpus(16, 8), {}
    for cache in (False, "auto"):
        model = build(encoder_dirs, "dme", tunable_layers=(1, "all"))
        runs[cache] = ModelTrainer(model, corpus, cache_dir=tmp_path).train(
            progress=False, frozen_prefix_cache=cache, mixed_precision="no", **{**FAST, "epochs": 2})  # float32: 1e-5
    info = runs["auto"].frozen_prefix_cache
    assert info["used"] and info["lm0"]["used"] and info["lm0"]["boundary"] == 3
    assert not info["lm1"]["used"] and "every layer trains" in info["lm1"]["reason"]
    assert not runs[False].frozen_prefix_cache["used"]
    for uncached, cached in zip(runs[False].history, runs["auto"].history):
        assert cached["train_loss"] == pytest.approx(uncached["train_loss"], abs=1e-5)
        assert cached["eval_loss"] == pytest.approx(uncached["eval_loss"], abs=1e-5)


def test_forced_cache_names_the_encoder_that_cannot_use_it(encoder_dirs, tmp_path):
    model = build(encoder_dirs, "concat", tunable_layers=(1, "all"))
    with pytest.raises(ValueError, match=r"lm1 \(.*electra.*\): frozen_prefix_cache=True cannot be honoured"):
        ModelTrainer(model, toy_sentiment_corpus(8, 4), cache_dir=tmp_path).train(
            progress=False, frozen_prefix_cache=True, **FAST)


def test_learning_rate_list_of_wrong_length_fails_before_any_step(encoder_dirs, tmp_path):
    model = build(encoder_dirs, "concat")
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    with pytest.raises(ValueError, match=r"Got 3 learning rates \[.*\] for 2 language models"):
        ModelTrainer(model, toy_sentiment_corpus(8, 4), cache_dir=tmp_path).train(
            progress=False, **{**FAST, "learning_rate": [1e-4, 1e-4, 1e-4]})
    assert all(torch.equal(p, before[name]) for name, p in model.named_parameters())


def test_bad_input_is_named(encoder_dirs):
    lm = LanguageModel(encoder_dirs[0], tunable_layers=1)
    other = LanguageModel(encoder_dirs[1], tunable_layers=1)
    cases = [
        (lambda: MultiEncoder([]), ValueError, "at least two language models; got 0"),
        (lambda: MultiEncoder([lm]), ValueError, "use the LanguageModel itself"),
        (lambda: MultiEncoder([lm, other], "sum"), ValueError, "Valid choices: concat, dme"),
        (lambda: MultiEncoder([lm, other], "dmee"), ValueError, "Did you mean 'dme'"),
        (lambda: MultiEncoder([lm, lm]), ValueError, "share weights"),
        (lambda: MultiEncoder([lm, MultiEncoder([lm, other])]), TypeError, "not a LanguageModel"),
        (lambda: MultiEncoder([lm, other], "concat", projection_size=8), ValueError, "='dme' only"),
        (lambda: MultiEncoder([lm, other], "dme", dropout=1.5), ValueError, "dropout"),
        (lambda: TrainingConfig(learning_rate=[1e-5]).learning_rates([lm.name, other.name]), ValueError,
         "1 learning rates .* for 2"),
    ]
    for make, error, message in cases:
        with pytest.raises(error, match=message):
            make()


@pytest.mark.parametrize("combine_method", ["concat", None])
def test_attention_needs_dme(encoder_dirs, combine_method):
    if combine_method:
        model = build(encoder_dirs, combine_method)
    else:
        model = TextClassifier(LanguageModel(encoder_dirs[0], tunable_layers=1), 2)
    expected = "combine_method='concat', which has no attention" if combine_method else "a single LanguageModel"
    with pytest.raises(ValueError, match=expected):
        model.predict_with_attention(SENTENCES)


def test_the_write_ups_example_runs_as_written(encoder_dirs, tmp_path):
    """The multi-encoder write-ups' code, with small local models: LanguageModel(path) tunes every layer,
    hidden_dropout_prob as a keyword, one learning rate per encoder, and after from_pretrained
    predict_with_attention gives label names, as predict does."""
    corpus = toy_sentiment_corpus(16, 8)
    transformers.set_seed(0)
    electra = LanguageModel(encoder_dirs[0])
    roberta = LanguageModel(encoder_dirs[1], hidden_dropout_prob=0.4)
    encoder = MultiEncoder(language_models=[electra, roberta], combine_method="dme")
    model = TextClassifier(encoder=encoder, num_classes=corpus.num_classes)
    trainer = ModelTrainer(model=model, corpus=corpus)
    trainer.train(tmp_path / "run", learning_rate=[3e-5, 1e-5], batch_size=8, epochs=1, progress=False)
    rate_of = {id(p): group["initial_lr"] for group in trainer.optimizer.param_groups for p in group["params"]}
    assert electra.tunable_layers == roberta.tunable_layers == "all"
    assert {rate_of[id(p)] for p in electra.parameters() if p.requires_grad} == {3e-5}
    assert {rate_of[id(p)] for p in roberta.parameters() if p.requires_grad} == {1e-5}
    loaded = TextClassifier.from_pretrained(tmp_path / "run" / "model")
    assert loaded.encoder.language_models[1].model.config.hidden_dropout_prob == 0.4
    predictions, attention = loaded.predict_with_attention(SENTENCES)
    assert set(predictions) <= {"negative", "positive"} and predictions == loaded.predict(SENTENCES)
    ids, same = loaded.predict_with_attention(SENTENCES, return_ids=True)
    assert [corpus.label_names[i] for i in ids] == predictions and same == attention


def test_both_encoders_satisfy_the_encoder_protocol_and_name_their_language_models(encoder_dirs):
    from layertune.encoder import Encoder, TokenEncoder, lacks

    lms = [LanguageModel(path, tunable_layers=k) for path, k in zip(encoder_dirs, (1, "all"))]
    multi = MultiEncoder(lms, "dme")
    assert lacks(lms[0], Encoder) == [] and lacks(multi, Encoder) == []  # `language_models`: a submodule of multi
    assert lacks(lms[0], TokenEncoder) == [] and lacks(multi, TokenEncoder) == ["tokenizer", "max_length",
                                                                                "token_states", "model_inputs"]
    assert lms[0].language_models == [lms[0]] and list(multi.language_models) == lms
    # One name, one meaning: frozen_prefix_layers is each language model's own count, never a list.
    assert [lm.frozen_prefix_layers for lm in multi.language_models] == [3, None]
    assert not hasattr(multi, "frozen_prefix_layers")
    assert lms[0].combination_parameters() == [] and multi.combination_parameters()


def test_an_encoder_lacking_a_member_is_named_with_what_it_lacks(encoder_dirs):
    from layertune import TokenClassifier

    class PooledOnly(torch.nn.Module):
        hidden_size = 8

        def forward(self, batch):
            return torch.zeros(len(batch["input_ids"]), 8)

    with pytest.raises(TypeError, match=r"TextClassifier needs an encoder \(a LanguageModel or MultiEncoder\); "
                                        r"PooledOnly has no parameter_parts, language_models, tokenize, "
                                        r"prepare_examples, .*, save_config\.$"):
        TextClassifier(PooledOnly(), 2)
    multi = build(encoder_dirs).encoder
    with pytest.raises(TypeError, match=r"TokenClassifier needs an encoder with per-token states \(a LanguageModel\)"
                                        r"; MultiEncoder has no tokenizer, max_length, token_states, model_inputs\.$"):
        TokenClassifier(multi, 3)


def test_a_batch_is_pinned_only_where_every_encoder_s_states_are_gathered_on_the_host():
    """A loader pins every tensor of a batch, and one resident on the GPU cannot be pinned ("cannot pin
    'torch.cuda.FloatTensor'"): one encoder's states in host memory beside another's on the GPU (or an encoder that
    trains every layer, with nothing cached) must not pin the batch."""
    from types import SimpleNamespace

    gpu = torch.device("cuda", 0)
    on_host, resident = SimpleNamespace(host_batches_for=gpu), SimpleNamespace(host_batches_for=None)
    examples = MultiExamples.__new__(MultiExamples)  # the parts alone decide; no GPU here to place them
    for parts, pinned_for in (([on_host, resident], None), ([resident, on_host], None), ([on_host, on_host], gpu),
                              ([resident, resident], None)):
        examples.parts = parts
        assert examples.host_batches_for == pinned_for, parts
