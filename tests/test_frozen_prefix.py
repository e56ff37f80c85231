"""The frozen-prefix cache: keyed by what the states depend on, never trusted when damaged, exact when used."""

import errno
import logging
import os
import shutil
import time

import numpy as np
import psutil
import pytest
import torch
import transformers

from layertune import LanguageModel, ModelTrainer, TextClassifier, batching, frozen_prefix, load_corpus
from layertune.batching import Examples, make_loader
from layertune.frozen_prefix import BoundaryStates, FrozenPrefixCache
from layertune.io import CacheNotWritable
from layertune.testing import make_tiny_model
from layertune.tokenization import tokenize_corpus
from layertune.training_config import autocast_context
from tests.conftest import ARCHITECTURES, toy_sentiment_corpus

MINILM = "sentence-transformers/all-MiniLM-L6-v2"


@pytest.fixture
def lm(tiny_bert):
    return LanguageModel(tiny_bert, tunable_layers=2)


@pytest.fixture
def tokenized(lm, tmp_path):
    return tokenize_corpus(toy_sentiment_corpus(24, 12), lm.tokenizer, cache_dir=tmp_path / "tokenized")


def cache(tmp_path, **options) -> FrozenPrefixCache:
    return FrozenPrefixCache(tmp_path / "frozen_prefix", progress=False, **options)


def as_list(states: BoundaryStates) -> list[torch.Tensor]:
    return [states[i] for i in range(len(states))]


def count_forwards(lm: LanguageModel) -> list:
    calls = []
    lm.model.register_forward_pre_hook(lambda *_: calls.append(1))  # a pass may stop before the model's end
    return calls


def entries(root) -> list[str]:
    return sorted(p.name for p in root.iterdir()) if root.exists() else []


# ---------------------------------------------------------------------------------------------------- keys


def test_key_changes_with_frozen_weights_data_boundary_and_dtype(lm, tokenized, tmp_path, tiny_bert):
    store = cache(tmp_path)
    train, dev = tokenized["train"], tokenized["dev"]
    key = store.key(lm, train, 2)
    assert store.key(lm, train, 2) == key
    assert store.key(lm, dev, 2) != key
    assert store.key(lm, train.select(range(len(train) - 1)), 2) != key
    assert store.key(lm, train.select([1, 0, *range(2, len(train))]), 2) != key  # order matters
    assert store.key(lm, train.select(range(len(train))).flatten_indices(), 2) == key  # content, not storage
    edited = train.map(lambda row, i: {"input_ids": [row["input_ids"][0] + (i == 5), *row["input_ids"][1:]]},
                       with_indices=True)  # one token id of one example differs
    assert store.key(lm, edited, 2) != key
    assert store.key(lm, train, 1) != key
    assert cache(tmp_path, dtype="bfloat16").key(lm, train, 2) != key
    assert cache(tmp_path, dtype="float16").key(lm, train, 2) != key
    other = LanguageModel(make_tiny_model(tmp_path / "other", "bert", seed=1), tunable_layers=2)
    assert store.key(other, train, 2) != key
    shutil.copytree(tiny_bert, tmp_path / "moved")  # the same weights read from another folder
    assert store.key(LanguageModel(tmp_path / "moved", tunable_layers=2), train, 2) == key
    with torch.no_grad():
        lm.layers[3].output.dense.weight.add_(1.0)  # above the boundary: the states do not depend on it
        assert store.key(lm, train, 2) == key
        lm.layers[1].output.dense.weight.add_(1.0)  # below it: they do
        assert store.key(lm, train, 2) != key


# ---------------------------------------------------------------------------------------------------- damage


def damage_truncate(path):
    path.write_bytes(path.read_bytes()[:-7])


def damage_flip_a_byte(path):
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(("file", "damage"), [
    ("states.npy", damage_truncate), ("states.npy", damage_flip_a_byte), ("meta.json", lambda p: p.unlink()),
    ("starts.npy", lambda p: p.unlink()), ("meta.json", lambda p: p.write_text("{")),
    ("starts.npy", damage_flip_a_byte),  # one flipped bit in offsets once trained a cell on misaligned states
], ids=["truncated-states", "bad-checksum", "missing-meta", "missing-starts", "broken-meta", "flipped-starts"])
def test_damaged_entry_is_detected_logged_and_rebuilt_never_used(lm, tokenized, tmp_path, caplog, file, damage):
    store = cache(tmp_path)
    good, key = store.states(lm, tokenized["train"], 2)
    good = [t.clone() for t in as_list(good)]
    damage(store.root / key / file)
    calls = count_forwards(lm)
    with caplog.at_level(logging.WARNING, logger="layertune.frozen_prefix"):
        rebuilt, rebuilt_key = store.states(lm, tokenized["train"], 2)
    assert rebuilt_key == key
    assert calls, "the damaged entry was used instead of rebuilt"
    assert any("corrupt" in r.message and key in r.message for r in caplog.records)
    for expected, actual in zip(good, as_list(rebuilt), strict=True):
        torch.testing.assert_close(actual, expected, atol=0, rtol=0)
    calls.clear()
    store.states(lm, tokenized["train"], 2)  # the rebuilt entry is whole again: a plain hit
    assert not calls


def test_interrupted_build_leaves_no_entry(lm, tokenized, tmp_path, monkeypatch):
    store = cache(tmp_path, batch_size=4)
    original, seen = lm.boundary_states, []

    def failing(batch, boundaries):
        seen.append(1)
        if len(seen) == 3:
            raise KeyboardInterrupt
        return original(batch, boundaries)

    monkeypatch.setattr(lm, "boundary_states", failing)
    with pytest.raises(KeyboardInterrupt):
        store.build(lm, tokenized["train"], [1, 2])
    assert entries(store.root) == []  # neither boundary, and no half-written staging folder
    monkeypatch.setattr(lm, "boundary_states", original)
    keys = store.build(lm, tokenized["train"], [1, 2])
    assert entries(store.root) == sorted(keys)


def failing_with(code: int):
    def fail(*_):
        raise OSError(code, os.strerror(code))
    return fail


@pytest.mark.parametrize("full_at", ["fallocate", "zero-fill"])
def test_full_disk_is_a_clear_error_naming_folder_and_size_and_leaves_nothing(lm, tokenized, tmp_path, monkeypatch,
                                                                             full_at):
    """A full disk once killed the build with SIGBUS (a mapped page the disk could not back), leaving .partial."""
    store = cache(tmp_path)
    if full_at == "fallocate":
        monkeypatch.setattr(os, "posix_fallocate", failing_with(errno.ENOSPC))
    else:  # a filesystem without fallocate: the zeros written instead hit the full disk
        monkeypatch.setattr(os, "posix_fallocate", failing_with(errno.EOPNOTSUPP))
        monkeypatch.setattr(os, "pwrite", failing_with(errno.ENOSPC))
    calls = count_forwards(lm)
    with pytest.raises(OSError, match="Not enough disk space for the frozen-prefix cache") as raised:
        store.build(lm, tokenized["train"], [1, 2])
    tokens = sum(len(ids) for ids in tokenized["train"]["input_ids"])
    needed = 2 * tokens * lm.hidden_size * 4
    assert raised.value.errno == errno.ENOSPC
    assert str(store.root) in str(raised.value) and f"{needed:,} bytes" in str(raised.value)
    assert not calls, "the states were computed before the space was known to be missing"
    assert entries(store.root) == []  # no entry and no .partial staging folder


def test_without_fallocate_the_states_are_written_the_same(lm, tokenized, tmp_path, monkeypatch):
    expected, _ = cache(tmp_path / "a").states(lm, tokenized["train"], 2)
    monkeypatch.setattr(os, "posix_fallocate", failing_with(errno.EOPNOTSUPP))
    actual, _ = cache(tmp_path / "b").states(lm, tokenized["train"], 2)
    for want, got in zip(as_list(expected), as_list(actual), strict=True):
        torch.testing.assert_close(got, want, atol=0, rtol=0)


# ---------------------------------------------------------------------------------------------------- building


def test_one_build_fills_several_boundaries_in_one_pass(lm, tokenized, tmp_path):
    store = cache(tmp_path, batch_size=8)
    train = tokenized["train"]
    calls = count_forwards(lm)
    keys = store.build(lm, train, [3, 1, 2, 4])
    assert len(calls) == -(-len(train) // 8)  # one forward per batch, whatever the number of boundaries
    assert len(set(keys)) == 4 and entries(store.root) == sorted(keys)
    calls.clear()
    assert store.build(lm, train, [1, 2, 3, 4]) == keys and not calls  # all present: nothing recomputed
    states, _ = store.states(lm, train, 2)
    assert not calls
    examples = Examples(train, lm.tokenizer.pad_token_id)
    batch = examples.batch(range(5))
    direct = lm.boundary_states(batch, [2])[2]
    for row in range(5):
        n = examples.lengths[row]
        torch.testing.assert_close(states[row], direct[row, :n], atol=1e-5, rtol=0)


def test_cache_features_fills_what_prepare_examples_then_reads(tiny_bert, tmp_path, monkeypatch):
    """The pipeline's tokenize stage fills every boundary its cells train from; each cell's prepare_examples then
    finds its entries (the same keys) and builds nothing."""
    corpus = toy_sentiment_corpus(24, 12)
    found = frozen_prefix.cache_features(LanguageModel(tiny_bert, tunable_layers=1), corpus, [3, 2],
                                         cache_dir=tmp_path)
    assert set(found["frozen_prefix"]) == {2, 3} and set(found["tokenized"]) == {"train", "dev"}
    builds = []
    monkeypatch.setattr(FrozenPrefixCache, "_compute", lambda *_: builds.append(1))
    for k, boundary in ((2, 2), (1, 3)):
        lm = LanguageModel(tiny_bert, tunable_layers=k)
        splits, info = lm.prepare_examples(corpus, cache_dir=tmp_path)
        assert info["used"] and info["boundary"] == boundary
        assert {split: info[f"{split}_entry"] for split in splits} == found["frozen_prefix"][boundary]
        assert len(splits["train"].boundary_states) == len(corpus.train)
    assert not builds


def test_memory_mapped_states_equal_in_ram_states(lm, tokenized, tmp_path):
    mapped, _ = cache(tmp_path).states(lm, tokenized["train"], 2)
    in_ram = mapped.to("cpu")
    assert isinstance(in_ram.flat, torch.Tensor) and isinstance(mapped.flat, np.memmap)
    for expected, actual in zip(as_list(in_ram), as_list(mapped), strict=True):
        assert actual.dtype == torch.float32
        torch.testing.assert_close(actual, expected, atol=0, rtol=0)


@pytest.mark.parametrize(("dtype", "tolerance"), [("bfloat16", 2**-8), ("float16", 2**-11)])
@pytest.mark.parametrize("in_ram", [True, False])
def test_half_precision_storage_round_trips(lm, tokenized, tmp_path, dtype, tolerance, in_ram):
    exact, _ = cache(tmp_path).states(lm, tokenized["train"], 2)
    half, _ = cache(tmp_path, dtype=dtype).states(lm, tokenized["train"], 2)
    half = half.to("cpu") if in_ram else half
    stored_bytes = half.flat.element_size() if isinstance(half.flat, torch.Tensor) else half.flat.itemsize
    assert stored_bytes == 2 and isinstance(half.flat, np.memmap) == (not in_ram)
    for expected, actual in zip(as_list(exact), as_list(half), strict=True):
        assert actual.dtype == torch.float32 and actual.shape == expected.shape  # handed on as computed
        torch.testing.assert_close(actual, expected, rtol=tolerance, atol=1e-6)


# ---------------------------------------------------------------------------------------------------- exactness


def test_building_an_entry_leaves_the_random_state_alone(lm, tokenized, tmp_path, monkeypatch):
    """Training draws its dropout masks right after the build: a build that moved the generator would make a run
    that builds its entry train differently from one that reads it. Here the forward itself draws."""
    original = lm.boundary_states

    def drawing(batch, boundaries):
        torch.rand(7)
        return original(batch, boundaries)

    monkeypatch.setattr(lm, "boundary_states", drawing)
    torch.manual_seed(3)
    expected = torch.random.get_rng_state()
    cache(tmp_path).states(lm, tokenized["train"], 2)
    assert torch.equal(torch.random.get_rng_state(), expected)


@pytest.mark.parametrize("train", [True, False])
def test_boundary_states_gives_every_module_its_mode_back(lm, train):
    lm.train(train)
    if train:  # as loaded: the wrapper in train mode around a model in eval mode
        lm.model.eval()
    modes = {name: module.training for name, module in lm.named_modules()}
    lm.boundary_states(lm.tokenize(["a fine film", "dull"]), [1, 2])
    assert {name: module.training for name, module in lm.named_modules()} == modes


@pytest.mark.parametrize("group_by_length", [False, True])
def test_cached_examples_are_batched_like_plain_ones(lm, tokenized, tmp_path, group_by_length):
    states, _ = cache(tmp_path).states(lm, tokenized["train"], 2)
    plain = Examples(tokenized["train"], lm.tokenizer.pad_token_id)
    cached = Examples(tokenized["train"], lm.tokenizer.pad_token_id, states)
    assert cached.lengths == plain.lengths == [len(s) for s in as_list(states)]
    loaders = [make_loader(e, 5, shuffle=True, seed=4, group_by_length=group_by_length) for e in (plain, cached)]
    batches = list(zip(*loaders, strict=True))
    for plain_batch, cached_batch in batches:
        assert torch.equal(plain_batch["input_ids"], cached_batch["input_ids"])
        assert cached_batch["boundary_states"].shape[:2] == cached_batch["input_ids"].shape
    assert len(batches) == 5


def record_steps(monkeypatch) -> list[float]:
    """Every training step's loss, as `ModelTrainer` computes it."""
    steps = []
    train_epoch = ModelTrainer._train_epoch

    def recording(self, *args):
        losses = train_epoch(self, *args)
        steps.extend(losses)
        return losses

    monkeypatch.setattr(ModelTrainer, "_train_epoch", recording)
    return steps


def train_sst2(model_path, corpus, cache_dir, frozen_prefix_cache, group_by_length, steps, mixed_precision="no"):
    """A real cell: MiniLM-L3 with K=2, dropout on; returns the result and this run's step losses."""
    steps.clear()
    transformers.set_seed(1)
    model = TextClassifier(LanguageModel(model_path, tunable_layers=2, pooling="mean"), 2)
    assert model.encoder.model.config.hidden_dropout_prob > 0  # dropout masks in the trained layers
    result = ModelTrainer(model, corpus, cache_dir=cache_dir).train(
        seed=1, epochs=1, batch_size=16, learning_rate=1e-4, head_learning_rate=3e-3, eval_batch_size=64,
        group_by_length=group_by_length, frozen_prefix_cache=frozen_prefix_cache, mixed_precision=mixed_precision,
        progress=False)
    return result, list(steps)


@pytest.mark.integration
@pytest.mark.parametrize("group_by_length", [False, True], ids=["random-batches", "length-grouped"])
def test_real_cell_trains_alike_from_a_cold_cache_a_warm_one_and_none(minilm_l3, data_mirror, tmp_path, monkeypatch,
                                                                     group_by_length):
    corpus = load_corpus("sst2", data_mirror=data_mirror, train_size=200, dev_size=200)
    builds, steps = [], record_steps(monkeypatch)
    compute = FrozenPrefixCache._compute
    monkeypatch.setattr(FrozenPrefixCache, "_compute", lambda self, *a: builds.append(1) or compute(self, *a))

    cold, cold_steps = train_sst2(minilm_l3, corpus, tmp_path, True, group_by_length, steps)
    assert len(builds) == 2  # train and dev entries built by this run
    warm, warm_steps = train_sst2(minilm_l3, corpus, tmp_path, True, group_by_length, steps)
    assert len(builds) == 2  # read, not rebuilt
    plain, plain_steps = train_sst2(minilm_l3, corpus, tmp_path, False, group_by_length, steps)
    assert cold.frozen_prefix_cache["used"] and not plain.frozen_prefix_cache["used"]
    assert len(cold_steps) == 13

    # Cold and warm read the very same states: bit for bit the same run.
    assert warm_steps == cold_steps and warm.history[0]["eval_loss"] == cold.history[0]["eval_loss"]
    assert warm.predictions == cold.predictions
    # Without the cache the frozen layers run in other batch shapes: the same run up to float rounding.
    torch.testing.assert_close(torch.tensor(plain_steps), torch.tensor(cold_steps), rtol=1e-5, atol=0)
    assert plain.history[0]["eval_loss"] == pytest.approx(cold.history[0]["eval_loss"], rel=1e-5)
    assert plain.predictions == cold.predictions


def cached_and_uncached_logits(model: TextClassifier, texts, train_mode=False):
    encoder = model.encoder
    batch = encoder.tokenize(texts)
    boundary = encoder.frozen_prefix_layers
    states = encoder.boundary_states(batch, [boundary])[boundary]
    model.train(train_mode)
    with torch.no_grad():
        torch.manual_seed(0)
        uncached = model(batch)
        torch.manual_seed(0)
        cached = model({**batch, "boundary_states": states})
    return cached, uncached


@pytest.mark.parametrize("architecture", ARCHITECTURES)
@pytest.mark.parametrize("k", [0, 1, 3])
def test_cached_logits_equal_uncached(tiny_model_dirs, architecture, k):
    transformers.set_seed(0)
    model = TextClassifier(LanguageModel(tiny_model_dirs[architecture], tunable_layers=k, pooling="mean"), 2)
    cached, uncached = cached_and_uncached_logits(model, ["the movie was great", "awful", "a fun , dull plot !"])
    torch.testing.assert_close(cached, uncached, atol=1e-5, rtol=0)


def test_cached_logits_equal_uncached_in_train_mode_with_dropout(tiny_bert):
    """Frozen layers draw no dropout masks, so the same seed gives the same masks above the boundary."""
    transformers.set_seed(0)
    model = TextClassifier(LanguageModel(tiny_bert, tunable_layers=2, hidden_dropout_prob=0.3), 2)
    cached, uncached = cached_and_uncached_logits(model, ["the movie was great", "so boring"], train_mode=True)
    torch.testing.assert_close(cached, uncached, atol=1e-5, rtol=0)


def test_cached_examples_batch_gives_the_uncached_logits(lm, tokenized, tmp_path):
    """Through the real data path: cached Examples + collate, against plain Examples, on a fixed batch."""
    transformers.set_seed(0)
    model = TextClassifier(lm, 2).eval()
    states, _ = cache(tmp_path).states(lm, tokenized["dev"], lm.frozen_prefix_layers)
    plain = Examples(tokenized["dev"], lm.tokenizer.pad_token_id)
    cached = Examples(tokenized["dev"], lm.tokenizer.pad_token_id, states)
    indices = [0, 3, 5, 7, 11]
    with torch.no_grad():
        expected = model(plain.batch(indices))
        actual = model(cached.batch(indices))
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=0)


@pytest.mark.integration
def test_real_minilm_cached_logits_equal_uncached():
    transformers.set_seed(0)
    model = TextClassifier(LanguageModel(MINILM, tunable_layers=2), 2)
    sentences = [
        "a gripping , beautifully acted drama that stays with you long after the credits .",
        "the plot is thin and the jokes fall flat .",
        "not the best film of the year , but far from the worst",
        "an utterly forgettable sequel",
    ]
    cached, uncached = cached_and_uncached_logits(model, sentences)
    torch.testing.assert_close(cached, uncached, atol=1e-5, rtol=0)
    cached, uncached = cached_and_uncached_logits(model, sentences, train_mode=True)
    torch.testing.assert_close(cached, uncached, atol=1e-5, rtol=0)


# ---------------------------------------------------------------------------------------------------- on the device


def test_the_pass_computes_under_the_runs_autocast_and_keeps_the_dtype_the_layers_hand_on(lm, tokenized, tmp_path):
    """Under bf16 autocast the uncached run computes the frozen layers in bf16 at every step; states built in float32
    differ from those by more than rounding. The pass computes as the run does, so for the same batch shape its states
    are the very ones the uncached forward computes."""
    train = tokenized["train"]
    store = cache(tmp_path, autocast=torch.bfloat16, batch_size=len(train))  # one batch: the shape of `direct`
    states, key = store.states(lm, train, 2)
    assert key != cache(tmp_path).key(lm, train, 2)  # a float32 run never reads a bf16 run's states
    examples = Examples(train, lm.tokenizer.pad_token_id)
    order = np.argsort(examples.lengths, kind="stable").tolist()
    with autocast_context(torch.device("cpu"), torch.bfloat16):  # as the run computes: its autocast and attention
        direct = lm.boundary_states(examples.batch(order), [2])[2]
    float32 = lm.boundary_states(examples.batch(order), [2])[2]
    assert direct.dtype == torch.float32  # BERT's layers end in a LayerNorm, which autocast runs in float32
    assert meta(store, key)["states_dtype"] == "float32" and meta(store, key)["autocast"] == "bfloat16"
    for row, index in enumerate(order):
        n = examples.lengths[index]
        assert torch.equal(states[index], direct[row, :n])
    assert not all(torch.equal(states[i], float32[row, : examples.lengths[i]]) for row, i in enumerate(order))


def test_every_forward_of_the_pass_runs_with_the_encoder_on_the_device_asked_for(lm, tokenized, tmp_path,
                                                                                monkeypatch):
    """The pass computes on ``device`` (the training device) wherever the encoder sits, and leaves it where it was.
    On a GPU the examples go there first; an encoder left on the CPU for the autocast dtype probe failed every cached
    run there ("index is on cuda:0, different from other tensors on cpu", benchmarks/gpu_check.sh). This CPU-only
    machine has one device, so the test follows where the encoder is asked to be at each forward."""
    placed, forwards = [torch.device("cpu")], []
    move, boundary_states = lm.to, lm.boundary_states

    def to(device, *args, **kwargs):
        placed.append(torch.device(device))
        return move(device, *args, **kwargs)

    monkeypatch.setattr(lm, "to", to)
    monkeypatch.setattr(lm, "boundary_states", lambda *a, **k: forwards.append(placed[-1]) or boundary_states(*a, **k))
    asked_for = torch.device("cpu", 0)  # the same device as "cpu", named otherwise: the pass must move the encoder
    cache(tmp_path, autocast=torch.bfloat16).states(lm, tokenized["train"], 2, device=asked_for)
    assert len(forwards) >= 2 and set(forwards) == {asked_for}  # the dtype probe under autocast, then the batches
    assert placed[-1] == torch.device("cpu")  # and back where it was


def meta(store: FrozenPrefixCache, key: str) -> dict:
    import json

    return json.loads((store.root / key / "meta.json").read_text())


def test_the_pass_runs_no_layer_above_the_highest_boundary(lm, tokenized, tmp_path):
    ran = []
    for index, layer in enumerate(lm.layers):
        layer.register_forward_hook(lambda *_, index=index: ran.append(index))  # after the layer ran
    cache(tmp_path, batch_size=100).build(lm, tokenized["train"], [1, 2])
    assert sorted(set(ran)) == [0, 1]  # layers 2 and 3 are above both boundaries
    ran.clear()
    lm.boundary_states(lm.tokenize(["a fine film"]), [4])  # the top boundary (K = 0) needs the whole stack
    assert ran == [0, 1, 2, 3]


def test_a_pass_records_its_forward_timed_warm_and_a_cpu_pass_times_nothing(lm, tokenized, tmp_path, monkeypatch,
                                                                           device):
    """`"auto"` reuses what a GPU's pass measured as the cost of recomputing the frozen layers. A GPU's first batch of
    a shape is slow (kernels chosen, memory allocated) and every batch of the pass has a shape of its own: on an H200
    that made the estimate 4x the measured epoch. A CPU's `"auto"` reads no timing: its pass runs each batch once."""
    forward, shapes = lm.boundary_states, []

    def slow_at_a_new_shape(batch, boundaries):
        shape = tuple(batch["input_ids"].shape)
        if shape not in shapes:
            time.sleep(0.5)
        shapes.append(shape)
        return forward(batch, boundaries)

    monkeypatch.setattr(lm, "boundary_states", slow_at_a_new_shape)
    cache(tmp_path, batch_size=8).build(lm, tokenized["train"], [2], device=device)
    measured = meta(cache(tmp_path), cache(tmp_path).key(lm, tokenized["train"], 2))["pass"]
    batches = -(-len(tokenized["train"]) // 8)
    assert measured["device"] == device.type and measured["tokens"] == sum(tokenized["train"]["length"])
    if device.type == "cpu":
        assert measured["forward_s_per_token"] is None and len(shapes) == batches, measured
    else:  # 3 batches across the lengths, each seen before it is timed
        assert len(shapes) == batches + 2 * 3 and 0 < measured["forward_s_per_token"] * measured["tokens"] < 0.5


def test_the_probe_times_each_batch_shape_after_its_first_sight(device):
    """The estimate's own timing of a run's batches (`time_forward`, `_time_read`): a shape's first batch is slow on
    a GPU, and the run's later epochs see that shape again. Timing only the first batch's again measured the rest
    cold."""
    from layertune.cache_costs import seconds_per_padded_token

    seen = []

    def run(batch) -> int:
        if batch not in seen:
            time.sleep(0.3)
            seen.append(batch)
        return 100

    seconds = seconds_per_padded_token([(16, 30), (16, 41), (16, 57)], run, device)
    assert 0 <= seconds * 300 < 0.1, seconds  # three batches of 100 padded tokens, none timed at its first sight


@pytest.mark.parametrize("budgets", ["resident", "over-budget", "over-both-budgets"])
def test_states_go_to_the_device_when_they_fit_the_budget_and_train_the_same_when_not(tiny_bert, tmp_path, budgets,
                                                                                     monkeypatch, device):
    """Resident on the device, else (for a GPU) in pinned host memory, else (beyond the host's budget too) in the
    memory map; on the CPU, resident or memory-mapped. Where the states live changes no number."""
    steps = record_steps(monkeypatch)
    corpus = toy_sentiment_corpus(40, 12)

    def train(memory_mb):
        transformers.set_seed(0)
        model = TextClassifier(LanguageModel(tiny_bert, tunable_layers=1, hidden_dropout_prob=0.2), 2)
        return ModelTrainer(model, corpus, cache_dir=tmp_path / "shared").train(
            seed=0, epochs=2, batch_size=8, frozen_prefix_cache=True, cache_memory_mb=memory_mb, progress=False)

    resident = train(None)
    assert resident.frozen_prefix_cache["placement"].startswith(f"resident on {device.type}")
    steps_resident = list(steps)
    steps.clear()
    if budgets == "over-both-budgets":  # the host has 1 KiB to spare (the tokens stay on the device all the same)
        monkeypatch.setattr(psutil, "virtual_memory", lambda: type("Memory", (), {"available": 2048})())
    result = train(None if budgets == "resident" else 1e-6)
    beyond = {"resident": f"resident on {device.type}", "over-budget": "in pinned host memory",
              "over-both-budgets": "memory-mapped from disk, copied per batch"}[budgets]
    placement = result.frozen_prefix_cache["placement"]
    assert placement.startswith("memory-mapped from disk" if device.type == "cpu" and budgets != "resident"
                                else beyond), placement
    assert steps == steps_resident and result.predictions == resident.predictions


def test_states_beyond_the_gpu_and_the_host_budget_stay_memory_mapped_and_go_to_the_gpu_per_batch(
        lm, tokenized, tmp_path, monkeypatch):
    """Pinning copies the states into RAM; where they fit neither the GPU's budget nor the host's, they stay in the
    memory-mapped entry and each batch is gathered from it for the GPU (on a CPU machine too: nothing touches CUDA)."""
    states, _ = cache(tmp_path).states(lm, tokenized["train"], 2)
    examples = Examples(tokenized["train"], lm.tokenizer.pad_token_id, states)
    monkeypatch.setattr(psutil, "virtual_memory", lambda: type("Memory", (), {"available": 1024})())
    gpu = torch.device("cuda", 0)
    placement = frozen_prefix.place([examples], gpu, budget=0)
    assert placement.startswith("memory-mapped from disk, copied per batch (beyond the host's budget too)"), placement
    assert isinstance(examples.boundary_states.flat, np.memmap) and examples.host_batches_for == gpu
    batch = next(iter(make_loader(examples, 4)))  # gathered on the host, for the loader to pin and send
    assert batch["boundary_states"].device.type == "cpu"
    assert torch.equal(batch["boundary_states"][1, : examples.lengths[1]], states[1])


def test_states_for_a_gpu_are_pinned_where_the_host_holds_them_as_torch_counts_pinned_memory(lm, tokenized, tmp_path,
                                                                                             monkeypatch):
    """torch's pinned allocator rounds each buffer up to a power of two: 3 MiB of states take 4 MiB pinned."""
    gpu = torch.device("cuda", 0)
    for available_mib, home in [(7, "mapped"), (8, "pinned")]:  # the host's budget is half of what is available
        memory = type("Memory", (), {"available": available_mib * 2**20})()
        monkeypatch.setattr(psutil, "virtual_memory", lambda: memory)
        assert batching.states_home([3 * 2**20], gpu, budget=0) == home
        assert batching.states_home([3 * 2**20], torch.device("cpu"), budget=0) == "mapped"  # RAM is the CPU's device
    assert batching.states_home([3 * 2**20], gpu, budget=3 * 2**20) == "device"
    pinned = []  # and place() pins them (pinning itself needs CUDA: recorded here)
    monkeypatch.setattr(BoundaryStates, "pinned", lambda self, target: pinned.append(target) or self)
    states, _ = cache(tmp_path).states(lm, tokenized["train"], 2)
    examples = Examples(tokenized["train"], lm.tokenizer.pad_token_id, states)
    assert frozen_prefix.place([examples], gpu, budget=0).startswith("in pinned host memory")
    assert pinned == [gpu]


def test_an_entry_read_into_memory_a_slice_at_a_time_holds_every_row_and_a_zero_row_after(lm, tokenized, tmp_path,
                                                                                        monkeypatch):
    """Resident states (and pinned ones, for a GPU) are read from the memory map in slices; here of 7 rows, or the
    first size from 7 up that leaves the last slice short."""
    states, _ = cache(tmp_path).states(lm, tokenized["train"], 2)
    rows = len(states.flat)
    monkeypatch.setattr(batching, "READ_SLICE_ROWS", next(n for n in range(7, rows) if rows % n))
    read = states.to("cpu")
    assert torch.equal(read.flat[:-1], torch.from_numpy(np.array(states.flat))) and not read.flat[-1].any()
    assert all(torch.equal(read[i], states[i]) for i in range(len(states)))


def test_a_batch_is_gathered_and_padded_like_its_examples(lm, tokenized, tmp_path):
    states, _ = cache(tmp_path).states(lm, tokenized["train"], 2)
    examples = Examples(tokenized["train"], lm.tokenizer.pad_token_id, states).to("cpu")
    indices = [5, 0, 17, 3]
    batch = examples.batch(indices)
    width = max(examples.lengths[i] for i in indices)
    assert batch["input_ids"].shape == (4, width) and batch["boundary_states"].shape == (4, width, lm.hidden_size)
    for row, index in enumerate(indices):
        n = examples.lengths[index]
        assert batch["input_ids"][row, :n].tolist() == tokenized["train"][index]["input_ids"]
        assert (batch["input_ids"][row, n:] == lm.tokenizer.pad_token_id).all()
        assert batch["attention_mask"][row].tolist() == [1] * n + [0] * (width - n)
        assert torch.equal(batch["boundary_states"][row, :n], states[index])
        assert not batch["boundary_states"][row, n:].any()
        assert batch["labels"][row] == tokenized["train"][index]["labels"]


# ---------------------------------------------------------------------------------------------------- auto


def test_auto_declines_the_cache_where_reading_costs_more_and_says_why(tiny_bert, tmp_path, monkeypatch):
    """As on a GPU where recomputing a few layers is cheaper than reading their states from host memory."""
    from layertune import cache_costs

    # timed as on a GPU: a microsecond per token to recompute, a second to read
    monkeypatch.setattr(cache_costs, "per_token_costs", lambda *_, **__: (1e-6, 1.0, "s"))
    model = TextClassifier(LanguageModel(tiny_bert, tunable_layers=1), 2)
    result = ModelTrainer(model, toy_sentiment_corpus(24, 12), cache_dir=tmp_path).train(epochs=1, progress=False)
    record = result.frozen_prefix_cache
    assert not record["used"] and record["reason"].startswith("not cached, by estimate"), record
    assert record["estimate"]["cached_s"] > record["estimate"]["uncached_s"] > 0
    assert not (tmp_path / "frozen_prefix").exists()  # declined before any state was computed


def test_auto_counts_the_pass_once_and_weighs_it_against_the_epochs():
    from layertune.cache_costs import MARGIN, CacheCosts

    def costs(pass_s, epochs):
        return CacheCosts(forward_s_per_epoch=1.0, read_s_per_epoch=0.1, uncached_s=1.0 * epochs,
                          cached_s=pass_s + 0.1 * epochs, pass_s=pass_s, epochs=epochs, states_at="cpu memory")

    assert costs(pass_s=0.0, epochs=1).decision()[0]  # the entry exists: reading beats recomputing
    assert not costs(pass_s=1.0, epochs=1).decision()[0]  # one epoch does not repay a pass as long as itself
    assert costs(pass_s=1.0, epochs=3).decision()[0]  # three do
    near_tie = costs(pass_s=MARGIN * 4 - 0.4 + 0.01, epochs=4)
    assert not near_tie.decision()[0]  # within the margin: uncached, the estimate could be wrong either way
    assert "pass 1" in costs(pass_s=1.0, epochs=3).decision()[1]


def test_auto_decides_alike_in_every_run_on_the_cpu(tiny_bert, tmp_path):
    """On the CPU the estimate counts tokens (no timing), so a seeded run decides the same in any process."""
    records = []
    for run in range(2):
        model = TextClassifier(LanguageModel(tiny_bert, tunable_layers=1), 2)
        records.append(model.encoder.prepare_examples(toy_sentiment_corpus(24, 12), cache_dir=tmp_path / str(run))[1])
    assert records[0]["estimate"] == records[1]["estimate"] and records[0]["estimate"]["unit"] == "token passes"
    assert records[0]["used"] == records[1]["used"] is True


@pytest.mark.integration
def test_auto_caches_the_real_model_on_this_cpu_and_records_its_estimate(minilm_l3, data_mirror, tmp_path):
    corpus = load_corpus("sst2", data_mirror=data_mirror, train_size=128, dev_size=64)
    model = TextClassifier(LanguageModel(minilm_l3, tunable_layers=1, pooling="mean"), 2)
    result = ModelTrainer(model, corpus, cache_dir=tmp_path).train(epochs=2, batch_size=16, progress=False,
                                                                    output_dir=tmp_path / "run")
    record = result.frozen_prefix_cache
    assert record["used"] and record["reason"].startswith("cached, by estimate"), record
    estimate = record["estimate"]
    assert estimate["pass_s"] > 0 and estimate["epochs"] == 2
    assert estimate["read_s_per_epoch"] < estimate["forward_s_per_epoch"]  # reading RAM beats recomputing
    import json

    assert json.loads((tmp_path / "run" / "run_info.json").read_text())["frozen_prefix_cache"] == record


@pytest.mark.integration
@pytest.mark.parametrize("group_by_length", [False, True], ids=["random-batches", "length-grouped"])
def test_real_cell_under_bf16_autocast_trains_alike_from_the_cache_and_without(minilm_l3, data_mirror, tmp_path,
                                                                              monkeypatch, group_by_length):
    """Under bf16 autocast the frozen layers' output differs with the batch shape by bf16 rounding (the pass sorts
    by length, training draws batches at random): step losses agree within 2e-3 relative (bf16's epsilon is 3.9e-3;
    measured 4.8e-4), dev predictions but for at most one of 200 (the math attention kernel's rounding moves one
    under one thread, none under two). A pass in float32, as before, moved a prediction and doubled the gap.
    On a CPU without native bfloat16 (where the library refuses bf16 as slower than float32) autocast is emulated,
    rounding as the native kernels do not: the two runs must agree all the same, so it runs there too."""
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True)
    corpus = load_corpus("sst2", data_mirror=data_mirror, train_size=200, dev_size=200)
    steps = record_steps(monkeypatch)
    cached, cached_steps = train_sst2(minilm_l3, corpus, tmp_path, True, group_by_length, steps,
                                      mixed_precision="bf16")
    plain, plain_steps = train_sst2(minilm_l3, corpus, tmp_path, False, group_by_length, steps,
                                    mixed_precision="bf16")
    assert cached.frozen_prefix_cache["used"] and cached.frozen_prefix_cache["autocast"] == "bfloat16"
    torch.testing.assert_close(torch.tensor(cached_steps), torch.tensor(plain_steps), rtol=2e-3, atol=0)
    assert cached.history[0]["eval_loss"] == pytest.approx(plain.history[0]["eval_loss"], rel=1e-3)
    moved = [a != b for a, b in zip(cached.predictions["dev"]["predictions"], plain.predictions["dev"]["predictions"])]
    assert len(moved) == 200 and sum(moved) <= 1


def test_the_pipeline_names_its_own_cache_setting_when_the_disk_is_full(tiny_bert, tmp_path, monkeypatch):
    """The library's advice names cache_dir= and $LAYERTUNE_CACHE, which the pipeline does not read."""
    from pipelines.plans import FeaturePlan
    from pipelines.tokenize.nodes import build_features

    monkeypatch.setattr(os, "posix_fallocate", failing_with(errno.ENOSPC))
    spec = frozen_prefix_spec(tiny_bert)
    plan = FeaturePlan(tasks=["toy"], models=[spec], boundaries=[[2]], settings={}, max_length=None,
                       cache_dtype="auto")
    with pytest.raises(OSError, match="Not enough disk space") as raised:
        build_features({"toy": toy_sentiment_corpus(24, 12)}, plan, tmp_path / "cache")
    message = str(raised.value)
    assert "feature_cache (conf/base/catalog.yml" in message and "training.cache_dtype: bfloat16" in message
    assert "$LAYERTUNE_CACHE" not in message


def frozen_prefix_spec(model):
    from layertune.specs import EncoderSpec

    return EncoderSpec(model=str(model), tunable_layers="all", pooling="cls")


def test_a_cache_folder_that_cannot_be_written_is_one_line_before_any_work(tiny_bert, tmp_path, monkeypatch):
    """A read-only cache gave a raw PermissionError from deep inside the tokenizer's cache (root writes anyway:
    the refusal is simulated)."""
    import tempfile

    def refuse(*_, **__):
        raise PermissionError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(tempfile, "TemporaryFile", refuse)
    model = TextClassifier(LanguageModel(tiny_bert, tunable_layers=1), 2)
    with pytest.raises(CacheNotWritable, match=r"Cannot write the layertune cache folder .*"
                       r"\(Read-only file system\)\. Point the cache at a folder you can write") as raised:
        model.encoder.prepare_examples(toy_sentiment_corpus(24, 12), cache_dir=tmp_path / "cache")
    assert "\n" not in str(raised.value)
    assert not (tmp_path / "cache" / "tokenized").exists()  # nothing tokenized first
