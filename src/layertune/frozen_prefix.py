"""The frozen-prefix cache: compute the frozen bottom of the network once, train the top from its output.

With the embeddings and the bottom L-K layers frozen and in eval mode, the hidden states entering layer L-K are a
fixed function of the tokenized example. We store them once (unpadded, one flat array of every example's rows and
where each starts, per boundary) and train and evaluate the top K layers and the head from them: an epoch then costs
~3K units instead of L + 2K.

Exact: the pass computes the frozen layers as the uncached run does at every step (eval mode, the run's autocast
dtype) and keeps the dtype they hand on, so training from the cache gives the uncached run's losses up to the
rounding of other batch shapes. Cheap: the pass stops at the highest boundary it fills, in batches of similar
lengths; a run puts its states on its training device when they fit (`place`) and gathers each batch there.
Worth it: with ``frozen_prefix_cache="auto"`` a run first estimates both ways (`layertune.cache_costs`) and caches
only when that is cheaper, pass included; the decision and its numbers are in the run's record.

An entry is keyed by the frozen weights, the tokenized data, the boundary and the precision, written atomically
with a checksum, and verified on load: a corrupt or partial entry is rebuilt, never used. Building one leaves the
random generators and the model's train/eval modes as it found them, so a run that builds its entry trains exactly
like one that reads it. Its disk space is reserved before any state is computed: a full disk is an OSError naming
the folder and the bytes needed, and leaves nothing behind.

It stands below the language models that call it (`LanguageModel.prepare_examples`, `LanguageModel.cache_features`)
and asks of one only what it computes with: its tokenizer, its frozen layers (``frozen_prefix_layers``,
``boundary_states``) and its parameters by part. Which entries a study's cells will read is planned from their specs
(`layertune.model_specs.cache_boundary`).
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import shutil
from collections.abc import Iterable
from pathlib import Path

import datasets
import numpy as np
import pyarrow as pa
import torch
import xxhash
from tqdm.auto import tqdm

from layertune import cache_costs, timing
from layertune.batching import BoundaryStates, Examples, host_budget, states_home
from layertune.io import (DiskFull, atomic_directory, cache_root, check_writable, dataset_digest, file_digest,
                          write_json)
from layertune.tokenization import tokenize_corpus
from layertune.training_config import TrainingConfig, autocast_context, cache_decision, placed_on

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
CACHE_DTYPES = ("auto", *DTYPES)  # auto: the dtype the frozen layers hand on (exact)
# 2: data hashed column-wise; 3: the config without the folder it was loaded from; 4: every file checksummed;
# 5: the run's autocast in the key, rows in the pass's order (starts.npy), the pass's own measurements; 6: a bf16
# pass on a CPU attends with the math kernel, as its run's training does (training_config.autocast_context)
_FORMAT_VERSION = 6
_DISK_FULL = (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC))  # no space left; a quota reached


def prepare_examples(lm: torch.nn.Module, corpus, args: TrainingConfig | None = None, *, cache_dir=None,
                     device: torch.device | str = "cpu", autocast: torch.dtype | None = None,
                     ) -> tuple[dict[str, Examples], dict]:
    """Tokenized examples of every split (``train``, ``dev``, ``test`` where present) on ``device``, with cached
    frozen-prefix states where that is exact, enabled and (``frozen_prefix_cache="auto"``) cheaper.

    ``autocast``: the dtype the run computes in under autocast (None: none), which the cache pass computes in too.
    ``args``: the run's settings (max_length, frozen_prefix_cache, cache_dtype, cache_memory_mb, and the epochs and
    batch size the estimate weighs); default `TrainingConfig()`. Returns the splits and what ran (recorded in the
    run's metadata: the decision, why, and the estimates behind it).
    """
    args = args or TrainingConfig()
    device = torch.device(device)
    tokenized = _tokenized(lm, corpus, args.max_length, cache_dir)
    pad_id = lm.tokenizer.pad_token_id or 0
    splits = {split: Examples(data, pad_id) for split, data in tokenized.items()}
    boundary = lm.frozen_prefix_layers
    exact, reason = cache_decision(boundary, lm.frozen_dropout, args.frozen_prefix_cache, method=lm.method.name)
    info = {"used": exact, "reason": reason}
    if not exact:
        return {split: examples.to(device) for split, examples in splits.items()}, info
    cache = FrozenPrefixCache(cache_dir and Path(cache_dir) / "frozen_prefix", dtype=args.cache_dtype,
                              autocast=autocast)
    keys = {split: cache.key(lm, data, boundary) for split, data in tokenized.items()}
    budget = memory_budget(device, lm, args.cache_memory_mb)
    if args.frozen_prefix_cache == "auto":
        costs = cache_costs.estimate(lm, splits, boundary, args, device=device, autocast=autocast,
                                     built=[cache.pass_record(key) for key in keys.values()],
                                     state_dtype=cache.stored_dtype(lm), budget=budget)
        info["used"], info["reason"] = costs.decision()
        info["estimate"] = costs.record()
        if not info["used"]:
            return {split: examples.to(device) for split, examples in splits.items()}, info
    for split, data in tokenized.items():
        splits[split].boundary_states, info[f"{split}_entry"] = cache.states(lm, data, boundary, device=device)
    info.update(boundary=boundary, dtype=cache.dtype, autocast=_dtype_name(autocast),
                placement=place(splits.values(), device, budget))
    return splits, info


def cache_features(lm: torch.nn.Module, corpus, boundaries: list[int], *, max_length: int | None = None,
                   cache_dir=None, cache_dtype: str = "auto", device: torch.device | str = "cpu",
                   autocast: torch.dtype | None = None) -> dict:
    """Tokenize every split and cache, in one forward pass per split, the states entering each of ``boundaries``:
    what `prepare_examples` of any tunable-layers value with those boundaries will then find (it must compute under
    the same ``autocast``).

    Returns the tokenized splits' fingerprints and, per boundary and split, the cache entry's key."""
    tokenized = _tokenized(lm, corpus, max_length, cache_dir)
    found = {"tokenized": {split: dataset_digest(data) for split, data in tokenized.items()}, "frozen_prefix": {}}
    if boundaries:
        cache = FrozenPrefixCache(cache_dir and Path(cache_dir) / "frozen_prefix", dtype=cache_dtype,
                                  autocast=autocast, progress=False)
        for split, data in tokenized.items():
            for boundary, key in zip(sorted(set(boundaries)), cache.build(lm, data, boundaries, device=device)):
                found["frozen_prefix"].setdefault(boundary, {})[split] = key
    return found


def _tokenized(lm: torch.nn.Module, corpus, max_length: int | None, cache_dir) -> dict[str, datasets.Dataset]:
    lm.check_max_length(max_length)  # before tokenizing: a too-long max_length fails fast
    check_writable(Path(cache_dir) if cache_dir else cache_root())  # before any work, in one line
    return tokenize_corpus(corpus, lm.tokenizer, max_length=max_length,
                           cache_dir=cache_dir and Path(cache_dir) / "tokenized")


def memory_budget(device: torch.device, model: torch.nn.Module, cap_mb: float | None = None) -> int:
    """Bytes that cached states may take on ``device``, at most ``cap_mb`` MiB.

    On a GPU: what is free there now, less what training will still put there (the weights not yet moved, and for
    each trainable weight its gradient and AdamW's two moments in float32) and a quarter of the GPU for the
    activations of a batch and the allocator's slack. On the CPU (RAM is its memory): `host_budget`, half of what
    is available."""
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device()) if device.index is None else device  # as p.device
        free, total = torch.cuda.mem_get_info(device)
        free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)  # torch's cache is free to us
        weights = sum(p.numel() * p.element_size() for p in model.parameters() if p.device != device)
        training = sum(3 * 4 * p.numel() for p in model.parameters() if p.requires_grad)
        budget = free - weights - training - total // 4
    else:
        budget = host_budget()
    if cap_mb is not None:
        budget = min(budget, int(cap_mb * 2**20))
    return max(int(budget), 0)


def place(splits: Iterable[Examples], device: torch.device, budget: int) -> str:
    """Put the splits and their states where `states_home` says, and say where they went: on ``device`` when all
    states fit ``budget``; else in host memory, each batch gathered there and sent ahead of its step
    (`layertune.batching`): on the CPU from the memory-mapped entry; for a GPU from pinned memory, or from the
    memory map where they fit the host's budget neither. (``cache_memory_mb`` caps the device's budget only.)"""
    splits = list(splits)
    sizes = [e.boundary_states.nbytes for e in splits if e.boundary_states is not None]
    needed, home = sum(sizes), states_home(sizes, device, budget)
    if home == "device":
        for examples in splits:
            examples.to(device)
        return f"resident on {device.type} ({needed / 2**20:,.1f} MiB of a {budget / 2**20:,.0f} MiB budget)"
    for examples in splits:  # batches are gathered on the host: from pinned memory, or from the memory map
        examples.to("cpu", states=False)
        if device.type != "cpu" and examples.boundary_states is not None:
            states = examples.boundary_states
            examples.boundary_states = states.pinned(device) if home == "pinned" else states.mapped_for(device)
    where = {"pinned": "in pinned host memory, copied per batch", "mapped": "memory-mapped from disk" if device.type
             == "cpu" else "memory-mapped from disk, copied per batch (beyond the host's budget too)"}[home]
    return f"{where} ({needed / 2**20:,.1f} MiB over a {budget / 2**20:,.0f} MiB budget on {device.type})"


class FrozenPrefixCache:
    """On-disk store of boundary states, one entry per (frozen weights, tokenized data, boundary, precision).

    ``dtype``: how states are stored; "auto" (the default) keeps the dtype the frozen layers produce under
    ``autocast``, which makes training from them exact; float16/bfloat16 halve float32 states at a rounding cost.
    ``autocast``: the dtype the run computes in under autocast (None: none); the pass computes in it too, so the
    states equal those the uncached run computes at every step."""

    def __init__(self, root: str | Path | None = None, dtype: str = "auto", autocast: torch.dtype | None = None,
                 batch_size: int = 64, progress: bool = True) -> None:
        if dtype not in CACHE_DTYPES:
            raise ValueError(f"Unknown cache dtype {dtype!r}. Valid choices: {', '.join(CACHE_DTYPES)}.")
        self.root = Path(root) if root else cache_root() / "frozen_prefix"
        self.dtype, self.autocast = dtype, autocast
        self.batch_size = batch_size
        self.progress = progress

    def states(self, encoder, tokenized: datasets.Dataset, boundary: int, *,
               device: torch.device | str = "cpu") -> tuple[BoundaryStates, str]:
        """The states entering layer ``boundary`` for every example (memory-mapped from the entry), built on a miss;
        and the entry's name. ``device`` computes them on a miss."""
        key = self.key(encoder, tokenized, boundary)
        lengths = _lengths(tokenized)
        loaded = self._load(key, lengths)
        if loaded is None:
            self._compute(encoder, tokenized, [boundary], {boundary: key}, torch.device(device))
            loaded = self._load(key, lengths)
        return loaded, key

    def build(self, encoder, tokenized: datasets.Dataset, boundaries: Iterable[int], *,
              device: torch.device | str = "cpu") -> list[str]:
        """One forward pass that fills every missing boundary in ``boundaries``; returns all their keys."""
        keys = {b: self.key(encoder, tokenized, b) for b in sorted(set(boundaries))}
        lengths = _lengths(tokenized)
        missing = [b for b, key in keys.items() if self._load(key, lengths, check_only=True) is None]
        if missing:
            self._compute(encoder, tokenized, missing, {b: keys[b] for b in missing}, torch.device(device))
        return list(keys.values())

    def pass_record(self, key: str) -> dict | None:
        """What building entry ``key`` measured (device, seconds per padded token of the frozen prefix: None where a
        CPU built it), if it exists."""
        try:
            return json.loads((self.root / key / "meta.json").read_text())["pass"]
        except (OSError, ValueError, KeyError):
            return None

    def stored_dtype(self, encoder) -> torch.dtype:
        """The dtype this cache will store states in, as far as known before the pass: the one asked for, else (auto)
        the weights' (float32), which is also what BERT-style layers hand on under bf16 autocast (they end in a
        LayerNorm): an estimate never smaller than the states turn out."""
        return DTYPES.get(self.dtype) or next(encoder.parameters()).dtype

    # ----------------------------------------------------------------------------------------------------------

    def key(self, encoder, tokenized: datasets.Dataset, boundary: int) -> str:
        """Hash of what the states depend on: frozen weights below ``boundary``, config, data, precision."""
        digest = xxhash.xxh3_128()
        digest.update(f"v{_FORMAT_VERSION}|{boundary}|{self.dtype}|{_dtype_name(self.autocast)}|".encode())
        config = encoder.model.config.to_dict()
        config.pop("_name_or_path", None)  # where the files were read from: the same weights elsewhere still hit
        digest.update(json.dumps(config, sort_keys=True, default=str).encode())
        parts = encoder.parameter_parts()
        for name, parameter in encoder.named_parameters():
            part = parts[name]
            if part in ("embeddings", "other") or (part.startswith("layer.") and int(part[6:]) < boundary):
                digest.update(name.encode())
                digest.update(parameter.detach().cpu().contiguous().view(torch.uint8).numpy())  # no copy
        inputs = [c for c in ("input_ids", "token_type_ids", "attention_mask") if c in tokenized.column_names]
        digest.update(f"|{dataset_digest(tokenized, inputs)}".encode())
        return digest.hexdigest()

    def _load(self, key: str, lengths: np.ndarray, check_only: bool = False) -> BoundaryStates | bool | None:
        folder = self.root / key
        if not folder.is_dir():
            return None  # a miss; an entry folder appears only once complete (atomic rename)
        try:
            meta = json.loads((folder / "meta.json").read_text())
            path = folder / "states.npy"
            if path.stat().st_size != meta["states_bytes"] or file_digest(path) != meta["checksum"]:
                raise ValueError("states.npy: size or checksum mismatch")
            if file_digest(folder / "starts.npy") != meta["starts_checksum"]:
                raise ValueError("starts.npy: checksum mismatch")
            starts = np.load(folder / "starts.npy", allow_pickle=False)
            if len(starts) != len(lengths) or len(starts) != meta["examples"] or lengths.sum() != meta["tokens"] \
                    or (len(starts) and (starts.min() < 0 or (starts + lengths).max() > meta["tokens"])):
                raise ValueError("the rows do not match the examples")
        except (OSError, ValueError, KeyError, json.JSONDecodeError) as error:
            logger.warning("Frozen-prefix cache entry %s is corrupt (%s); rebuilding it.", folder, error)
            return None
        if check_only:
            return True
        flat = np.load(path, mmap_mode="r")
        return BoundaryStates(flat, torch.from_numpy(starts), lengths, DTYPES[meta["states_dtype"]])

    @torch.no_grad()
    @timing.compute("caching")
    def _compute(self, encoder, tokenized, boundaries: list[int], keys: dict[int, str], device) -> None:
        with placed_on(encoder, device):  # the dtype probe and the pass compute where the examples are
            self._compute_on_device(encoder, tokenized, boundaries, keys, device)

    def _compute_on_device(self, encoder, tokenized, boundaries: list[int], keys: dict[int, str], device) -> None:
        examples = Examples(tokenized, encoder.tokenizer.pad_token_id or 0).to(device)
        computed = self._computed_dtype(encoder, examples, boundaries, device)
        stored = DTYPES.get(self.dtype) or computed
        shape = (sum(examples.lengths), encoder.hidden_size)
        self.root.mkdir(parents=True, exist_ok=True)
        try:
            # The build runs where training is about to draw its dropout masks: it must leave every random
            # generator as it found it, or a run that builds an entry would train differently from one that reads it.
            with _random_state_kept(device), contextlib.ExitStack() as stack:  # every boundary's folder, or none
                folders = {keys[b]: stack.enter_context(atomic_directory(self.root / keys[b])) for b in boundaries}
                arrays = {b: _allocated_npy(folders[keys[b]] / "states.npy", _numpy_dtype(stored), shape)
                          for b in boundaries}
                starts, measured = self._fill(encoder, examples, arrays, stored, device)
                for b in boundaries:
                    arrays[b].flush()
                    self._finish_entry(folders[keys[b]], b, encoder, starts, shape[0], stored, computed, measured)
        except OSError as error:
            if error.errno not in _DISK_FULL:
                raise
            needed = len(boundaries) * shape[0] * shape[1] * torch.finfo(stored).bits // 8
            raise CacheDiskFull(error.errno, self.root, needed, boundaries) from error
        total = sum((self.root / keys[b] / "states.npy").stat().st_size for b in boundaries) / 2**20
        logger.info("Cached boundaries %s of %s: %.1f MiB in %s", boundaries, encoder.name, total, self.root)

    def _computed_dtype(self, encoder, examples: Examples, boundaries: list[int], device) -> torch.dtype:
        """The dtype the frozen layers hand on: the weights' without autocast; under autocast, as one short example
        shows (a LayerNorm at the end of a layer gives float32 under bfloat16 autocast on CPU and CUDA alike)."""
        if self.autocast is None:
            return next(encoder.parameters()).dtype
        shortest = int(np.argmin(examples.lengths))
        with autocast_context(device, self.autocast):
            states = encoder.boundary_states(examples.batch([shortest]), [min(boundaries)])
        return states[min(boundaries)].dtype

    def _fill(self, encoder, examples: Examples, arrays: dict[int, np.memmap], stored: torch.dtype,
              device) -> tuple[np.ndarray, dict]:
        """Run the frozen prefix over every example, in batches of similar lengths, under the run's autocast, and
        write each boundary's unpadded states one batch after another (the file's rows are in this order, ``starts``
        says where each example's begin). Returns ``starts`` and what the pass measured."""
        order = np.argsort(examples.lengths, kind="stable")  # similar lengths together: little padding
        batches = [order[i : i + self.batch_size] for i in range(0, len(order), self.batch_size)]
        starts, cursor = np.zeros(len(order), dtype=np.int64), 0
        description = f"caching layers < {max(arrays)} ({len(examples):,} examples)"
        for indices in tqdm(batches, desc=description, disable=None if self.progress else True, leave=False):
            batch = examples.batch(indices)
            sizes = examples.sizes_on_device[torch.as_tensor(indices, device=device)]
            real = torch.arange(batch["input_ids"].shape[1], device=device) < sizes[:, None]
            with autocast_context(device, self.autocast):
                states = encoder.boundary_states(batch, list(arrays))
            lengths = np.asarray(examples.lengths)[indices]
            starts[indices] = cursor + np.cumsum(lengths) - lengths
            for b, s in states.items():
                rows = s[real].to(stored).cpu()
                arrays[b][cursor : cursor + len(rows)] = _as_numpy(rows)
            cursor += int(lengths.sum())
        return starts, {"device": device.type, "tokens": cursor,
                        "forward_s_per_token": self._forward_cost(encoder, examples, batches, list(arrays), device)}

    def _forward_cost(self, encoder, examples: Examples, batches: list, boundaries: list[int], device) -> float | None:
        """What `"auto"` reuses on a GPU as the cost of recomputing the prefix: seconds per padded token of its
        forward, timed again after the pass on a few batches across the lengths. The pass's own batches cannot say:
        each has a length no batch before it had, and a GPU's first batch of a shape costs it several warm ones
        (on an H200, 1.2 s an epoch of bert-base measured against 5.1 s estimated from the pass, 2026-12-04). None
        on a CPU, whose `"auto"` counts token passes and reads no timing (`cache_costs.per_token_costs`)."""
        if device.type == "cpu":
            return None
        spread = [batches[i] for i in sorted({round(i) for i in np.linspace(0, len(batches) - 1,
                                                                             cache_costs.PROBE_BATCHES)})]
        return cache_costs.time_forward(encoder, examples, spread, max(boundaries), device, self.autocast)

    def _finish_entry(self, folder: Path, boundary: int, encoder, starts: np.ndarray, tokens: int,
                      stored: torch.dtype, computed: torch.dtype, measured: dict) -> None:
        np.save(folder / "starts.npy", starts)
        path = folder / "states.npy"
        write_json(folder / "meta.json", {
            "boundary": boundary, "dtype": _dtype_name(stored), "states_dtype": _dtype_name(computed),
            "autocast": _dtype_name(self.autocast), "examples": len(starts), "tokens": tokens,
            "hidden_size": encoder.hidden_size, "model": encoder.name, "states_bytes": path.stat().st_size,
            "checksum": file_digest(path), "starts_checksum": file_digest(folder / "starts.npy"),
            "format_version": _FORMAT_VERSION, "pass": measured,
        })


def _lengths(tokenized: datasets.Dataset) -> np.ndarray:
    column = tokenized.with_format("arrow")["input_ids"]
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    return np.asarray(column.value_lengths(), dtype=np.int64)


def _numpy_dtype(dtype: torch.dtype) -> np.dtype:
    return np.dtype(np.uint16) if dtype == torch.bfloat16 else torch.empty((), dtype=dtype).numpy().dtype


def _as_numpy(rows: torch.Tensor) -> np.ndarray:
    return rows.view(torch.int16).numpy().view(np.uint16) if rows.dtype == torch.bfloat16 else rows.numpy()


def _dtype_name(dtype: torch.dtype | None) -> str | None:
    return None if dtype is None else str(dtype).removeprefix("torch.")


def _random_state_kept(device: torch.device) -> contextlib.AbstractContextManager:
    """Every random generator the build could touch (the CPU's, and ``device``'s) restored when the block ends."""
    if device.type == "cpu":
        return torch.random.fork_rng(devices=[])
    module = getattr(torch, device.type)
    index = device.index if device.index is not None else getattr(module, "current_device", lambda: 0)()
    return torch.random.fork_rng(devices=[index], device_type=device.type)


def _allocated_npy(path: Path, dtype: np.dtype, shape: tuple[int, int]) -> np.memmap:
    """A new .npy file of ``shape``, every byte of it reserved on disk, mapped for writing.

    Writing to a mapped page that the disk cannot back raises SIGBUS ("Bus error"): the process dies with no
    Python error and its staging folder stays behind. With the blocks reserved first, a full disk is an ENOSPC
    OSError here, before any state is computed.
    """
    header = {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False, "shape": shape}
    with open(path, "wb") as file:
        np.lib.format.write_array_header_1_0(file, header)
        offset = file.tell()
        _reserve(file.fileno(), offset, offset + shape[0] * shape[1] * dtype.itemsize)
    return np.memmap(path, dtype=dtype, mode="r+", offset=offset, shape=shape)


def _reserve(fd: int, start: int, end: int) -> None:
    """Allocate bytes ``start`` to ``end`` of the file; where posix_fallocate is missing, by writing zeros."""
    allocate = getattr(os, "posix_fallocate", None)
    if allocate is not None and end > start:
        try:
            allocate(fd, start, end - start)
            return
        except OSError as error:
            if error.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                raise
    zeros = bytes(min(2**24, end - start))
    for position in range(start, end, len(zeros) or 1):
        os.pwrite(fd, zeros[: end - position], position)


class CacheDiskFull(DiskFull):
    """No room for a cache entry: names the folder, the bytes needed and free, and what to do (``advice``, which
    a caller that sets the folder itself, such as the study pipeline, replaces with its own)."""

    ADVICE = ("Free space there, point the cache at another disk (cache_dir=, --cache-dir or $LAYERTUNE_CACHE), "
              "store half-size states (cache_dtype='bfloat16'), or train without it (frozen_prefix_cache=False).")

    def __init__(self, code: int, root: Path, needed: int, boundaries: list[int], advice: str = ADVICE) -> None:
        self.root, self.needed, self.boundaries = root, needed, boundaries
        self.free = shutil.disk_usage(root).free if root.is_dir() else 0
        super().__init__(code, (
            f"Not enough disk space for the frozen-prefix cache in {root}: the states entering layer(s) "
            f"{', '.join(map(str, boundaries))} need {needed:,} bytes ({needed / 2**20:,.1f} MiB), and "
            f"{self.free:,} bytes are free. {advice} Nothing was left in the cache folder."))

    def advising(self, advice: str) -> CacheDiskFull:
        """The same error with other advice."""
        return CacheDiskFull(self.errno, self.root, self.needed, self.boundaries, advice)

    def __reduce__(self):  # pickled as a plain DiskFull, its message whole (a worker process sends it on)
        return DiskFull, (self.errno, self.strerror)
