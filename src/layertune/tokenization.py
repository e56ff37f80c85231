"""Tokenize a corpus once, cache it on disk, and pad each batch dynamically.

``tokenize_corpus`` truncates but never pads: every example keeps its own length, stored in a ``length`` column
(usable for length-grouped batching). Padding happens per batch, in `layertune.batching`.

Token classification (``tokens`` + ``tags`` columns) is tokenized from the words, and each word's tag goes on its
first word piece; later pieces and special tokens get -100, which the loss and the metrics skip. ``word_ids`` keeps
the word index of every piece (-1 for special tokens).

Cache: one folder per split under ``cache_dir`` (default ``$LAYERTUNE_CACHE/tokenized``, else
``~/.cache/layertune/tokenized``), named by :func:`cache_key` of the split's content (`layertune.io.dataset_digest`),
the tokenizer's identity (:func:`tokenizer_fingerprint`), ``max_length`` and the text columns. A folder is written
under a temporary name and renamed when complete, so an interrupted run never leaves a half-written cache behind.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import uuid
from pathlib import Path

import datasets
from transformers import PreTrainedTokenizerBase

from layertune import timing
from layertune.batching import IGNORE_INDEX
from layertune.corpora.registry import TASKS
from layertune.corpus import Corpus
from layertune.io import cache_root as library_cache_root
from layertune.io import dataset_digest, disk_full_said, file_digest, remove_stale_partials

logger = logging.getLogger(__name__)

CACHE_FORMAT = 2  # bump when the tokenized columns or the folder change (2: checksums), so older ones are not used
META_FILE = "layertune_tokenized.json"
FALLBACK_MAX_LENGTH = 512


def tokenize_corpus(corpus: Corpus, tokenizer: PreTrainedTokenizerBase, max_length: int | None = None,
                    cache_dir: str | os.PathLike | None = None) -> dict[str, datasets.Dataset]:
    """``{split: Dataset}`` with ``input_ids``, ``attention_mask`` (+ ``token_type_ids`` if the tokenizer makes
    them), ``labels`` and ``length``; truncated to ``max_length`` (default: the task's), not padded, cached on disk."""
    if corpus.task_type == "token_classification":
        _check_token_corpus(corpus, tokenizer)
    max_length = resolve_max_length(corpus, tokenizer, max_length)
    root = cache_root(cache_dir)
    identity = tokenizer_fingerprint(tokenizer)
    return {split: _tokenized_split(corpus, split, ds, tokenizer, identity, max_length, root)
            for split, ds in corpus.splits().items()}


def resolve_max_length(corpus: Corpus, tokenizer: PreTrainedTokenizerBase, max_length: int | None = None) -> int:
    """``max_length`` if given, else the corpus/task default capped at what the tokenizer's model accepts."""
    if max_length is not None:
        if max_length < 1:
            raise ValueError(f"max_length must be positive, not {max_length}.")
        if max_length > tokenizer.model_max_length:
            logger.warning("max_length=%d exceeds %s's model_max_length=%d", max_length, tokenizer.name_or_path,
                           tokenizer.model_max_length)
        return max_length
    spec = TASKS.get(corpus.name)
    default = corpus.max_length or (spec.max_length if spec else FALLBACK_MAX_LENGTH)
    return min(default, tokenizer.model_max_length)


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    return Path(cache_dir).expanduser() if cache_dir is not None else library_cache_root() / "tokenized"


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str:
    """``name_or_path@hash`` where the hash covers everything that changes the token ids.

    For fast tokenizers that is the serialised backend (vocab, normalizer, special-token template) minus its
    truncation/padding state, which every call rewrites; slow tokenizers hash their vocab and init arguments.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        state = json.loads(backend.to_str())
        state.pop("truncation", None)
        state.pop("padding", None)
    else:
        state = {"vocab": sorted(tokenizer.get_vocab().items()), "init": tokenizer.init_kwargs}
    state.update(cls=type(tokenizer).__name__, inputs=list(tokenizer.model_input_names),
                 truncation_side=tokenizer.truncation_side)
    digest = hashlib.sha256(json.dumps(state, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return f"{tokenizer.name_or_path}@{digest}"


def cache_key(data_digest: str, tokenizer_id: str, max_length: int, text_columns,
              word_labels: bool = False) -> str:
    """``word_labels``: labels aligned to first word pieces (token classification); keys of other tasks unchanged."""
    payload = {"format": CACHE_FORMAT, "data": data_digest, "tokenizer": tokenizer_id,
               "max_length": max_length, "text_columns": list(text_columns)}
    if word_labels:
        payload["labels"] = "first-word-piece"
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:24]


def _tokenized_split(corpus: Corpus, split: str, ds: datasets.Dataset, tokenizer, identity: str, max_length: int,
                     root: Path) -> datasets.Dataset:
    words = corpus.task_type == "token_classification"
    key = cache_key(dataset_digest(ds), identity, max_length, corpus.text_columns, word_labels=words)
    path = root / f"{re.sub(r'[^A-Za-z0-9_.-]+', '_', corpus.name)}-{split}-{key}"
    meta = _intact_meta(path)
    if meta is not None:
        _report_truncation(corpus.name, split, meta["num_truncated"], meta["num_examples"], max_length, cached=True)
        _report_unscored_words(corpus.name, split, meta.get("num_unscored_words", 0), cached=True)
        return datasets.load_from_disk(path)
    with timing.compute("tokenizing"):
        if words:
            tokenized, num_truncated, num_unscored = _tokenize_words(ds, tokenizer, max_length, key)
        else:
            tokenized, num_truncated = _tokenize(ds, tokenizer, corpus.text_columns, max_length, key)
            num_unscored = 0
    _report_truncation(corpus.name, split, num_truncated, len(tokenized), max_length, cached=False)
    _report_unscored_words(corpus.name, split, num_unscored, cached=False)
    meta = {"corpus": corpus.name, "split": split, "tokenizer": identity, "max_length": max_length,
            "num_examples": len(tokenized), "num_truncated": num_truncated, "key": key}
    if words:
        meta["num_unscored_words"] = num_unscored
    _save_atomically(tokenized, path, meta)
    return datasets.load_from_disk(path)


def _tokenize(ds: datasets.Dataset, tokenizer, text_columns, max_length: int, fingerprint: str):
    tokenized = ds.map(
        _encode_batch, batched=True, remove_columns=ds.column_names, keep_in_memory=True,
        fn_kwargs={"tokenizer": tokenizer, "text_columns": tuple(text_columns), "max_length": max_length},
        new_fingerprint=fingerprint,  # the cache key already identifies the result; hashing a tokenizer is slow
        desc="Tokenizing",
    )
    num_truncated = int(sum(tokenized["truncated"]))
    tokenized = tokenized.remove_columns("truncated").cast_column("labels", ds.features["label"])
    return tokenized, num_truncated


def _encode_batch(batch: dict, tokenizer, text_columns: tuple[str, ...], max_length: int) -> dict:
    texts = [batch[c] for c in text_columns]
    encoded = tokenizer(*texts, truncation=False, verbose=False)
    too_long = [i for i, ids in enumerate(encoded["input_ids"]) if len(ids) > max_length]
    if too_long:
        # Only the long examples are encoded again, with truncation: one truncating pass cannot tell which were cut.
        cut = tokenizer(*[[column[i] for i in too_long] for column in texts], truncation=True, max_length=max_length)
        for name in encoded:
            for j, i in enumerate(too_long):
                encoded[name][i] = cut[name][j]
    out = {name: encoded[name] for name in tokenizer.model_input_names if name in encoded}
    out["labels"] = batch["label"]
    out["length"] = [len(ids) for ids in out["input_ids"]]
    truncated = set(too_long)
    out["truncated"] = [i in truncated for i in range(len(out["input_ids"]))]
    return out


def _check_token_corpus(corpus: Corpus, tokenizer) -> None:
    missing = [c for c in ("tokens", "tags") if c not in corpus.train.column_names]
    if missing:
        raise ValueError(f"{corpus.name!r} is token classification, but its splits have no {' or '.join(missing)} "
                         f"column (words and their tag ids); they have {', '.join(corpus.train.column_names)}.")
    if not tokenizer.is_fast:
        raise ValueError(f"Token classification needs a fast tokenizer to map word pieces to words; "
                         f"{tokenizer.name_or_path} has only a slow ({type(tokenizer).__name__}) one.")


def _tokenize_words(ds: datasets.Dataset, tokenizer, max_length: int, fingerprint: str):
    tokenized = ds.map(
        _encode_words, batched=True, remove_columns=ds.column_names, keep_in_memory=True,
        fn_kwargs={"tokenizer": tokenizer, "max_length": max_length}, new_fingerprint=fingerprint,
        desc="Tokenizing words",
    )
    num_truncated, num_unscored = int(sum(tokenized["truncated"])), int(sum(tokenized["unscored_words"]))
    return tokenized.remove_columns(["truncated", "unscored_words"]), num_truncated, num_unscored


def _encode_words(batch: dict, tokenizer, max_length: int) -> dict:
    """Word pieces of pre-split sentences, each word's tag on its first piece (-100 elsewhere)."""
    encoded = tokenizer(batch["tokens"], is_split_into_words=True, truncation=True, max_length=max_length)
    full_lengths = [len(ids) for ids in tokenizer(batch["tokens"], is_split_into_words=True)["input_ids"]]
    out = {name: encoded[name] for name in tokenizer.model_input_names if name in encoded}
    out["labels"], out["word_ids"], out["unscored_words"] = [], [], []
    for i, tags in enumerate(batch["tags"]):
        word_ids = encoded.word_ids(i)
        out["labels"].append(first_piece_labels(word_ids, tags))
        out["word_ids"].append([-1 if w is None else w for w in word_ids])
        out["unscored_words"].append(len(tags) - len({w for w in word_ids if w is not None}))
    out["length"] = [len(ids) for ids in out["input_ids"]]
    out["truncated"] = [full > max_length for full in full_lengths]
    return out


def first_piece_labels(word_ids: list[int | None], tags: list[int]) -> list[int]:
    """Each word's tag on its first piece; -100 (ignored by loss and metrics) on later pieces and special tokens."""
    labels, previous = [], None
    for word in word_ids:
        labels.append(IGNORE_INDEX if word is None or word == previous else tags[word])
        previous = word
    return labels


def _save_atomically(ds: datasets.Dataset, path: Path, meta: dict) -> None:
    """Written beside ``path`` and renamed in when complete; if another process got there first, its folder (the
    same data) is kept. Staging folders of killed writers are removed (`layertune.io`)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_partials(path.parent)
    tmp = path.parent / f".{path.name}.partial-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        with disk_full_said(path, ds.data.nbytes, tmp):  # datasets and Arrow say it as an OSError: said with the bytes
            tmp.mkdir()
            ds.save_to_disk(tmp)
            meta["checksums"] = {f.name: file_digest(f) for f in sorted(tmp.iterdir())}
            (tmp / META_FILE).write_text(json.dumps(meta, indent=1))  # written last: marks the folder complete
        try:
            os.rename(tmp, path)  # atomic on one filesystem
        except OSError:
            if not (path / META_FILE).is_file():  # not another process finishing first: a real failure
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _intact_meta(path: Path) -> dict | None:
    """The metadata of a complete, undamaged cache folder; None for a miss. A damaged one (a file missing or changed
    since it was written) is removed, logged and tokenized again: a corrupt cache is never used."""
    if not (path / META_FILE).is_file():
        return None
    try:
        meta = json.loads((path / META_FILE).read_text())
        damaged = [name for name, digest in meta["checksums"].items()
                   if not (path / name).is_file() or file_digest(path / name) != digest]
    except (OSError, ValueError, KeyError) as error:
        damaged = [f"{META_FILE} ({error})"]
    if not damaged:
        return meta
    logger.warning("Tokenized cache %s is damaged (%s); tokenizing again.", path, ", ".join(damaged))
    shutil.rmtree(path, ignore_errors=True)
    return None


# Findings about a cached split already said in this process: a study's cells, trained in one process, read the
# same split once each, and a finding about it is news once.
_reported: set[tuple] = set()


def _warn(cached: bool, finding: tuple, message: str, *args: object) -> None:
    if cached and finding in _reported:
        return
    _reported.add(finding)
    logger.warning(message + (" (cached)" if cached else ""), *args)


def _report_unscored_words(name: str, split: str, num_words: int, cached: bool) -> None:
    if num_words:
        _warn(cached, (name, split, "unscored", num_words), "%s/%s: %d words have no word piece left (cut off by "
              "truncation, or empty after tokenization): they get no prediction and are not scored", name, split,
              num_words)


def _report_truncation(name: str, split: str, num_truncated: int, num_examples: int, max_length: int,
                       cached: bool) -> None:
    if num_truncated:
        _warn(cached, (name, split, "truncated", num_truncated, max_length), "%s/%s: %d of %d examples (%.1f%%) "
              "truncated to max_length=%d tokens", name, split, num_truncated, num_examples,
              100 * num_truncated / max(num_examples, 1), max_length)
