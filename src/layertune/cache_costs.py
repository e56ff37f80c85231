"""Does the frozen-prefix cache pay for this run, on this device? Estimated before any state is computed.

Without the cache a run computes the frozen prefix at every training step and every time it scores a split; with
it, it reads the same states instead, after one pass that builds the entry (nothing to pay when the entry exists):

    uncached = forward/token x (padded training tokens x epochs + scored tokens)
    cached   = pass + read/token x (the same tokens)       pass = forward/token x every missing split's tokens

The cache is used when ``cached <= MARGIN x uncached``: a near tie, where the estimate could be wrong either way,
runs uncached. The costs per token:

- on a GPU, timed on a few of the run's own training batches under its autocast: the prefix's forward (or, for an
  existing entry built on a GPU, what its pass measured) against gathering states of that shape from where they
  would live (`layertune.batching.states_home`: the GPU's memory when they all fit its budget, else pinned host
  memory plus the copy, else the memory map plus reading them back from disk at 1 GB/s, assumed), the pass also
  paying for writing its states (1 GB/s assumed). There recomputing a few layers is cheap and reading from
  host memory is not, which is what this weighs; a run near the margin may decide otherwise in another process
  (timings vary): pass True or False to pin it.
- on the CPU, in units of one token through the prefix, reading costing READ_ON_CPU of it: the per-step ratio
  measured by benchmarks/frozen_prefix_speed.py (a cached K = 0 step costs 1.1 % of the common recipe's). No
  timing, so the same run decides the same in every process, as the reproducibility of a seeded run needs.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import numpy as np
import torch

from layertune.batching import BoundaryStates, Examples, states_home
from layertune.training_config import TrainingConfig, autocast_context, placed_on, synchronize

MARGIN = 0.9
READ_ON_CPU = 0.011  # reading a token's cached states from RAM, as a share of computing it (see the docstring)
PROBE_BATCHES = 3  # batches timed, each once seen (`seconds_per_padded_token`)
WRITE_BYTES_PER_S = 1e9  # the pass writes its states to disk: assumed 1 GB/s (the page cache of a local disk)
READ_BYTES_PER_S = 1e9  # states beyond the host's budget are read back from disk per batch: assumed 1 GB/s


@dataclass(frozen=True)
class CacheCosts:
    """Seconds this run would spend on the frozen prefix, without and with the cache."""

    forward_s_per_epoch: float  # the frozen prefix over one epoch's training batches
    read_s_per_epoch: float     # reading those batches' states from the cache instead
    uncached_s: float           # every epoch, and every scoring of dev and test, recomputing the prefix
    cached_s: float             # the pass plus reading the same from the cache
    pass_s: float               # building the missing entries (0: they exist)
    epochs: int
    states_at: str              # where the states would be read from
    unit: str = "s"             # seconds (timed), or "token passes" (the CPU's fixed model)

    def decision(self) -> tuple[bool, str]:
        used = self.cached_s <= MARGIN * self.uncached_s
        unit = f" {self.unit}"
        return used, (
            f"{'cached' if used else 'not cached'}, by estimate: the frozen layers cost {self.uncached_s:.3g}{unit} "
            f"recomputed ({self.forward_s_per_epoch:.3g}{unit} an epoch, {self.epochs} epoch(s), scoring included) "
            f"and {self.cached_s:.3g}{unit} from the cache (pass {self.pass_s:.3g}{unit}, reading "
            f"{self.read_s_per_epoch:.3g}{unit} an epoch from {self.states_at}); cached only when at most {MARGIN:g}x")

    def record(self) -> dict:
        return {key: round(value, 6) if isinstance(value, float) else value for key, value in asdict(self).items()}


def estimate(lm, splits: dict[str, Examples], boundary: int, args: TrainingConfig, *, device: torch.device,
             autocast: torch.dtype | None, built: list[dict | None], state_dtype: torch.dtype,
             budget: int) -> CacheCosts:
    """The costs of training ``lm`` from the states entering ``boundary`` or without them, on ``device``.

    ``built``: per split (in ``splits``' order), what the pass of its existing entry measured, or None (missing);
    ``state_dtype``: how the states are stored; ``budget``: bytes the states may take on ``device``."""
    train = splits["train"]
    batches = _probe_batches(train, args.batch_size)
    padding = sum(len(b) * max(train.lengths[i] for i in b) for b in batches) / sum(train.lengths[i] for b in batches
                                                                                   for i in b)
    tokens = {split: sum(examples.lengths) for split, examples in splits.items()}
    state_bytes = lm.hidden_size * torch.finfo(state_dtype).bits // 8  # one token's states
    home = states_home([(n + 1) * state_bytes for n in tokens.values()], device, budget)  # each with its zero row
    missing = sum(tokens[split] for split, record in zip(splits, built) if record is None)
    forward, read, unit = per_token_costs(lm, train, batches, boundary, device=device, autocast=autocast,
                                          built=built, state_dtype=state_dtype, home=home)
    pass_s = forward * missing + (missing * state_bytes / WRITE_BYTES_PER_S if unit == "s" else 0.0)
    # The selection split (the validation slice, else dev) is scored every epoch, at most; dev and test once.
    selection = "validation" if "validation" in splits else "dev"
    scorings = {"dev": 1, "test": 1, selection: args.epochs if args.eval_strategy == "epoch" else 1}
    # Training batches are drawn at random (or grouped by length): padded as the probe's; scoring sorts by length.
    per_run = tokens["train"] * padding * args.epochs + sum(tokens.get(s, 0) * n for s, n in scorings.items())
    return CacheCosts(
        forward_s_per_epoch=forward * tokens["train"] * padding, read_s_per_epoch=read * tokens["train"] * padding,
        uncached_s=forward * per_run, cached_s=pass_s + read * per_run, pass_s=pass_s, epochs=args.epochs,
        states_at=f"{device.type} memory" if device.type == "cpu" else {
            "device": f"{device.type} memory", "pinned": "pinned host memory",
            "mapped": "the memory-mapped entry on disk"}[home], unit=unit)


def per_token_costs(lm, train: Examples, batches: list, boundary: int, *, device: torch.device,
                    autocast: torch.dtype | None, built: list[dict | None], state_dtype: torch.dtype,
                    home: str) -> tuple[float, float, str]:
    """The frozen prefix's forward and reading its cached states from ``home`` (`states_home`), per padded token,
    and their unit."""
    if device.type == "cpu":
        return 1.0, READ_ON_CPU, "token passes"
    known = [record for record in built if record is not None and record["device"] == device.type]
    if len(known) == len(built):  # every entry exists: its pass measured the prefix on this kind of device
        forward = max(record["forward_s_per_token"] for record in known)
    else:
        forward = time_forward(lm, train, batches, boundary, device, autocast)
    read = _time_read(train, batches, lm.hidden_size, state_dtype, device, home)
    if home == "mapped":
        read += lm.hidden_size * torch.finfo(state_dtype).bits // 8 / READ_BYTES_PER_S
    return forward, read, "s"


def _probe_batches(examples: Examples, batch_size: int) -> list[list[int]]:
    """A few training-sized batches drawn at random, from a generator of their own (the run's are not touched)."""
    order = np.random.default_rng(0).permutation(len(examples))
    size = min(batch_size, len(examples))
    return [order[i * size : (i + 1) * size].tolist() for i in range(min(PROBE_BATCHES, len(examples) // size))] \
        or [order.tolist()]


def seconds_per_padded_token(batches: list, run, device: torch.device) -> float:
    """Seconds per padded token of ``run(batch)`` over ``batches``, each batch run once untimed before: a GPU's first
    batch of a shape pays for choosing its kernels and allocating its memory (on an H200, a bert-base batch took 7x
    as long the first time its shape came: 2026-12-04, benchmarks/README.md), which a run's later epochs do not."""
    for batch in batches:
        run(batch)
    synchronize(device)
    started = time.perf_counter()
    padded = sum(run(batch) for batch in batches)
    synchronize(device)
    return (time.perf_counter() - started) / max(padded, 1)


def time_forward(lm, examples: Examples, batches: list, boundary: int, device: torch.device,
                  autocast: torch.dtype | None) -> float:
    """Seconds per padded token of the frozen prefix's forward (eval mode, no gradient, the run's autocast)."""
    examples = examples.to(device)

    def forward(indices: list[int]) -> int:
        batch = examples.batch(indices)
        with autocast_context(device, autocast):
            lm.boundary_states(batch, [boundary])
        return batch["input_ids"].numel()

    with placed_on(lm, device):
        return seconds_per_padded_token(batches, forward, device)


def _time_read(examples: Examples, batches: list, hidden_size: int, dtype: torch.dtype, device: torch.device,
               home: str) -> float:
    """Seconds per padded token of gathering cached states for ``batches``: from the device's memory, or from
    host memory (pinned, or as a memory map's rows once read) and copied to the device."""
    lengths = np.asarray(examples.lengths)
    where = device if home == "device" or device.type == "cpu" else torch.device("cpu")
    starts = torch.zeros(len(examples), dtype=torch.long)  # every example reads rows 0…: only the shape matters
    states = BoundaryStates(torch.zeros(lengths.max() + 1, hidden_size, dtype=dtype), starts, lengths, dtype)
    states = states.to(where) if where == device or home == "mapped" else states.pinned(device)

    def read(indices: list[int]) -> int:
        index = torch.as_tensor(indices, device=where)
        width = int(lengths[indices].max())
        positions = torch.arange(width, device=where)
        rows = states.rows(index, positions, positions < torch.as_tensor(lengths[indices], device=where)[:, None])
        rows.to(device, non_blocking=True)
        return rows.shape[0] * rows.shape[1]

    return seconds_per_padded_token(batches, read, device)

