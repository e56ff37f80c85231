"""`layertune repro --jobs N`'s worker processes (`pipelines.scheduling.WorkerProcesses`): each worker sees its own
GPU, cells are taken in the plan's order, a failed or lost cell stops the build, and stopping stops every cell
within seconds. No GPU here: stand-in jobs record which GPU their process saw, when they ran and where (the
end-to-end build with real DVC is in test_scale.py)."""

import contextlib
import json
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from pipelines.scheduling import CellFailed, Finished, InProcess, Started, WorkerProcesses, devices
from pipelines.trained_cells import CellDiskFull


@dataclass(frozen=True)
class StandIn:
    """A cell to train that sleeps ``seconds`` and writes what it saw to ``record``; ``fail``: it raises instead."""

    key: str
    record: Path
    seconds: float = 0.4
    fail: bool = False
    disk_full: bool = False

    def run(self) -> None:
        start = time.time()
        with self.record.open("a") as out:
            out.write(json.dumps({"key": self.key, "event": "start", "pid": os.getpid()}) + "\n")
        time.sleep(self.seconds)
        if self.fail:
            raise FloatingPointError("the loss is NaN")
        if self.disk_full:
            raise CellDiskFull(28, f"no space left for cell {self.key}'s folder")
        with self.record.open("a") as out:
            out.write(json.dumps({"key": self.key, "event": "end", "gpu": os.environ.get("CUDA_VISIBLE_DEVICES"),
                                  "start": start, "end": time.time(), "pid": os.getpid()}) + "\n")


def records(path: Path, event: str = "end") -> list[dict]:
    lines = path.read_text().splitlines() if path.exists() else []
    return [record for line in lines if (record := json.loads(line))["event"] == event]


def test_each_worker_sees_its_own_gpu_and_takes_the_cells_in_order(tmp_path):
    jobs = [StandIn(f"cell-{i}", tmp_path / "record") for i in range(6)]
    events = list(WorkerProcesses(2, ["0", "1"]).cells(jobs))
    assert sorted(e.key for e in events if isinstance(e, Finished)) == [job.key for job in jobs]
    for job in jobs:  # each cell reported as it starts, then as it ends
        kinds = [type(e) for e in events if e.key == job.key]
        assert kinds == [Started, Finished]
    # the plan's order: the first two cells first, one to each worker (which of the two reports first is a race)
    assert sorted([e.key for e in events if isinstance(e, Started)][:2]) == ["cell-0", "cell-1"]
    runs = records(tmp_path / "record")
    assert {run["gpu"] for run in runs} == {"0", "1"} and len({run["pid"] for run in runs}) == 2
    for a in runs:  # two cells that ran at the same time never shared a GPU
        for b in runs:
            overlap = a["start"] < b["end"] and b["start"] < a["end"]
            assert a is b or not overlap or a["gpu"] != b["gpu"], (a, b)


def test_without_gpus_workers_get_the_environment_as_it_is(tmp_path, monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    list(WorkerProcesses(2, [None]).cells([StandIn("a", tmp_path / "record"), StandIn("b", tmp_path / "record")]))
    assert {run["gpu"] for run in records(tmp_path / "record")} == {None}


def test_visible_devices_are_the_gpus_workers_share(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert devices() == ["2", "3"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert devices() == [None]


def test_a_failed_cell_stops_the_build_naming_it_and_its_error(tmp_path):
    record = tmp_path / "record"
    jobs = [StandIn("broken", record, fail=True), *(StandIn(f"cell-{i}", record) for i in range(8))]
    with pytest.raises(CellFailed, match=r"^cell broken failed: FloatingPointError: the loss is NaN") as raised:
        list(WorkerProcesses(1).cells(jobs))
    assert raised.value.cell == "broken"
    assert [run["key"] for run in records(record, "start")] == ["broken"]  # one worker: nothing after it started


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not yet reaped, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_stopping_the_build_stops_every_cell_within_seconds(tmp_path):
    """What the stage does on Ctrl-C or SIGTERM: it closes the scheduler, which stops each worker (SIGTERM, then
    SIGKILL after a grace period) before it returns; no cell trains on to its end."""
    record = tmp_path / "record"
    events = WorkerProcesses(2).cells([StandIn(f"cell-{i}", record, seconds=120) for i in range(4)])
    with contextlib.closing(events):
        assert sorted([next(events).key, next(events).key]) == ["cell-0", "cell-1"]  # both started, in either order
        while len(records(record, "start")) < 2:
            time.sleep(0.05)
        stopped = time.monotonic()
    assert time.monotonic() - stopped < 10
    pids = [run["pid"] for run in records(record, "start")]
    assert not [pid for pid in pids if alive(pid)] and not records(record)  # none went on to its end


def test_a_worker_killed_mid_cell_fails_the_build_naming_the_cell(tmp_path):
    record = tmp_path / "record"
    events = WorkerProcesses(1).cells([StandIn("cell-0", record, seconds=120)])
    with contextlib.closing(events):
        assert next(events).key == "cell-0"
        while not records(record, "start"):
            time.sleep(0.05)
        os.kill(records(record, "start")[0]["pid"], signal.SIGKILL)  # the system's OOM killer, say
        with pytest.raises(CellFailed, match=r"cell cell-0 failed: its worker process ended \(killed by SIGKILL\)"):
            next(events)


def test_bad_numbers_of_cells_at_a_time_are_refused(monkeypatch):
    from pipelines.scheduling import JOBS_ENV
    from pipelines.train.nodes import scheduler_from_environment

    for value in ("0", "-2", "two"):
        monkeypatch.setenv(JOBS_ENV, value)
        with pytest.raises(ValueError, match=rf"\$LAYERTUNE_JOBS='{value}': a whole number of at least 1"):
            scheduler_from_environment()
    monkeypatch.setenv(JOBS_ENV, "3")
    assert isinstance(scheduler_from_environment(), WorkerProcesses)
    monkeypatch.setenv(JOBS_ENV, "")  # empty as unset: one at a time, here as in `layertune repro`
    assert isinstance(scheduler_from_environment(), InProcess)
    monkeypatch.delenv(JOBS_ENV)
    assert isinstance(scheduler_from_environment(), InProcess)


@pytest.mark.parametrize("where", [InProcess(), WorkerProcesses(1)], ids=["in-process", "worker"])
def test_a_full_disk_stops_the_build_as_itself_not_as_a_failed_cell(tmp_path, where):
    """The stage turns it into its one line (`pipelines.train.nodes`); a failed cell's traceback would say nothing
    more, and it is not the cell's failure."""
    jobs = [StandIn("full", tmp_path / "record", seconds=0.0, disk_full=True), StandIn("next", tmp_path / "record")]
    with pytest.raises(CellDiskFull, match="^.*no space left for cell full's folder$"):
        list(where.cells(jobs))
    assert not records(tmp_path / "record")  # the next cell never ran
