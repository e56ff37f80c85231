"""The machine's reference figure: how fast this CPU multiplies float32 matrices, on one thread and on all.

Machines of one kind differ by about 2x, and a timing means little without the speed of the machine it came from.
Every benchmark JSON carries this figure under ``"machine"``, and the build times that README and docs quote name
it, so that a figure measured elsewhere can be scaled: a machine with half the GFLOPS trains a cell in about twice
the time (training here is matmul-bound).

    python benchmarks/machine_speed.py          # prints one JSON line, about 3 s

A 512 x 512 matmul is the size of a MiniLM layer's work on a batch: big enough to be compute-bound, small enough
to stay in cache. The figure is the median of repeated timings, so one preempted run does not move it.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time


def _gflops(size: int, threads: int, seconds: float) -> float:
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a, b = torch.randn(size, size), torch.randn(size, size)
        for _ in range(3):  # thread pools and allocator warm-up
            a @ b
        timings = []
        deadline = time.perf_counter() + seconds
        while time.perf_counter() < deadline or len(timings) < 5:
            started = time.perf_counter()
            for _ in range(4):
                a @ b
            timings.append((time.perf_counter() - started) / 4)
        return round(2 * size**3 / statistics.median(timings) / 1e9, 1)
    finally:
        torch.set_num_threads(previous)


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def reference(seconds: float = 1.0) -> dict:
    """``{"cpus", "cpu", "matmul_gflops_1thread", "matmul_gflops"}``: the figure every benchmark JSON carries."""
    cpus = os.cpu_count() or 1
    return {"cpus": cpus, "cpu": _cpu_model(), "matmul_gflops_1thread": _gflops(512, 1, seconds),
            "matmul_gflops": _gflops(512, cpus, seconds)}


def describe(machine: dict) -> str:
    """One line for a table or a log: ``2 CPUs, 61 GFLOPS (33 on one thread)``."""
    return (f"{machine['cpus']} CPUs, {machine['matmul_gflops']:.0f} GFLOPS "
            f"({machine['matmul_gflops_1thread']:.0f} on one thread)")


if __name__ == "__main__":
    print(json.dumps(reference(), sort_keys=True))
