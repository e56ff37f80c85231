"""How the C allocator serves a training process on a CPU: the blocks a step frees kept for the next step.

A CPU training step allocates and frees the same large buffers every step: a gradient the size of the word embeddings
(30,522 x 384 floats, 47 MB, for MiniLM), the bfloat16 copies autocast makes of each weight, the weights' gradients.
glibc's malloc, by default, maps blocks that large fresh from the kernel and gives them back when freed, so every
step page-faults its buffers in again: a full fine-tuning step of all-MiniLM-L6-v2 (16 x 16 tokens, bf16, 2 threads)
took 21,000 page faults and 101 ms with glibc's defaults, none and 81 ms with the blocks kept; a whole SST-2 cell's
steps, 1.03-1.08x faster in float32 and 1.05-1.17x in bfloat16 (two pairs of runs: benchmarks/README.md, "float32
against bfloat16"). PyTorch's CPU performance guide reaches the same end with jemalloc or tcmalloc preloaded; glibc's
own settings need nothing installed.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os

logger = logging.getLogger(__name__)

KEEP_FREED_BLOCKS_ENV = "LAYERTUNE_KEEP_FREED_BLOCKS"
# mallopt's parameter numbers (glibc's malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
# Free memory at the heap's top beyond this goes back to the kernel; below it stays for the next step. 1 GiB: a
# training process's working set here is a few hundred MB.
TRIM_THRESHOLD_BYTES = 1 << 30


@functools.cache
def keep_freed_blocks() -> bool:
    """Have glibc's malloc serve every block from its heap (no per-block mappings) and keep up to 1 GiB of freed
    memory for reuse. Once per process; process-wide and kept (a process's resident memory stays near its peak,
    which a training process reaches every step anyway). ``LAYERTUNE_KEEP_FREED_BLOCKS=0`` leaves malloc as it is
    (a notebook that wants its memory back after training). True where it took; False where it was turned off or
    the C library is not glibc (macOS, musl), which are left as they are. Another value: `ValueError`, before the
    run does any work."""
    setting = os.environ.get(KEEP_FREED_BLOCKS_ENV, "1")
    if setting not in ("0", "1"):
        raise ValueError(f"${KEEP_FREED_BLOCKS_ENV}={setting!r}: expected 0 (leave malloc as it is) or 1 (keep the "
                         "blocks a training step frees, the default).")
    if setting == "0":
        return False
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c")).mallopt
    except (OSError, AttributeError, TypeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    took = [mallopt(M_MMAP_MAX, 0), mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)]  # 1 each where it took
    logger.debug("glibc malloc keeps freed blocks: %s", took)
    return all(took)
