"""`layertune repro --jobs N` hands each worker its own GPU. No GPU here: a stand-in `dvc` on PATH records which
GPU each cell's process saw and when it ran (the end-to-end build with real DVC is in test_scale.py)."""

import os
import stat

import pytest

from layertune import parallel

FAKE_DVC = """#!/bin/sh
# dvc --wait-for-lock repro --single-item <cell>: record the cell, the GPU it saw and its start and end
cell="$4"
start=$(date +%s.%N)
sleep 0.4
[ "$cell" = broken ] && { echo "ERROR: failed to reproduce '$cell'"; exit 1; }
echo "$cell ${CUDA_VISIBLE_DEVICES:-none} $start $(date +%s.%N)" >> "$RECORD"
"""


@pytest.fixture
def fake_dvc(tmp_path, monkeypatch):
    script = tmp_path / "bin" / "dvc"
    script.parent.mkdir()
    script.write_text(FAKE_DVC)
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{script.parent}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("RECORD", str(tmp_path / "record.txt"))
    return tmp_path / "record.txt"


def test_each_worker_sees_its_own_gpu(fake_dvc, capsys):
    parallel.run_cells([f"train-s@cell-{i}" for i in range(6)], jobs=2, gpus=["0", "1"])
    progress = capsys.readouterr().out.splitlines()  # each cell reported as it ends, counted
    assert [line.split("]")[0] for line in progress] == [f"layertune repro: [{i}/6" for i in range(1, 7)]
    runs = [line.split() for line in fake_dvc.read_text().splitlines()]
    assert sorted(cell for cell, *_ in runs) == [f"train-s@cell-{i}" for i in range(6)]
    assert {gpu for _, gpu, _, _ in runs} == {"0", "1"}
    for a in runs:  # two cells that ran at the same time never shared a GPU
        for b in runs:
            overlap = float(a[2]) < float(b[3]) and float(b[2]) < float(a[3])
            assert a is b or not overlap or a[1] != b[1], (a, b)


def test_without_gpus_workers_get_the_environment_as_it_is(fake_dvc, monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    parallel.run_cells(["train-s@a", "train-s@b"], jobs=2, gpus=[None])
    assert {line.split()[1] for line in fake_dvc.read_text().splitlines()} == {"none"}


def test_visible_devices_are_the_gpus_workers_share(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert parallel.devices() == ["2", "3"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert parallel.devices() == [None]


def test_a_failed_cell_is_reported_with_its_output_and_stops_new_cells(fake_dvc):
    with pytest.raises(parallel.StageFailed, match="broken failed:\n.*failed to reproduce 'broken'"):
        parallel.run_cells(["broken", *(f"train-s@cell-{i}" for i in range(8))], jobs=1, gpus=[None])
    assert not fake_dvc.exists()  # one worker: nothing after the failed cell started
