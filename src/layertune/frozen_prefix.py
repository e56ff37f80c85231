"""The frozen-prefix cache: compute the frozen bottom of the network once, train the top from its output.

With the embeddings and the bottom L-K layers frozen and in eval mode, the hidden states entering layer L-K are a
fixed function of the tokenized example. We store them once (unpadded, one flat array + offsets per boundary) and
train and evaluate the top K layers and the head from them: an epoch then costs ~3K units instead of L + 2K.

An entry is keyed by the frozen weights, the tokenized data, the boundary layer and the dtype, written atomically
with a checksum, and verified on load: a corrupt or partial entry is rebuilt, never used.

`prepare_examples` gives a language model's tokenized splits, with their cached states where training from them is
exact and enabled (`layertune.training_config.cache_decision`); `cache_features` fills the entries of several
boundaries at once, in one forward pass per split.

Building an entry leaves the random generators and the model's train/eval modes as it found them, so a run that
builds its entry trains exactly like one that reads it. Its disk space is reserved before any state is computed: a
full disk is an OSError naming the folder and the bytes needed, and leaves nothing behind.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import shutil
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import datasets
import numpy as np
import pyarrow as pa
import torch
import xxhash
from tqdm.auto import tqdm

from layertune import timing
from layertune.batching import Examples
from layertune.io import atomic_directory, file_digest, write_json
from layertune.tokenization import tokenize_corpus
from layertune.training_config import cache_decision

if TYPE_CHECKING:
    from layertune.language_model import LanguageModel

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# 2: data hashed column-wise; 3: the config without the folder it was loaded from; 4: every file checksummed
_FORMAT_VERSION = 4
_DISK_FULL = (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC))  # no space left; a quota reached


def default_cache_root() -> Path:
    return Path(os.environ.get("LAYERTUNE_CACHE", Path.home() / ".cache" / "layertune"))


def prepare_examples(lm: LanguageModel, corpus, *, max_length: int | None = None, cache_dir=None,
                     frozen_prefix_cache: bool | str = "auto", cache_dtype: str = "float32",
                     device: torch.device | str = "cpu") -> tuple[dict[str, Examples], dict]:
    """Tokenized examples of every split (``train``, ``dev``, ``test`` where present), with cached frozen-prefix
    states where that is exact and enabled.

    Returns the splits and what ran (recorded in the run's metadata).
    """
    tokenized = _tokenized(lm, corpus, max_length, cache_dir)
    pad_id = lm.tokenizer.pad_token_id or 0
    use_cache, reason = cache_decision(lm.frozen_prefix_layers, lm.frozen_dropout, frozen_prefix_cache,
                                       method=lm.method.name)
    info = {"used": use_cache, "reason": reason}
    if not use_cache:
        return {split: Examples(data, pad_id) for split, data in tokenized.items()}, info
    cache = FrozenPrefixCache(cache_dir and Path(cache_dir) / "frozen_prefix", dtype=cache_dtype)
    splits = {}
    for split, data in tokenized.items():
        states, entry = cache.states(lm, data, lm.frozen_prefix_layers, device=device)
        splits[split] = Examples(data, pad_id, states)
        info[f"{split}_entry"] = entry
    info.update(boundary=lm.frozen_prefix_layers, dtype=cache_dtype)
    return splits, info


def cache_features(lm: LanguageModel, corpus, boundaries: list[int], *, max_length: int | None = None,
                   cache_dir=None, cache_dtype: str = "float32", device: torch.device | str = "cpu") -> dict:
    """Tokenize every split and cache, in one forward pass per split, the states entering each of ``boundaries``:
    what `prepare_examples` of any tunable-layers value with those boundaries will then find.

    Returns the tokenized splits' fingerprints and, per boundary and split, the cache entry's key."""
    tokenized = _tokenized(lm, corpus, max_length, cache_dir)
    found = {"tokenized": {split: data._fingerprint for split, data in tokenized.items()}, "frozen_prefix": {}}
    if boundaries:
        cache = FrozenPrefixCache(cache_dir and Path(cache_dir) / "frozen_prefix", dtype=cache_dtype, progress=False)
        for split, data in tokenized.items():
            for boundary, key in zip(sorted(set(boundaries)), cache.build(lm, data, boundaries, device=device)):
                found["frozen_prefix"].setdefault(boundary, {})[split] = key
    return found


def _tokenized(lm: LanguageModel, corpus, max_length: int | None, cache_dir) -> dict[str, datasets.Dataset]:
    lm.check_max_length(max_length)  # before tokenizing: a too-long max_length fails fast
    return tokenize_corpus(corpus, lm.tokenizer, max_length=max_length,
                           cache_dir=cache_dir and Path(cache_dir) / "tokenized")


class BoundaryStates(Sequence):
    """Per-example hidden states (tokens, hidden) stored as one flat (total tokens, hidden) array."""

    def __init__(self, flat: torch.Tensor | np.memmap, offsets: np.ndarray, dtype: str) -> None:
        self.flat, self.offsets, self.dtype = flat, offsets, dtype

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, index: int) -> torch.Tensor:
        rows = self.flat[self.offsets[index] : self.offsets[index + 1]]
        if isinstance(rows, np.ndarray):  # memory-mapped: copy just these rows off the disk
            rows = torch.from_numpy(np.array(rows))
            if self.dtype == "bfloat16":
                rows = rows.view(torch.bfloat16)
        return rows.float()


class FrozenPrefixCache:
    """On-disk store of boundary states; ``memory_budget_mb`` decides what is loaded into RAM vs memory-mapped."""

    def __init__(self, root: str | Path | None = None, dtype: str = "float32", memory_budget_mb: float = 4096,
                 batch_size: int = 64, progress: bool = True) -> None:
        if dtype not in DTYPES:
            raise ValueError(f"Unknown cache dtype {dtype!r}. Valid choices: {', '.join(DTYPES)}.")
        self.root = Path(root) if root else default_cache_root() / "frozen_prefix"
        self.dtype = dtype
        self.memory_budget_mb = memory_budget_mb
        self.batch_size = batch_size
        self.progress = progress

    def states(self, encoder, tokenized: datasets.Dataset, boundary: int, *,
               device: torch.device | str = "cpu") -> tuple[BoundaryStates, str]:
        """The states entering layer ``boundary`` for every example, built on a miss; and the entry's name."""
        key = self.key(encoder, tokenized, boundary)
        loaded = self._load(key)
        if loaded is None:
            self._compute(encoder, tokenized, [boundary], {boundary: key}, torch.device(device))
            loaded = self._load(key)
        return loaded, key

    def build(self, encoder, tokenized: datasets.Dataset, boundaries: Iterable[int], *,
              device: torch.device | str = "cpu") -> list[str]:
        """One forward pass that fills every missing boundary in ``boundaries``; returns all their keys."""
        keys = {b: self.key(encoder, tokenized, b) for b in sorted(set(boundaries))}
        missing = [b for b, key in keys.items() if self._load(key, check_only=True) is None]
        if missing:
            self._compute(encoder, tokenized, missing, {b: keys[b] for b in missing}, torch.device(device))
        return list(keys.values())

    # ----------------------------------------------------------------------------------------------------------

    def key(self, encoder, tokenized: datasets.Dataset, boundary: int) -> str:
        """Hash of what the states depend on: frozen weights below ``boundary``, config, data, dtype."""
        digest = xxhash.xxh3_128()
        digest.update(f"v{_FORMAT_VERSION}|{boundary}|{self.dtype}|".encode())
        config = encoder.model.config.to_dict()
        config.pop("_name_or_path", None)  # where the files were read from: the same weights elsewhere still hit
        digest.update(json.dumps(config, sort_keys=True, default=str).encode())
        parts = encoder.parameter_parts()
        for name, parameter in encoder.named_parameters():
            part = parts[name]
            if part in ("embeddings", "other") or (part.startswith("layer.") and int(part[6:]) < boundary):
                digest.update(name.encode())
                digest.update(parameter.detach().cpu().contiguous().view(torch.uint8).numpy())  # no copy
        for column in ("input_ids", "token_type_ids", "attention_mask"):
            if column in tokenized.column_names:
                # Whole Arrow columns (selections applied) rather than row by row: a row-wise read costs ~1 s
                # per 2,000 examples, paid by every run that looks its cache up.
                rows = tokenized.with_format("arrow")[column]
                if isinstance(rows, pa.ChunkedArray):
                    rows = rows.combine_chunks()
                digest.update(f"|{column}|".encode())
                digest.update(np.asarray(rows.value_lengths(), dtype=np.int64).tobytes())
                digest.update(np.asarray(rows.flatten(), dtype=np.int64).tobytes())
        return digest.hexdigest()

    def _load(self, key: str, check_only: bool = False) -> BoundaryStates | bool | None:
        folder = self.root / key
        if not folder.is_dir():
            return None  # a miss; an entry folder appears only once complete (atomic rename)
        try:
            meta = json.loads((folder / "meta.json").read_text())
            path = folder / "states.npy"
            if path.stat().st_size != meta["states_bytes"] or file_digest(path) != meta["checksum"]:
                raise ValueError("states.npy: size or checksum mismatch")
            if file_digest(folder / "offsets.npy") != meta["offsets_checksum"]:
                raise ValueError("offsets.npy: checksum mismatch")
            offsets = np.load(folder / "offsets.npy", allow_pickle=False)
            if len(offsets) != meta["examples"] + 1 or offsets[-1] != meta["tokens"]:
                raise ValueError("offsets do not match the metadata")
        except (OSError, ValueError, KeyError, json.JSONDecodeError) as error:
            logger.warning("Frozen-prefix cache entry %s is corrupt (%s); rebuilding it.", folder, error)
            return None
        if check_only:
            return True
        flat = np.load(path, mmap_mode="r")
        if meta["states_bytes"] <= self.memory_budget_mb * 2**20:
            flat = torch.from_numpy(np.array(flat))
            if meta["dtype"] == "bfloat16":
                flat = flat.view(torch.bfloat16)
        return BoundaryStates(flat, offsets, meta["dtype"])

    @torch.no_grad()
    @timing.compute("caching")
    def _compute(self, encoder, tokenized, boundaries: list[int], keys: dict[int, str], device) -> None:
        examples = Examples(tokenized, encoder.tokenizer.pad_token_id or 0)
        offsets = np.concatenate([[0], np.cumsum(examples.lengths)]).astype(np.int64)
        storage_dtype = np.dtype(np.uint16 if self.dtype == "bfloat16" else self.dtype)
        shape = (int(offsets[-1]), encoder.hidden_size)
        self.root.mkdir(parents=True, exist_ok=True)
        try:
            # The build runs where training is about to draw its dropout masks: it must leave every random
            # generator as it found it, or a run that builds an entry would train differently from one that reads it.
            with _random_state_kept(device), contextlib.ExitStack() as stack:  # every boundary's folder, or none
                folders = {keys[b]: stack.enter_context(atomic_directory(self.root / keys[b])) for b in boundaries}
                arrays = {b: _allocated_npy(folders[keys[b]] / "states.npy", storage_dtype, shape) for b in boundaries}
                self._fill(encoder, examples, offsets, arrays, device)
                for b in boundaries:
                    arrays[b].flush()
                    self._finish_entry(folders[keys[b]], b, encoder, len(examples), offsets)
        except OSError as error:
            if error.errno not in _DISK_FULL:
                raise
            needed = len(boundaries) * shape[0] * shape[1] * storage_dtype.itemsize
            raise OSError(error.errno, _no_space_message(self.root, needed, boundaries)) from error
        total = sum((self.root / keys[b] / "states.npy").stat().st_size for b in boundaries) / 2**20
        logger.info("Cached boundaries %s of %s: %.1f MiB in %s", boundaries, encoder.name, total, self.root)

    def _fill(self, encoder, examples: Examples, offsets: np.ndarray, arrays: dict[int, np.memmap], device) -> None:
        """Run the frozen prefix over every example, writing each boundary's states into its (unpadded) rows."""
        original_device = next(encoder.parameters()).device
        encoder.to(device)
        order = np.argsort(examples.lengths, kind="stable")  # similar lengths together: little padding
        batches = [order[i : i + self.batch_size] for i in range(0, len(order), self.batch_size)]
        description = f"caching layers < {max(arrays)} ({len(examples):,} examples)"
        try:
            for indices in tqdm(batches, desc=description, disable=None if self.progress else True, leave=False):
                batch = examples.collate([examples[i] for i in indices])
                batch = {k: v.to(device) for k, v in batch.items()}
                for b, states in encoder.boundary_states(batch, list(arrays)).items():
                    states = states.to("cpu", DTYPES[self.dtype])
                    if self.dtype == "bfloat16":
                        states = states.view(torch.int16)
                    for row, index in enumerate(indices):
                        start, end = offsets[index], offsets[index + 1]
                        arrays[b][start:end] = states[row, : end - start].numpy()
        finally:
            encoder.to(original_device)

    def _finish_entry(self, folder: Path, boundary: int, encoder, examples: int, offsets: np.ndarray) -> None:
        np.save(folder / "offsets.npy", offsets)
        path = folder / "states.npy"
        write_json(folder / "meta.json", {
            "boundary": boundary, "dtype": self.dtype, "examples": examples, "tokens": int(offsets[-1]),
            "hidden_size": encoder.hidden_size, "model": encoder.name, "states_bytes": path.stat().st_size,
            "checksum": file_digest(path), "offsets_checksum": file_digest(folder / "offsets.npy"),
            "format_version": _FORMAT_VERSION,
        })


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


def _no_space_message(root: Path, needed: int, boundaries: list[int]) -> str:
    free = shutil.disk_usage(root).free if root.is_dir() else 0
    return (f"Not enough disk space for the frozen-prefix cache in {root}: the states entering layer(s) "
            f"{', '.join(map(str, boundaries))} need {needed:,} bytes ({needed / 2**20:,.1f} MiB), and "
            f"{free:,} bytes are free. Free space there, point the cache at another disk (cache_dir=, "
            f"--cache-dir or $LAYERTUNE_CACHE), store half-size states (cache_dtype='bfloat16'), or train "
            "without it (frozen_prefix_cache=False). Nothing was left in the cache folder.")
