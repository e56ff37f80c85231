"""`layertune repro --jobs N` hands each worker its own GPU, and a signal stops every cell. No GPU here: a stand-in
`dvc` on PATH records which GPU each cell's process saw and when it ran, or which processes it started (the
end-to-end build with real DVC is in test_scale.py)."""

import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipelines import parallel

ROOT = Path(__file__).resolve().parents[1]

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


SLOW_DVC = """#!/bin/sh
# `layertune repro --jobs 2`'s calls: tokenize and the final repro succeed at once, status lists two cells, a cell trains
# (sleeps) for a minute in a child process, as a stage command under dvc would
case "$1" in
  status) echo '{"train-s@a": [], "train-s@b": []}'; exit 0 ;;
  repro) exit 0 ;;
esac
sleep 60 &
echo "$$ $!" >> "$RECORD"
wait
echo "finished $4" >> "$RECORD"
"""


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not yet reaped, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_sigterm_stops_every_cell_and_its_command_then_fails(tmp_path):
    """SIGTERM to `layertune repro --jobs 2` reaches each cell's dvc and the command it runs: none goes on training,
    orphaned; the build exits 128 + SIGTERM."""
    (tmp_path / "bin").mkdir()
    script = tmp_path / "bin" / "dvc"
    script.write_text(SLOW_DVC)
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    (tmp_path / "dvc.yaml").write_text("stages: {}\n")
    (tmp_path / "params.yaml").write_text("studies: {s: {}}\n")
    record = tmp_path / "record.txt"
    env = {**os.environ, "PATH": f"{script.parent}{os.pathsep}{os.environ['PATH']}", "RECORD": str(record),
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)]), "CUDA_VISIBLE_DEVICES": ""}
    build = subprocess.Popen([sys.executable, "-m", "pipelines.repro", "--jobs", "2"], cwd=tmp_path, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while len(record.read_text().splitlines() if record.exists() else []) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    pids = [int(pid) for line in record.read_text().splitlines() for pid in line.split()]
    assert len(pids) == 4 and all(map(alive, pids))  # two cells' dvc, each with its command
    build.send_signal(signal.SIGTERM)
    started = time.monotonic()
    _, err = build.communicate(timeout=30)
    assert build.returncode == 128 + signal.SIGTERM, err
    assert "stopped by SIGTERM" in err
    assert time.monotonic() - started < 5
    assert not [pid for pid in pids if alive(pid)]
    time.sleep(0.5)
    assert "finished" not in record.read_text()  # no cell went on to its end
