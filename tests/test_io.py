"""Atomic outputs: a folder appears complete, with ordinary permissions, or not at all."""

import pytest

from layertune.io import atomic_directory


def test_atomic_directory_has_the_permissions_of_a_plain_folder(tmp_path):
    (tmp_path / "plain").mkdir()
    with atomic_directory(tmp_path / "out") as staging:
        (staging / "metrics.json").write_text("{}")
    assert (tmp_path / "out" / "metrics.json").read_text() == "{}"
    assert (tmp_path / "out").stat().st_mode == (tmp_path / "plain").stat().st_mode


def test_atomic_directory_failure_leaves_the_old_folder_and_no_partial_one(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "old.txt").write_text("old")
    with pytest.raises(RuntimeError), atomic_directory(tmp_path / "out") as staging:
        (staging / "new.txt").write_text("new")
        raise RuntimeError("interrupted")
    assert [p.name for p in tmp_path.iterdir()] == ["out"]
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["old.txt"]
    with atomic_directory(tmp_path / "out") as staging:  # the next complete write replaces it whole
        (staging / "new.txt").write_text("new")
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["new.txt"]
