"""Several processes training one cell (``accelerate launch --num_processes N``): who writes (scored shards come
back together through accelerate's ``gather_for_metrics``, in the trainer).

Every process trains (each on its slice of every batch) and scores its share of the dev examples; only the main
process writes files or logs to MLflow, so a data-parallel run leaves exactly the outputs of a one-process run.
"""

from __future__ import annotations

import os


def launched() -> bool:
    """Whether this process is one of several started together (torchrun, ``accelerate launch``, MPI)."""
    return any(int(os.environ.get(name, "1")) > 1 for name in ("WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE"))


def state():
    """accelerate's process state (created on first use). On a machine without GPUs, accelerate joins a launched
    group only when told that it runs on CPU (as gloo processes); whoever creates the state first decides, so every
    layertune call goes through here."""
    import torch
    from accelerate import PartialState
    from accelerate.utils import is_npu_available, is_xpu_available

    on_cpu = launched() and not (torch.cuda.is_available() or is_xpu_available() or is_npu_available())
    return PartialState(cpu=on_cpu)


def is_main_process() -> bool:
    """True in a single process, and in the main one of a data-parallel group (the one that writes outputs).

    Asks accelerate only when several processes were launched, so that a single process does not import torch for it.
    """
    return not launched() or state().is_main_process
