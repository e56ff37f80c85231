"""The C allocator as CPU training wants it: the buffers a step frees are reused by the next, not mapped afresh."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest
import torch

from tests.conftest import toy_sentiment_corpus
from layertune import LanguageModel, ModelTrainer, TextClassifier, host_memory

# Full fine-tuning steps of a real encoder (its word-embedding gradient alone is 47 MB, allocated at each step and
# freed by zero_grad); the page faults of the last six steps, per step.
STEPS = """
import resource, sys, torch
from transformers import AutoModel
from layertune.host_memory import keep_freed_blocks

model = AutoModel.from_pretrained(sys.argv[1]).train()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
ids = torch.randint(1000, 20000, (16, 16))
if sys.argv[2] == "kept":
    keep_freed_blocks()  # where the trainer calls it: the model loaded, before the first step

def page_faults_per_step(steps=12, warm_up=6):  # the heap settles in its first steps (fragments reused)
    for step in range(steps):
        if step == warm_up:
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        model(input_ids=ids).last_hidden_state.sum().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / (steps - warm_up)

print(page_faults_per_step())
"""


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's malloc only")
def test_a_training_step_reuses_the_blocks_the_last_one_freed(minilm_l3):
    def faults(allocator: str, **environment) -> float:  # each in a fresh process: the setting is process-wide
        run = subprocess.run([sys.executable, "-c", STEPS, str(minilm_l3), allocator], capture_output=True, text=True,
                             env={**os.environ, **environment})
        assert run.returncode == 0, run.stderr[-2000:]
        return float(run.stdout.split()[-1])

    default, kept = faults("default"), faults("kept")
    assert default > 5000, default  # glibc's defaults: each step's buffers mapped afresh (about 40,000)
    assert kept < 1000, kept  # served from the heap the last steps left (0 here)
    assert faults("kept", LAYERTUNE_KEEP_FREED_BLOCKS="0") > 5000  # turned off: malloc left as glibc has it


@pytest.mark.skipif(torch.cuda.is_available(), reason="training on the CPU")
def test_the_trainer_keeps_freed_blocks_when_it_trains_on_a_cpu(tiny_bert, tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(host_memory, "keep_freed_blocks", lambda: calls.append(1) or True)
    model = TextClassifier(LanguageModel(tiny_bert, tunable_layers=1), 2)
    ModelTrainer(model, toy_sentiment_corpus(16, 8), cache_dir=tmp_path).train(
        progress=False, epochs=1, batch_size=8, mixed_precision="no", frozen_prefix_cache=False)
    assert calls == [1]


@pytest.mark.parametrize("setting", ["false", "off", ""])
def test_a_keep_freed_blocks_setting_other_than_0_or_1_is_refused_naming_both(monkeypatch, setting):
    monkeypatch.setenv("LAYERTUNE_KEEP_FREED_BLOCKS", setting)
    with pytest.raises(ValueError, match=f"LAYERTUNE_KEEP_FREED_BLOCKS={setting!r}: expected 0 .* or 1 "):
        host_memory.keep_freed_blocks.__wrapped__()  # uncached: the process's own answer is kept
