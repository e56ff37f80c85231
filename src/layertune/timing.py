"""Where a process's time goes: compute (training, scoring, saving cells, caching frozen states, tokenizing) against
the rest.

Library code marks its compute with ``with compute("training"): ...``. When ``$LAYERTUNE_TIMINGS`` names a file
at exit, the process appends one JSON line there: its command line and seconds per kind of compute. The pipeline
benchmark (``benchmarks/pipeline_speed.py``) sets it, and subtracts a stage's compute from its wall time to get the
stage's fixed cost.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import sys
import time
from collections import defaultdict
from collections.abc import Iterator

TIMINGS_ENV = "LAYERTUNE_TIMINGS"
_seconds: dict[str, float] = defaultdict(float)


@contextlib.contextmanager
def compute(kind: str) -> Iterator[None]:
    """Count the block's wall time as compute of ``kind``."""
    started = time.perf_counter()
    try:
        yield
    finally:
        _seconds[kind] += time.perf_counter() - started


def add(kind: str, seconds: float) -> None:
    """Count ``seconds`` measured elsewhere (a training epoch) as compute of ``kind``."""
    _seconds[kind] += seconds


def totals() -> dict[str, float]:
    return dict(_seconds)


def _write_at_exit() -> None:
    path = os.environ.get(TIMINGS_ENV)
    if path and _seconds:  # a process that computed nothing (a warm worker's server) writes nothing
        with open(path, "a") as out:
            out.write(json.dumps({"argv": sys.argv, "pid": os.getpid(), "compute_s": totals()}) + "\n")


atexit.register(_write_at_exit)
