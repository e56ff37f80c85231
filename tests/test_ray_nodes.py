"""What `layertune repro --ray` does around a cell, without Ray: the build's gate (which cells are inside, so that the
driver removes the nodes' folders only once they have left), the cell's folder, and a cleanup that a repeated cancel
cannot cut short."""

import _thread
import os
import tempfile
import threading
import time

import pytest

from pipelines import ray_node


@pytest.fixture
def node_tmp(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path / f"layertune-ray-{os.getuid()}"


def test_the_gate_lists_the_cells_inside_and_once_closed_lets_none_in():
    gate, one, two = ray_node.BuildGate(), PLACES["node-1"], PLACES["node-2"]
    assert gate.enter("train-s@a", "attempt-1", one) and gate.enter("train-s@b", "attempt-2", two)
    assert not gate.leave("attempt-1")  # the build goes on: the driver removes the folders at its end
    assert not gate.leave("never-entered")  # a task interrupted before its `enter` was taken still says it left
    assert gate.close(ALIVE) == [("train-s@b", two)]
    assert not gate.enter("train-s@c", "attempt-3", one)  # a task Ray started although it was cancelled
    assert gate.leave("attempt-2")  # last out of a closed build on its machine: removes the folder there
    assert gate.close(ALIVE) == []


def test_the_last_cell_to_leave_a_closed_gate_on_a_machine_is_told_so():
    """Two nodes on one machine share its temp folder: the first to leave must not remove the other's workspace."""
    gate = ray_node.BuildGate()
    for attempt, node in (("a", "node-1"), ("b", "node-2"), ("c", "node-3")):
        gate.enter(f"train-s@{attempt}", attempt, PLACES[node])
    gate.close(ALIVE)
    assert not gate.leave("a")  # node-2, on the same machine, is still inside
    assert gate.leave("c")  # alone on its machine
    assert gate.leave("b")


def test_a_closed_gate_forgets_cells_that_will_never_leave():
    gate = ray_node.BuildGate()
    gate.enter("train-s@a", "lost", PLACES["node-1"])  # its node is gone
    gate.enter("train-s@b", "dead-worker", PLACES["node-3"])  # its worker died; Ray's retry finished the cell
    gate.enter("train-s@c", "stopping", PLACES["node-3"])
    assert gate.close(["node-2", "node-3"], completed=["train-s@b"]) == [("train-s@c", PLACES["node-3"])]
    assert gate.leave("stopping")  # nobody else inside on gpu-2 any more


PLACES = {"node-1": ray_node.Place("node-1", "gpu-1"), "node-2": ray_node.Place("node-2", "gpu-1"),
          "node-3": ray_node.Place("node-3", "gpu-2")}
ALIVE = list(PLACES)


def test_a_cells_folder_is_in_its_builds_folder_and_goes_with_the_cell(node_tmp):
    with ray_node.cell_folder("build-1", "train-s@cell") as folder:
        assert folder.parent == node_tmp / "build-1" and folder.name.startswith("train-s-cell-")
        (folder / "run.json").write_text("{}")
    assert list((node_tmp / "build-1").iterdir()) == []
    ray_node.remove_build_folder("build-1")
    ray_node.remove_build_folder("never-here")
    assert list(node_tmp.iterdir()) == []


def test_a_cells_cleanup_runs_to_its_end_through_another_cancel():
    """Ray may deliver a cancel (KeyboardInterrupt in the task's thread) again while the cell stops its commands."""
    ended = []

    def cleanup() -> None:
        time.sleep(1.0)
        ended.append(True)

    threading.Timer(0.3, _thread.interrupt_main).start()
    ray_node._to_the_end(cleanup)
    assert ended == [True]


def test_a_cell_that_leaves_a_closed_build_last_on_its_machine_removes_the_builds_folder(node_tmp, monkeypatch):
    """The driver waits a while for cancelled cells, then removes the folders; a cell still starting then (a loaded
    machine) writes into its build's folder after that, and removes it itself as it leaves."""
    import ray

    class Actor:  # the gate as a Ray actor handle: `gate.leave.remote(...)` gives what `ray.get` returns
        def __init__(self, gate):
            self.leave = type("Method", (), {"remote": staticmethod(gate.leave)})

    monkeypatch.setattr(ray, "get", lambda value, timeout=None: value)
    gate = ray_node.BuildGate()
    for attempt in ("late", "other"):
        gate.enter("train-s@a", attempt, PLACES["node-1"])
    with ray_node.cell_folder("build-1", "train-s@a") as folder:
        (folder.parent / "dvc-cache").mkdir()
    gate.close(ALIVE)
    ray_node._leave(Actor(gate), "other", "build-1")
    assert (node_tmp / "build-1" / "dvc-cache").is_dir()  # "late" is still inside on this machine
    ray_node._leave(Actor(gate), "late", "build-1")
    assert list(node_tmp.iterdir()) == []


def test_the_watcher_stops_a_cells_commands_once_its_worker_is_gone():
    """A node lost (the worker killed with SIGKILL): the detached watcher sees it (psutil) and ends the cell's process
    group, so no cell trains on beside its retry."""
    import subprocess
    import sys

    import psutil

    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    cell = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
    subprocess.run([sys.executable, "-c", ray_node._WATCHER, str(worker.pid), str(cell.pid)], check=True,
                   start_new_session=True)
    time.sleep(1.0)
    assert cell.poll() is None  # the worker lives: the cell goes on
    worker.kill()  # left a zombie until reaped: the watcher must not count it alive
    deadline = time.monotonic() + 15
    while cell.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    worker.wait()
    assert cell.returncode == -15  # SIGTERM: its run ends KILLED
    assert not psutil.pid_exists(cell.pid)
