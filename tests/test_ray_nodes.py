"""What `layertune repro --ray` does around a cell, without Ray: the build's gate (which cells are inside, so that the
driver removes the nodes' folders only once they have left), the cell's folder, and a cleanup that a repeated cancel
cannot cut short."""

import _thread
import os
import tempfile
import threading
import time

import pytest

from pipelines import ray_cluster


@pytest.fixture
def node_tmp(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path / f"layertune-ray-{os.getuid()}"


def test_the_gate_lists_the_cells_inside_and_once_closed_lets_none_in():
    gate = ray_cluster.BuildGate()
    assert gate.enter("train-s@a", "attempt-1", "node-1") and gate.enter("train-s@b", "attempt-2", "node-2")
    gate.leave("attempt-1")
    gate.leave("never-entered")  # a task interrupted before its `enter` was taken still says it left
    assert gate.close() == [("train-s@b", "node-2")]
    assert not gate.enter("train-s@c", "attempt-3", "node-1")  # a task Ray started although it was cancelled
    gate.leave("attempt-2")
    assert gate.close() == []


def test_a_cells_folder_is_in_its_builds_folder_and_goes_with_the_cell(node_tmp):
    with ray_cluster.cell_folder("build-1", "train-s@cell") as folder:
        assert folder.parent == node_tmp / "build-1" and folder.name.startswith("train-s-cell-")
        (folder / "run.json").write_text("{}")
    assert list((node_tmp / "build-1").iterdir()) == []
    ray_cluster.remove_build_folder("build-1")
    ray_cluster.remove_build_folder("never-here")
    assert list(node_tmp.iterdir()) == []


def test_a_cells_cleanup_runs_to_its_end_through_another_cancel():
    """Ray may deliver a cancel (KeyboardInterrupt in the task's thread) again while the cell stops its commands."""
    ended = []

    def cleanup() -> None:
        time.sleep(1.0)
        ended.append(True)

    threading.Timer(0.3, _thread.interrupt_main).start()
    ray_cluster._to_the_end(cleanup)
    assert ended == [True]
