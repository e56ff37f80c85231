import logging

import datasets
import pytest
import torch
from transformers import AutoTokenizer

from layertune.corpora import GLUE_RTE
from layertune import tokenization
from layertune.corpus import Corpus
from layertune.testing import build_tokenizer
from layertune.batching import Examples, make_loader
from layertune.tokenization import (
    META_FILE, cache_root, resolve_max_length, tokenize_corpus, tokenizer_fingerprint,
)

WORDS = "the movie was good . bad plot but great actor and fun story".split()


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("tokenizer"))


def extended(tokenizer, tmp_path):
    """A copy of ``tokenizer`` with one more token: a different vocabulary."""
    other = build_tokenizer(tmp_path / "extended")
    other.add_tokens(["zebra"])
    assert len(other) == len(tokenizer) + 1
    return other


def pair_corpus(n: int = 12, regression: bool = False) -> Corpus:
    """Sentence pairs of growing length, so some exceed a small max_length."""
    first = [" ".join(WORDS[: 2 + i % len(WORDS)]) for i in range(n)]
    second = [" ".join(reversed(WORDS[: 1 + i % 5])) for i in range(n)]
    labels = [i / 2 for i in range(n)] if regression else [i % 2 for i in range(n)]
    label = datasets.Value("float32") if regression else datasets.ClassLabel(names=["no", "yes"])
    features = datasets.Features({"s1": datasets.Value("string"), "s2": datasets.Value("string"), "label": label})
    train = datasets.Dataset.from_dict({"s1": first, "s2": second, "label": labels}, features=features)
    return Corpus(name="pairs", train=train, dev=train.select(range(4)), text_columns=("s1", "s2"),
                  task_type="regression" if regression else "classification",
                  metrics=("accuracy",), main_metric="accuracy", label_names=() if regression else ("no", "yes"))


def test_tokenizes_pairs_truncates_and_does_not_pad(tokenizer, tmp_path, caplog):
    corpus = pair_corpus()
    with caplog.at_level(logging.WARNING, logger="layertune.tokenization"):
        out = tokenize_corpus(corpus, tokenizer, max_length=10, cache_dir=tmp_path)
    train = out["train"]
    assert set(out) == {"train", "dev"} and len(train) == 12
    assert train.column_names == ["input_ids", "token_type_ids", "attention_mask", "labels", "length"]
    assert train["labels"][:] == corpus.train["label"][:]
    lengths = train["length"][:]
    assert lengths == [len(ids) for ids in train["input_ids"]] and max(lengths) == 10 and len(set(lengths)) > 2
    full = tokenizer(corpus.train["s1"][:], corpus.train["s2"][:])["input_ids"]
    n_truncated = sum(len(ids) > 10 for ids in full)
    assert 0 < n_truncated < 12
    untouched = next(i for i, ids in enumerate(full) if len(ids) <= 10)
    assert train[untouched]["input_ids"] == full[untouched]  # short examples are exactly the untruncated encoding
    assert f"pairs/train: {n_truncated} of 12 examples" in caplog.text and "max_length=10" in caplog.text


def test_second_call_loads_from_cache_without_tokenizing(tokenizer, tmp_path, monkeypatch, caplog):
    corpus = pair_corpus()
    first = tokenize_corpus(corpus, tokenizer, max_length=10, cache_dir=tmp_path)

    def refuse(*args, **kwargs):
        raise AssertionError("tokenized again instead of loading the cache")

    monkeypatch.setattr(type(tokenizer), "__call__", refuse)
    monkeypatch.setattr(tokenization, "_reported", set())  # as in a new process
    with caplog.at_level(logging.WARNING, logger="layertune.tokenization"):
        second = tokenize_corpus(pair_corpus(), tokenizer, max_length=10, cache_dir=tmp_path)
    assert "(cached)" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="layertune.tokenization"):  # the next cell of a study, say
        tokenize_corpus(pair_corpus(), tokenizer, max_length=10, cache_dir=tmp_path)
    assert "truncated" not in caplog.text  # a finding about a cached split is said once per process
    for split in first:
        assert second[split][:] == first[split][:]
    with pytest.raises(AssertionError, match="tokenized again"):  # a new max_length is a new cache entry
        tokenize_corpus(corpus, tokenizer, max_length=11, cache_dir=tmp_path)


def test_cache_key_covers_data_tokenizer_and_max_length(tokenizer, tmp_path):
    corpus = pair_corpus()
    tokenize_corpus(corpus, tokenizer, max_length=10, cache_dir=tmp_path)
    tokenize_corpus(corpus, tokenizer, max_length=12, cache_dir=tmp_path)
    tokenize_corpus(corpus, extended(tokenizer, tmp_path), max_length=10, cache_dir=tmp_path)
    smaller = pair_corpus()
    smaller.train = smaller.train.select(range(6))
    tokenize_corpus(smaller, tokenizer, max_length=10, cache_dir=tmp_path)
    # train: 4 different inputs; dev: 3, as the smaller corpus reuses the first call's dev entry.
    assert len(list(tmp_path.glob("pairs-train-*"))) == 4 and len(list(tmp_path.glob("pairs-dev-*"))) == 3
    assert not list(tmp_path.glob(".*.tmp"))


def test_tokenizer_fingerprint_ignores_call_state(tokenizer, tmp_path):
    before = tokenizer_fingerprint(tokenizer)
    tokenizer(["the movie was good"], truncation=True, max_length=3, padding="max_length")  # changes backend state
    assert tokenizer_fingerprint(tokenizer) == before
    assert tokenizer_fingerprint(build_tokenizer(tmp_path / "same")).split("@")[1] == before.split("@")[1]
    assert tokenizer_fingerprint(extended(tokenizer, tmp_path)) != before


def test_interrupted_write_leaves_no_cache(tokenizer, tmp_path, monkeypatch):
    corpus = pair_corpus()
    real_save = datasets.Dataset.save_to_disk

    def crash_after_writing(self, path, **kwargs):
        real_save(self, path, **kwargs)  # files are on disk, but the run dies before the rename
        raise KeyboardInterrupt

    monkeypatch.setattr(datasets.Dataset, "save_to_disk", crash_after_writing)
    with pytest.raises(KeyboardInterrupt):
        tokenize_corpus(corpus, tokenizer, max_length=10, cache_dir=tmp_path)
    assert list(tmp_path.iterdir()) == []
    monkeypatch.setattr(datasets.Dataset, "save_to_disk", real_save)
    out = tokenize_corpus(corpus, tokenizer, max_length=10, cache_dir=tmp_path)
    assert len(out["train"]) == 12 and len(list(tmp_path.glob(f"pairs-*/{META_FILE}"))) == 2


def test_batches_pad_to_their_longest_example(tokenizer, tmp_path):
    out = tokenize_corpus(pair_corpus(), tokenizer, max_length=10, cache_dir=tmp_path)["train"]
    examples = Examples(out, tokenizer.pad_token_id)
    batch = examples.batch([0, 1, 2])
    longest = max(out[i]["length"] for i in range(3))
    assert set(batch) == {"input_ids", "token_type_ids", "attention_mask", "labels"}
    assert batch["input_ids"].shape == (3, longest) and batch["labels"].dtype == torch.long
    assert batch["attention_mask"].sum(1).tolist() == [out[i]["length"] for i in range(3)]
    assert [b["input_ids"].shape[0] for b in make_loader(examples, batch_size=4)] == [4, 4, 4]

    regression = tokenize_corpus(pair_corpus(regression=True), tokenizer, cache_dir=tmp_path)["train"]
    regression_examples = Examples(regression, tokenizer.pad_token_id)
    labels = regression_examples.batch(range(4))["labels"]
    assert labels.dtype == torch.float32 and labels.tolist() == [0.0, 0.5, 1.0, 1.5]

def test_scoring_order_visits_every_example_once_longest_first(tokenizer, tmp_path):
    out = tokenize_corpus(pair_corpus(), tokenizer, max_length=10, cache_dir=tmp_path)["train"]
    examples = Examples(out, tokenizer.pad_token_id)
    batches = list(make_loader(examples, batch_size=4, longest_first=True))
    seen = [n for b in batches for n in b["attention_mask"].sum(1).tolist()]
    assert seen == sorted(examples.lengths, reverse=True)
    padded = sum(b["input_ids"].numel() for b in batches)
    assert padded <= sum(b["input_ids"].numel() for b in make_loader(examples, batch_size=4))



def test_default_max_length_comes_from_the_task(tokenizer, monkeypatch, tmp_path):
    corpus = pair_corpus()
    assert resolve_max_length(corpus, tokenizer) == 512  # unknown task, tokenizer without a limit
    corpus.max_length = 128
    assert resolve_max_length(corpus, tokenizer) == 128
    assert resolve_max_length(corpus, tokenizer, 32) == 32
    monkeypatch.setattr(tokenizer, "model_max_length", 64)
    assert resolve_max_length(corpus, tokenizer) == 64  # never past what the model accepts
    with pytest.raises(ValueError, match="max_length must be positive, not 0"):
        tokenize_corpus(corpus, tokenizer, max_length=0, cache_dir=tmp_path)


def test_cache_location(monkeypatch, tmp_path):
    monkeypatch.setenv("LAYERTUNE_CACHE", str(tmp_path))
    assert cache_root() == tmp_path / "tokenized"
    assert cache_root(tmp_path / "x") == tmp_path / "x"
    monkeypatch.delenv("LAYERTUNE_CACHE")
    assert cache_root().parts[-3:] == (".cache", "layertune", "tokenized")


def test_real_tokenizer_on_real_rte(data_mirror, minilm_l3, tmp_path, caplog):
    tokenizer = AutoTokenizer.from_pretrained(minilm_l3)
    corpus = GLUE_RTE(data_mirror=data_mirror)
    with caplog.at_level(logging.WARNING, logger="layertune.tokenization"):
        out = tokenize_corpus(corpus, tokenizer, cache_dir=tmp_path)
    assert [len(out["train"]), len(out["dev"])] == [2490, 277]
    assert max(out["train"]["length"]) == 128  # RTE's default max_length; MiniLM allows 128 too
    assert "rte/train:" in caplog.text and "truncated to max_length=128" in caplog.text
    first = out["train"][0]
    assert tokenizer.decode(first["input_ids"], skip_special_tokens=True).startswith("no weapons of mass destruction")
    assert first["labels"] == corpus.train[0]["label"] == 1


def test_token_classification_is_refused(tokenizer, tmp_path):
    corpus = pair_corpus()
    corpus.task_type = "token_classification"
    with pytest.raises(ValueError, match="'pairs' is token classification"):
        tokenize_corpus(corpus, tokenizer, cache_dir=tmp_path)


def test_a_damaged_tokenized_cache_is_never_used(tokenizer, tmp_path, caplog):
    from tests.conftest import toy_sentiment_corpus

    corpus = toy_sentiment_corpus(16, 8)
    first = tokenize_corpus(corpus, tokenizer, cache_dir=tmp_path)
    arrow = next(p for p in tmp_path.rglob("*.arrow") if "-train-" in str(p.parent))
    data = bytearray(arrow.read_bytes())
    data[len(data) // 2] ^= 0xFF  # a flipped byte in the token ids
    arrow.write_bytes(bytes(data))
    again = tokenize_corpus(corpus, tokenizer, cache_dir=tmp_path)
    assert any("damaged" in record.message for record in caplog.records)
    assert again["train"]["input_ids"] == first["train"]["input_ids"]  # tokenized again, not read from the damage
