"""From tokenized examples to padded batches: dynamic padding, optional length-grouped shuffling."""

from __future__ import annotations

from collections.abc import Sequence

import datasets
import torch
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import DataLoader, Dataset, RandomSampler, SequentialSampler
from transformers.trainer_pt_utils import LengthGroupedSampler

TOKEN_FEATURES = ("input_ids", "attention_mask", "token_type_ids", "word_ids")
IGNORE_INDEX = -100  # label of sub-word pieces and padding in token classification (PyTorch's cross-entropy default)


class Examples(Dataset):
    """Tokenized examples held as tensors, plus (optionally) cached boundary states per example.

    Converting the Arrow columns once up front keeps `__getitem__` cheap inside the training loop.
    """

    def __init__(self, tokenized: datasets.Dataset, pad_token_id: int,
                 boundary_states: Sequence[torch.Tensor] | None = None) -> None:
        columns = [c for c in (*TOKEN_FEATURES, "labels") if c in tokenized.column_names]
        self.columns = {c: [torch.as_tensor(v) for v in tokenized[c]] for c in columns}
        self.lengths = [len(ids) for ids in self.columns["input_ids"]]
        self.boundary_states = boundary_states
        self.collate = PadCollator(pad_token_id)

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, index: int) -> dict:
        example = {c: values[index] for c, values in self.columns.items()}
        if self.boundary_states is not None:
            example["boundary_states"] = self.boundary_states[index]
        return example


class PadCollator:
    """Pads every per-token feature to the longest example of the batch."""

    def __init__(self, pad_token_id: int) -> None:
        self.padding = {"input_ids": pad_token_id, "labels": IGNORE_INDEX, "word_ids": -1}

    def __call__(self, examples: list[dict]) -> dict:
        batch = {}
        for key in examples[0]:
            values = [e[key] for e in examples]
            if values[0].dim() == 0:
                batch[key] = torch.stack(values)
            else:
                batch[key] = pad_sequence(values, batch_first=True, padding_value=self.padding.get(key, 0))
        return batch


def make_loader(
    examples: Dataset, batch_size: int, *, shuffle: bool = False, seed: int = 0, group_by_length: bool = False,
    longest_first: bool = False, shard: tuple[int, int] = (0, 1),
) -> DataLoader:
    """A seeded loader: same seed → same batches. ``group_by_length`` buckets similar lengths to cut padding.

    ``longest_first`` (without shuffling) is for scoring, where the order does not matter: every batch then pads
    to nearly its own length. ``shard=(i, n)`` (scoring only) keeps the examples whose index is i modulo n: process
    i's share of n scoring processes, every example scored exactly once.
    ``examples`` brings its own ``collate`` (how to pad its features) and ``lengths`` (tokens per example).
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
    return DataLoader(examples, batch_size=batch_size, sampler=sampler, collate_fn=examples.collate)
