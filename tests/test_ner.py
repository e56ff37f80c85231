"""Token classification (NER): CoNLL reading, word-piece alignment, seqeval scoring, training, save/load."""

import logging
import random
from collections import Counter

import datasets
import pytest
import torch
import transformers

from layertune.batching import IGNORE_INDEX
from layertune.corpora import CONLL_03, load_corpus
from layertune.corpora.conll import iob1_to_iob2, iob2_label_names, token_features
from layertune.corpus import Corpus
from layertune.language_model import LanguageModel
from layertune.metrics import compute_metrics
from layertune.heads import TokenClassifier
from layertune.tokenization import tokenize_corpus
from layertune.trainer import ModelTrainer
from tests.conftest import device_of, outputs

LABELS = iob2_label_names(("PER", "MISC"))  # O B-PER I-PER B-MISC I-MISC
FAST = dict(epochs=1, batch_size=8, learning_rate=1e-3, seed=3)


def toy_ner_corpus(train_size: int = 32, dev_size: int = 16) -> Corpus:
    """Sentences whose tags follow from the words; "zorro" and "smith" split into several word pieces."""
    rng = random.Random(0)

    def split(n: int) -> datasets.Dataset:
        rows = {"tokens": [], "tags": []}
        for _ in range(n):
            words, tags = [], []
            for _ in range(rng.randint(2, 6)):
                draw = rng.random()
                if draw < 0.25:
                    words, tags = [*words, "zorro", "smith"], [*tags, 1, 2]
                elif draw < 0.4:
                    words, tags = [*words, "movie"], [*tags, 3]
                else:
                    words, tags = [*words, rng.choice("the a was good bad plot .".split())], [*tags, 0]
            rows["tokens"].append(words)
            rows["tags"].append(tags)
        return datasets.Dataset.from_dict(rows, features=token_features(LABELS))

    return Corpus(name="toy-ner", train=split(train_size), dev=split(dev_size), text_columns=("tokens",),
                  task_type="token_classification", metrics=("seqeval",), main_metric="f1", label_names=LABELS)


def one_sentence_corpus(words: list[str], tags: list[str]) -> Corpus:
    ds = datasets.Dataset.from_dict({"tokens": [words], "tags": [[LABELS.index(t) for t in tags]]},
                                    features=token_features(LABELS))
    return Corpus(name="one", train=ds, dev=ds, text_columns=("tokens",), task_type="token_classification",
                  metrics=("seqeval",), main_metric="f1", label_names=LABELS)


def build(model_dir, tunable_layers=1, seed=0) -> TokenClassifier:
    transformers.set_seed(seed)
    return TokenClassifier(LanguageModel(model_dir, tunable_layers=tunable_layers), len(LABELS), label_names=LABELS)


def write_conll(path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


GOOD_CONLL = "-DOCSTART- -X- -X- O\n\nEU NNP I-NP I-ORG\nrejects VBZ I-VP O\nGerman JJ I-NP I-MISC\n\n"


def conll_mirror(root, train=GOOD_CONLL, dev=GOOD_CONLL, test=GOOD_CONLL):
    for split, text in (("train", train), ("dev", dev), ("test", test)):
        write_conll(root / "ner" / "conll2003" / f"{split}.txt", text)
    return root


# ------------------------------------------------------------------------------------------------ tags and files


def test_iob1_to_iob2():
    assert iob1_to_iob2(["I-PER", "I-PER", "O", "I-LOC", "B-LOC", "I-LOC", "I-ORG"]) == \
        ["B-PER", "I-PER", "O", "B-LOC", "B-LOC", "I-LOC", "B-ORG"]
    iob2 = ["B-PER", "I-PER", "B-PER", "O", "B-MISC"]
    assert iob1_to_iob2(iob2) == iob2  # already IOB2: unchanged


def test_conll2003_reader_converts_tags_and_names_bad_lines(tmp_path):
    corpus = CONLL_03(data_mirror=conll_mirror(tmp_path / "ok"))
    assert corpus.train[0]["tokens"] == ["EU", "rejects", "German"]
    assert [corpus.label_names[t] for t in corpus.train[0]["tags"]] == ["B-ORG", "O", "B-MISC"]

    malformed = GOOD_CONLL.replace("rejects VBZ I-VP O", "rejects VBZ O")
    with pytest.raises(ValueError, match=r"train\.txt:4: expected 4 space-separated columns .* found 3"):
        CONLL_03(data_mirror=conll_mirror(tmp_path / "malformed", train=malformed))
    unknown = GOOD_CONLL.replace("I-MISC", "I-TIME")
    with pytest.raises(ValueError, match=r"dev\.txt:5: tag 'I-TIME' is not in the label set \['O', 'B-PER'"):
        CONLL_03(data_mirror=conll_mirror(tmp_path / "unknown", dev=unknown))
    with pytest.raises(ValueError, match=r"test\.txt holds no sentences: an empty split"):
        CONLL_03(data_mirror=conll_mirror(tmp_path / "empty", test="-DOCSTART- -X- -X- O\n\n"))


def test_any_conll_folder_loads_with_its_own_tags(tmp_path):
    write_conll(tmp_path / "mine" / "train.conll", "Ann B-PER\nLee I-PER\nsang O\n\nBo B-PER\nran O\n")
    write_conll(tmp_path / "mine" / "dev.conll", "Oslo I-LOC\n")  # IOB1 here: converted
    corpus = load_corpus(tmp_path / "mine")
    assert corpus.task_type == "token_classification" and corpus.label_names == iob2_label_names(("LOC", "PER"))
    assert [corpus.label_names[t] for t in corpus.dev[0]["tags"]] == ["B-LOC"]
    write_conll(tmp_path / "bad" / "train.conll", "Ann B-PER\nLee PERSON\n")
    with pytest.raises(ValueError, match=r"train\.conll:2: tag 'PERSON' is not IOB"):
        load_corpus(tmp_path / "bad")


def test_hub_datasets_with_token_columns(monkeypatch):
    names = ["O", "B-PER", "I-PER", "B-ORG", "I-ORG", "B-LOC", "I-LOC", "B-MISC", "I-MISC"]
    features = datasets.Features({"id": datasets.Value("string"), "tokens": datasets.List(datasets.Value("string")),
                                  "ner_tags": datasets.List(datasets.ClassLabel(names=names))})
    split = datasets.Dataset.from_dict({"id": ["0"], "tokens": [["EU", "rejects"]], "ner_tags": [[3, 0]]},
                                       features=features)
    calls = []

    def load_dataset(path, name=None, **kwargs):
        calls.append((path, name, kwargs.get("revision")))
        return datasets.DatasetDict({"train": split, "validation": split, "test": split})

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    monkeypatch.delenv("LAYERTUNE_DATA_MIRROR", raising=False)
    corpus = CONLL_03()
    assert calls == [("eriktks/conll2003", None, "refs/convert/parquet")]
    assert corpus.train.column_names == ["tokens", "tags"] and corpus.train[0]["tags"] == [3, 0]
    other = load_corpus("someone/ner")  # any hub dataset with tokens + a list of class-labelled tags
    assert other.task_type == "token_classification" and other.label_names == tuple(names)


# ------------------------------------------------------------------------------------------- word-piece alignment


def test_first_word_piece_carries_the_tag(tiny_bert, tmp_path):
    words, tags = ["zorro", "was", "good", "smith"], ["B-PER", "O", "O", "B-PER"]
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_bert)
    example = tokenize_corpus(one_sentence_corpus(words, tags), tokenizer, cache_dir=tmp_path)["train"][0]
    pieces = tokenizer.convert_ids_to_tokens(example["input_ids"])
    assert pieces == ["[CLS]", "z", "##o", "##r", "##r", "##o", "was", "good", "s", "##m", "##i", "##t", "##h", "[SEP]"]
    x = IGNORE_INDEX
    assert example["labels"] == [x, 1, x, x, x, x, 0, 0, 1, x, x, x, x, x]
    assert example["word_ids"] == [-1, 0, 0, 0, 0, 0, 1, 2, 3, 3, 3, 3, 3, -1]


def test_truncation_is_counted_in_a_warning(tiny_bert, tmp_path, caplog):
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_bert)
    corpus = one_sentence_corpus(["zorro", "was", "good", "smith"], ["B-PER", "O", "O", "B-PER"])
    with caplog.at_level(logging.WARNING, logger="layertune.tokenization"):
        example = tokenize_corpus(corpus, tokenizer, max_length=6, cache_dir=tmp_path)["train"][0]
    assert len(example["input_ids"]) == 6 and example["labels"] == [IGNORE_INDEX, 1] + [IGNORE_INDEX] * 4
    assert "one/train: 1 of 1 examples (100.0%) truncated to max_length=6" in caplog.text
    assert "one/train: 3 words have no word piece left" in caplog.text


# ------------------------------------------------------------------------------------------------------- scoring


def test_seqeval_f1_through_metric_inputs_matches_hand_count(tiny_bert):
    """Gold: PER + LOC | LOC(2 words). Predicted: PER | LOC(1 word) + PER. One of 3 entities right either way."""
    names = ["O", "B-PER", "I-PER", "B-LOC", "I-LOC"]
    model = TokenClassifier(LanguageModel(tiny_bert, tunable_layers=0), 5, label_names=names)
    x = IGNORE_INDEX
    # Pieces: [CLS] w0 w0' w1 w2 w3 [SEP] / [CLS] w0 w1 w2 w3 [SEP] pad; -100 pieces predict junk (B-LOC).
    gold = torch.tensor([[x, 1, x, 2, 0, 3, x], [x, 0, 3, 4, 0, x, x]])
    predicted = torch.tensor([[3, 1, 3, 2, 0, 0, 3], [3, 0, 3, 0, 2, 3, 3]])  # I-PER after O opens an entity
    outputs = torch.nn.functional.one_hot(predicted, 5).float()
    predictions, references = model.metric_inputs(outputs, gold)
    assert references == [["B-PER", "I-PER", "O", "B-LOC"], ["O", "B-LOC", "I-LOC", "O"]]
    assert predictions == [["B-PER", "I-PER", "O", "O"], ["O", "B-LOC", "O", "I-PER"]]
    scores = compute_metrics(["seqeval"], predictions, references)
    assert scores["precision"] == pytest.approx(1 / 3) and scores["recall"] == pytest.approx(1 / 3)
    assert scores["f1"] == pytest.approx(1 / 3) and scores["accuracy"] == pytest.approx(5 / 8)
    assert scores["PER_f1"] == pytest.approx(2 / 3) and scores["LOC_f1"] == 0.0  # PER: P 1/2, R 1/1


# ------------------------------------------------------------------------------------------ training and saving


def test_training_changes_only_tunable_parameters_and_cache_is_exact(tiny_bert, tmp_path):
    corpus, losses = toy_ner_corpus(), []
    for cache in (False, "auto"):
        model = build(tiny_bert, tunable_layers=1)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        result = ModelTrainer(model, corpus, cache_dir=tmp_path).train(  # float32: compared to 1e-5 on any device
            progress=False, frozen_prefix_cache=cache, mixed_precision="no", **FAST)
        assert result.frozen_prefix_cache["used"] == (cache == "auto")
        for name, parameter in model.named_parameters():
            changed = not torch.equal(parameter.cpu(), before[name])  # on the CPU: the run may have used a GPU
            assert changed == parameter.requires_grad, f"{name}: trainable={parameter.requires_grad}, changed={changed}"
        losses.append((result.history[0]["train_loss"], result.history[0]["eval_loss"]))
        assert {"eval_f1", "eval_precision", "eval_recall", "eval_PER_f1"} <= set(result.best_metrics)
    assert losses[1] == pytest.approx(losses[0], abs=1e-5)
    drift = result.drift.set_index("parameter")
    assert drift.loc["head.1.weight", "mean_abs_change"] > 0 and drift.loc[
        "encoder.model.embeddings.word_embeddings.weight", "mean_abs_change"] == 0


def test_save_load_predicts_identically(tiny_bert, tmp_path):
    model = build(tiny_bert, tunable_layers=2)
    ModelTrainer(model, toy_ner_corpus(), cache_dir=tmp_path).train(progress=False, **FAST)
    sentences = [["zorro", "smith", "was", "good"], ["the", "movie"], ["a"]]
    tags = model.predict(sentences)
    assert [len(t) for t in tags] == [4, 2, 1] and set().union(*map(set, tags)) <= set(LABELS)
    loaded = TokenClassifier.from_pretrained(model.save(tmp_path / "saved")).to(device_of(model))  # where trained
    assert loaded.predict(sentences) == tags and loaded.label_names == list(LABELS)
    batch = model.encoder.tokenize(["zorro smith was good"])
    assert torch.equal(outputs(loaded, batch), outputs(model.eval(), batch))
    with pytest.raises(TypeError, match="each a list of words"):
        model.predict(["zorro smith was good"])


# ------------------------------------------------------------------------------------------------------ real data


def test_real_conll2003_has_the_official_counts(data_mirror):
    corpus = CONLL_03(data_mirror=data_mirror)
    expected = {"train": (14041, 203621, 7140, 3438, 6321, 6600), "dev": (3250, 51362, 1837, 922, 1341, 1842),
                "test": (3453, 46435, 1668, 702, 1661, 1617)}
    for split, (sentences, tokens, *entities) in expected.items():
        ds = corpus.splits()[split]
        starts = Counter(corpus.label_names[t] for tags in ds["tags"] for t in tags if corpus.label_names[t][0] == "B")
        assert (len(ds), sum(map(len, ds["tokens"]))) == (sentences, tokens)
        assert [starts[f"B-{t}"] for t in ("LOC", "MISC", "ORG", "PER")] == entities  # IOB2: one B- per entity
    small = CONLL_03(data_mirror=data_mirror, train_size=500, seed=1)
    assert len(small.train) == 500 and len(small.dev) == 3250
    assert small.train[:] == CONLL_03(data_mirror=data_mirror, train_size=500, seed=1).train[:]


def test_dev_loss_is_the_mean_over_labelled_pieces_whatever_the_batches(tiny_bert, tmp_path):
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    from layertune.batching import make_loader
    from layertune.training_config import TrainingConfig

    corpus = toy_ner_corpus()
    model = build(tiny_bert)
    trainer = ModelTrainer(model, corpus, cache_dir=tmp_path)
    args = TrainingConfig(frozen_prefix_cache=False)
    dev = model.encoder.prepare_examples(corpus, args, cache_dir=tmp_path)[0]["dev"]
    batch = dev.batch(range(len(dev)))
    with torch.no_grad():
        model.eval()
        expected = model.loss(model(batch), batch["labels"]).item()  # one batch: the mean over every labelled piece
    AcceleratorState._reset_state(reset_partial_state=False)  # an earlier run's precision (bf16) is not this one's
    # float32, as the expected loss was computed; not cpu=True, which would set accelerate's process-wide device to the
    # CPU for every later test of this worker where it is the first to set it (on a GPU, they would train on the CPU)
    accelerator = Accelerator(mixed_precision="no")
    model.to(accelerator.device)  # a GPU where an earlier test of the process trained on one: accelerate keeps it
    for batch_size in (1, 3, 16):
        scores, _ = trainer.evaluate(make_loader(dev, batch_size), accelerator)
        assert scores["eval_loss"] == pytest.approx(expected, rel=1e-5), batch_size


def test_majority_baselines_need_no_model():
    from layertune.reports.ner import majority_baselines

    corpus = one_sentence_corpus(["zorro", "smith", "was", "good"], ["B-PER", "I-PER", "O", "O"])
    baselines = majority_baselines(corpus)
    assert baselines["majority_tag"]["tag"] == "O" and baselines["majority_tag"]["f1"] == 0.0  # finds no entity
    assert baselines["word_majority_tag"]["f1"] == 1.0  # every dev word was seen with its tag in train
