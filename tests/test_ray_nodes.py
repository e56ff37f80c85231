"""What `layertune repro --ray` does on a node around a cell, without Ray: the cell's folder in the build's folder,
and the build's folder removed only once every cell there has ended its cleanup (a cancelled cell stops its
commands after the driver has moved on)."""

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


def test_removing_a_build_waits_for_its_cells_to_end_their_cleanup(node_tmp):
    inside, stopping = threading.Event(), threading.Event()

    def cancelled_cell() -> None:
        with ray_cluster.cell_folder("build-1", "train-s@cell") as folder:
            inside.set()
            stopping.wait()
            (folder / "run.json").write_text("a stopping command's last write")

    cell = threading.Thread(target=cancelled_cell)
    cell.start()
    inside.wait()
    remover = threading.Thread(target=ray_cluster.remove_build_folder, args=("build-1",))
    remover.start()
    time.sleep(1.0)
    assert remover.is_alive() and (node_tmp / "build-1").is_dir()  # waits for the cell
    stopping.set()
    cell.join()
    remover.join(10)
    assert not remover.is_alive()
    assert list(node_tmp.iterdir()) == []


def test_a_cell_stuck_in_its_cleanup_is_not_waited_for_past_the_timeout(node_tmp):
    with ray_cluster.cell_folder("build-2", "train-s@cell") as folder:
        started = time.monotonic()
        ray_cluster.remove_build_folder("build-2", timeout_s=0.5)
        assert 0.5 <= time.monotonic() - started < 5
        assert not folder.exists()
    assert list(node_tmp.iterdir()) == []


def test_a_build_with_no_cell_on_this_node_is_removed_at_once(node_tmp):
    ray_cluster.remove_build_folder("never-here")
    ray_cluster.build_folder("made-no-cell")
    ray_cluster.remove_build_folder("made-no-cell")
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
