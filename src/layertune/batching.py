"""From tokenized examples to padded batches, built with tensor operations on the device that trains.

Every per-token column is one flat tensor of all examples' tokens end to end, with where each example starts and how
long it is; a batch is a gather of those rows into a (batch, longest) grid, padded by a mask (`Examples.batch`).
With the examples on the training device (`Examples.to`) a batch never leaves it: no per-example Python, no host
copy per step. The frozen prefix's cached states (`BoundaryStates`, written by `layertune.frozen_prefix`) are held
the same way, one flat array of rows, and gathered into the same grid. Where they do not fit on the training device,
they stay in host memory (for a GPU: pinned where they fit the host's budget, else in the entry's memory map) and
each batch is gathered on the host and copied ahead of its step (`make_loader`'s ``pin_memory`` and accelerate's
``non_blocking``); `states_home` decides which.
"""

from __future__ import annotations

from collections.abc import Iterable

import datasets
import numpy as np
import psutil
import pyarrow as pa
import torch
from torch.utils.data import DataLoader, Dataset, RandomSampler, SequentialSampler
from transformers.trainer_pt_utils import LengthGroupedSampler

TOKEN_FEATURES = ("input_ids", "attention_mask", "token_type_ids", "word_ids")
IGNORE_INDEX = -100  # label of sub-word pieces and padding in token classification (PyTorch's cross-entropy default)
READ_SLICE_ROWS = 16_384  # rows of a memory-mapped entry read at a time (48 MiB of bert-base's float32 states)


class Examples(Dataset):
    """Tokenized examples as flat tensors (plus, optionally, their cached boundary states); ``examples.batch(indices)``
    is the padded batch of those examples, and what a `DataLoader` over them yields (`__getitems__`)."""

    def __init__(self, tokenized: datasets.Dataset, pad_token_id: int,
                 boundary_states: BoundaryStates | None = None) -> None:
        arrow = tokenized.with_format("arrow")  # whole columns, selections applied: no row-by-row Python
        self.lengths = [int(n) for n in _values(arrow["input_ids"]).value_lengths().to_numpy()]
        self.sizes = torch.as_tensor(self.lengths, dtype=torch.long)  # the same, as a tensor (on the host: see batch)
        self.sizes_on_device = self.sizes
        self.starts = torch.as_tensor(np.concatenate([[0], np.cumsum(self.lengths[:-1])]), dtype=torch.long)
        self.tokens = {c: _flat(arrow[c]) for c in TOKEN_FEATURES if c in tokenized.column_names}
        self.padding = {c: {"input_ids": pad_token_id, "word_ids": -1}.get(c, 0) for c in self.tokens}
        labels = _values(arrow["labels"]) if "labels" in tokenized.column_names else None
        # Token classification has a label per word piece (padded with IGNORE_INDEX); other tasks one per example.
        if labels is not None and pa.types.is_list(labels.type):
            self.tokens["labels"], self.padding["labels"] = _flat(labels), IGNORE_INDEX
            self.labels = None
        else:
            self.labels = None if labels is None else torch.from_numpy(np.array(labels.to_numpy(zero_copy_only=False)))
        self.boundary_states = boundary_states
        self.device = torch.device("cpu")

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, index: int) -> dict:
        """One example, unpadded (for inspection; training goes through `batch`)."""
        return {name: value[0, : self.lengths[index]] if value.dim() > 1 else value[0]
                for name, value in self.batch([index]).items()}

    def batch(self, indices) -> dict[str, torch.Tensor]:
        """The examples at ``indices`` padded to the longest of them, on this object's device."""
        indices = torch.as_tensor(indices, dtype=torch.long)
        width = int(self.sizes[indices].max())  # from the host copy of the lengths: no device sync per batch
        indices = indices.to(self.device, non_blocking=True)
        positions = torch.arange(width, device=self.device)
        real = positions < self.sizes_on_device[indices, None]
        rows = torch.where(real, self.starts[indices, None] + positions, 0)  # padding reads row 0, then masked
        batch = {name: torch.where(real, flat[rows], self.padding[name]) for name, flat in self.tokens.items()}
        if self.labels is not None:
            batch["labels"] = self.labels[indices]
        if self.boundary_states is not None:
            batch["boundary_states"] = self.boundary_states.rows(indices, positions, real)
        return batch

    __getitems__ = batch  # a DataLoader hands a batch's indices to __getitems__ at once, when a dataset has it

    def to(self, device: torch.device | str, states: bool = True) -> Examples:
        """These examples on ``device`` (their tokens and labels; their cached states too unless ``states`` is
        False: those then stay where they are and each batch of them is copied over by the loader)."""
        self.device = torch.device(device)
        self.starts = self.starts.to(self.device)
        self.sizes_on_device = self.sizes.to(self.device)
        self.tokens = {name: flat.to(self.device) for name, flat in self.tokens.items()}
        if self.labels is not None:
            self.labels = self.labels.to(self.device)
        if self.boundary_states is not None and states:
            self.boundary_states = self.boundary_states.to(self.device)
        return self

    @property
    def host_batches_for(self) -> torch.device | None:
        """The GPU that batches gathered on the host go to (their states did not fit there), else None."""
        states = self.boundary_states
        if states is not None and states.device.type == "cpu" and states.target.type != "cpu":
            return states.target
        return None


class BoundaryStates:
    """Every example's hidden states entering one layer: one flat (tokens, hidden) array of all examples' rows, where
    each example's rows start, and the dtype the model computes them in (stored smaller, they are cast back).

    ``flat`` is a memory map of the entry's file, or a tensor (in RAM or on a GPU) that ends in one row of zeros,
    which the padding of a batch reads; ``target`` is the device that trains from them (a GPU whose memory they did
    not fit keeps them in pinned host memory or in the memory map: `states_home`)."""

    def __init__(self, flat: torch.Tensor | np.memmap, starts: torch.Tensor, lengths: np.ndarray,
                 dtype: torch.dtype, target: torch.device | None = None) -> None:
        self.flat, self.starts, self.lengths, self.dtype = flat, starts, lengths, dtype
        self.target = target or self.device

    @property
    def device(self) -> torch.device:
        return self.flat.device if isinstance(self.flat, torch.Tensor) else torch.device("cpu")

    @property
    def nbytes(self) -> int:
        """Bytes the states take read into memory (a memory-mapped entry gains the zero row there)."""
        if isinstance(self.flat, torch.Tensor):
            return int(self.flat.nbytes)
        return int((self.flat.shape[0] + 1) * self.flat.shape[1] * self.flat.itemsize)

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, index: int) -> torch.Tensor:
        """One example's states (tokens, hidden), in the model's dtype."""
        length = int(self.lengths[index])
        positions = torch.arange(length, device=self.device)
        return self.rows(torch.tensor([index], device=self.device), positions, positions[None] < length)[0]

    def rows(self, indices: torch.Tensor, positions: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
        """The states of the examples at ``indices`` as a (batch, positions, hidden) grid, zero where not ``real``."""
        if isinstance(self.flat, np.ndarray):  # memory-mapped: copy just these rows off the disk
            index = torch.where(real, self.starts[indices, None] + positions, 0)
            values = _as_tensor(np.asarray(self.flat[index.numpy()]))
            return torch.where(real[..., None], values.to(self.dtype), 0)
        # One gather, the padding reading the zero row at the end: no second pass over the batch to mask it.
        index = torch.where(real, self.starts[indices, None] + positions, len(self.flat) - 1)
        return torch.index_select(self.flat, 0, index.view(-1)).view(*index.shape, -1).to(self.dtype)

    def to(self, device: torch.device | str) -> BoundaryStates:
        """The states held in ``device``'s memory (a memory-mapped entry read straight into it, a slice at a time)."""
        device = torch.device(device)
        flat = self.flat.to(device) if isinstance(self.flat, torch.Tensor) else _with_zero_row(self.flat, device)
        return BoundaryStates(flat, self.starts.to(device), self.lengths, self.dtype, device)

    def pinned(self, target: torch.device) -> BoundaryStates:
        """The states in pinned host memory, for batches copied to ``target`` without blocking."""
        flat = (self.flat.cpu().pin_memory() if isinstance(self.flat, torch.Tensor)
                else _with_zero_row(self.flat, torch.device("cpu"), pin=True))
        return BoundaryStates(flat, self.starts.cpu(), self.lengths, self.dtype, target)

    def mapped_for(self, target: torch.device) -> BoundaryStates:
        """The states left in the memory-mapped entry, each batch gathered from the disk and copied to ``target``:
        for states that fit neither the GPU's memory nor the host's."""
        return BoundaryStates(self.flat, self.starts.cpu(), self.lengths, self.dtype, target)


def _with_zero_row(mapped: np.memmap, device: torch.device, pin: bool = False) -> torch.Tensor:
    """A memory-mapped entry read into ``device``'s memory (``pin``: page-locked host memory, for copies to a GPU),
    one row of zeros after its rows (what padding reads). Read a slice at a time, straight into the buffer: no copy
    of the whole entry in host memory on the way (for a GPU) or beside it (pinning)."""
    rows, hidden = mapped.shape
    dtype = _as_tensor(np.empty(0, mapped.dtype)).dtype  # as stored (bfloat16 is stored as uint16)
    flat = torch.empty((rows + 1, hidden), dtype=dtype, device=device, pin_memory=pin)
    for start in range(0, rows, READ_SLICE_ROWS):
        end = min(start + READ_SLICE_ROWS, rows)
        flat[start:end] = _as_tensor(np.array(mapped[start:end]))  # a writable copy of the slice (torch wants one)
    flat[-1] = 0
    return flat


def states_home(split_bytes: Iterable[int], device: torch.device, budget: int) -> str:
    """Where a run's cached states live, given each split's bytes: "device" when they all fit ``budget`` there;
    else, on the CPU, "mapped" (gathered per batch from the entry's memory map); for a GPU, "pinned" host memory
    when they fit `host_budget` as torch counts pinned memory (its allocator rounds each buffer up to a power of
    two), else "mapped", each batch gathered from the memory map and copied."""
    split_bytes = list(split_bytes)
    if sum(split_bytes) <= budget:
        return "device"
    if device.type != "cpu" and sum(1 << max(n - 1, 0).bit_length() for n in split_bytes) <= host_budget():
        return "pinned"
    return "mapped"


def host_budget() -> int:
    """Bytes of host memory that cached states may take: half of what is available now."""
    return psutil.virtual_memory().available // 2


def _as_tensor(array: np.ndarray) -> torch.Tensor:
    """A stored array as a tensor; bfloat16, which numpy lacks, is stored as its 16 bits (uint16)."""
    if array.dtype == np.uint16:
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array)


def _values(column: pa.ChunkedArray | pa.Array) -> pa.Array:
    return column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column


def _flat(column: pa.ChunkedArray | pa.Array) -> torch.Tensor:
    """A list column's values end to end (int64 token ids, masks, labels), as one tensor."""
    return torch.from_numpy(np.array(_values(column).flatten().to_numpy(zero_copy_only=False), dtype=np.int64))


def batch_to(batch: dict, device: torch.device) -> dict:
    """A loader's batch on ``device``; a batch gathered in pinned memory is copied without waiting."""
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def as_is(batch):
    """The collate function of loaders over `Examples`: `Examples.batch` has padded the batch already."""
    return batch


def make_loader(
    examples: Dataset, batch_size: int, *, shuffle: bool = False, seed: int = 0, group_by_length: bool = False,
    longest_first: bool = False, shard: tuple[int, int] = (0, 1),
) -> DataLoader:
    """A seeded loader: same seed → same batches. ``group_by_length`` buckets similar lengths to cut padding.

    ``longest_first`` (without shuffling) is for scoring, where the order does not matter: every batch then pads
    to nearly its own length. ``shard=(i, n)`` (scoring only) keeps the examples whose index is i modulo n: process
    i's share of n scoring processes, every example scored exactly once.
    ``examples`` builds its own batches (`Examples.batch`) and has ``lengths`` (tokens per example).
    """
    index, count = shard
    if count > 1 and shuffle:
        raise ValueError("shard is for scoring loaders; a training loader is sharded by accelerate's prepare")
    generator = torch.Generator().manual_seed(seed)
    if shuffle and group_by_length:
        sampler = LengthGroupedSampler(batch_size, lengths=examples.lengths, generator=generator)
    elif shuffle:
        sampler = RandomSampler(examples, generator=generator)
    elif longest_first:
        sampler = sorted(range(index, len(examples), count), key=lambda i: -examples.lengths[i])
    elif count > 1:
        sampler = range(index, len(examples), count)
    else:
        sampler = SequentialSampler(examples)
    # States kept on the host for a GPU: batches are gathered into pinned memory, so that accelerate's non_blocking
    # copy overlaps the step before.
    pin = getattr(examples, "host_batches_for", None)
    return DataLoader(examples, batch_size=batch_size, sampler=sampler, collate_fn=as_is, pin_memory=pin is not None)
