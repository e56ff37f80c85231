"""Atomic outputs: a folder appears complete, with ordinary permissions, or not at all; and an output never replaces
a folder holding files layertune did not write, unless asked to."""

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import datasets
import pytest

from layertune.io import (MARKER, OutputDirectoryError, atomic_directory, atomic_file, check_output_directory,
                          dataset_digest, output_directory, write_json)


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


def test_an_interrupted_file_write_leaves_the_old_file_and_no_staging_file(tmp_path):
    write_json(tmp_path / "metrics.json", {"score": 1})
    with pytest.raises(RuntimeError), atomic_file(tmp_path / "metrics.json") as staging:
        assert staging.suffix == ".json" and staging.parent == tmp_path
        staging.write_text('{"score": ')  # half of it
        raise RuntimeError("interrupted")
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.json"]
    assert json.loads((tmp_path / "metrics.json").read_text()) == {"score": 1}
    with pytest.raises(ValueError, match="not JSON compliant"):  # refused before anything is written
        write_json(tmp_path / "metrics.json", {"score": float("nan")})
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.json"]


def test_a_write_replaces_a_link_and_never_writes_through_it(tmp_path):
    target = tmp_path / "users-file.json"
    target.write_text("mine")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "metrics.json").symlink_to(target)
    write_json(tmp_path / "out" / "metrics.json", {"score": 1})
    assert target.read_text() == "mine"
    assert not (tmp_path / "out" / "metrics.json").is_symlink()


def test_the_staging_file_of_a_killed_writer_is_removed_by_the_next_write(tmp_path):
    (tmp_path / ".report.md.partial-999999999-0123abcd.md").write_text("half")  # no such process
    (tmp_path / f".report.md.partial-{os.getpid()}-4567ef.md").write_text("a live writer's")
    with atomic_file(tmp_path / "report.md") as staging:
        staging.write_text("whole")
    assert sorted(p.name for p in tmp_path.iterdir()) == [f".report.md.partial-{os.getpid()}-4567ef.md", "report.md"]


def test_the_work_folder_of_a_cancelled_cell_is_removed_once_its_exiting_worker_is_gone(tmp_path, monkeypatch):
    """A killed Ray worker may still be exiting when the driver cleans: the folders of its build are waited for."""
    import tempfile

    from pipelines.ray_cluster import node_folder, remove_work_folders

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    exiting = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3)"])
    work = node_folder() / f".cell.partial-{exiting.pid}-build2-abc"
    live = node_folder() / f".cell.partial-{os.getpid()}-build1-def"  # another build's cell, training: kept
    work.mkdir(), live.mkdir()
    try:
        remove_work_folders()
        assert work.is_dir() and live.is_dir()  # their processes are alive: not removed without a wait
        remove_work_folders("build2", wait_s=0.5)  # not long enough: its worker is still exiting
        assert work.is_dir() and live.is_dir()
        threading.Thread(target=exiting.wait).start()  # reaped once it exits, as Ray's raylet reaps its workers
        started = time.monotonic()
        remove_work_folders("build2", wait_s=600)
        assert not work.exists() and live.is_dir()
        assert time.monotonic() - started < 60  # the other build's live cell did not hold the wait to its end
    finally:
        exiting.kill()


def foreign_folder(path: Path) -> Path:
    """A user's folder: files layertune did not write."""
    (path / "notes").mkdir(parents=True)
    (path / "notes" / "chapter1.tex").write_text("my thesis")
    return path


def contents(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): p.read_text() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_an_output_folder_is_marked_and_replaced_by_the_next_output(tmp_path):
    with output_directory(tmp_path / "out", written_by="a test") as staging:
        (staging / "metrics.json").write_text("1")
    assert json.loads((tmp_path / "out" / MARKER).read_text())["written_by"] == "a test"
    with output_directory(tmp_path / "out") as staging:  # a previous output: replaced without overwrite
        (staging / "history.json").write_text("2")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [MARKER, "history.json"]
    (tmp_path / "empty").mkdir()
    with output_directory(tmp_path / "empty") as staging:  # an empty folder holds nothing to lose
        (staging / "metrics.json").write_text("3")
    assert (tmp_path / "empty" / "metrics.json").read_text() == "3"


def test_a_foreign_folder_is_refused_before_the_block_and_left_untouched(tmp_path):
    thesis = foreign_folder(tmp_path / "thesis")
    with pytest.raises(OutputDirectoryError, match=r"'.*thesis' already exists and holds files layertune did "
                                                   r"not write.*Choose another folder, or pass overwrite=True"):
        with output_directory(thesis):
            pytest.fail("the block ran: the output was written")
    assert contents(thesis) == {"notes/chapter1.tex": "my thesis"}
    assert [p.name for p in tmp_path.iterdir()] == ["thesis"]  # no staging folder left


def test_overwrite_replaces_a_foreign_folder(tmp_path):
    thesis = foreign_folder(tmp_path / "thesis")
    with output_directory(thesis, overwrite=True) as staging:
        (staging / "metrics.json").write_text("{}")
    assert sorted(p.name for p in thesis.iterdir()) == [MARKER, "metrics.json"]
    assert [p.name for p in tmp_path.iterdir()] == ["thesis"]


def test_files_put_in_the_folder_while_the_output_was_written_are_kept(tmp_path):
    """The folder is checked again before the swap: hours of training may pass between the two checks."""
    with pytest.raises(OutputDirectoryError, match="holds files layertune did not write"):
        with output_directory(tmp_path / "out") as staging:  # no folder yet when the output began
            foreign_folder(tmp_path / "out")
            (staging / "metrics.json").write_text("{}")
    assert contents(tmp_path / "out") == {"notes/chapter1.tex": "my thesis"}
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


@pytest.mark.parametrize("where", [".", "..", "/", "~", "~/..", "link-to-cwd"])
def test_the_current_and_home_folders_and_their_parents_are_refused_even_with_overwrite(tmp_path, monkeypatch, where):
    """Replacing one would delete everything in it (``--output-dir .`` once failed only after training, busy)."""
    home, work = tmp_path / "home", tmp_path / "home" / "project"
    (work / "data").mkdir(parents=True)
    (work / "link-to-cwd").symlink_to(work)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(work)
    with pytest.raises(OutputDirectoryError, match=r"is (the current folder|the home folder|a parent of the current "
                                                   r"folder).*delete everything in it\. Give a new folder"):
        check_output_directory(where, overwrite=True)
    assert contents(work) == {} and (work / "data").is_dir()


def test_a_link_or_a_file_is_not_an_output_folder(tmp_path):
    thesis = foreign_folder(tmp_path / "thesis")
    (tmp_path / "link").symlink_to(thesis)
    (tmp_path / "file.txt").write_text("x")
    with pytest.raises(OutputDirectoryError, match="'.*link' is a symbolic link"):
        check_output_directory(tmp_path / "link", overwrite=True)
    with pytest.raises(OutputDirectoryError, match="'.*file.txt' exists and is not a folder"):
        check_output_directory(tmp_path / "file.txt", overwrite=True)
    assert check_output_directory(tmp_path / "new" / "run") == tmp_path / "new" / "run"  # absent: fine


def test_model_trainer_refuses_a_foreign_folder_before_training_and_replaces_its_own(tiny_bert, tmp_path, monkeypatch):
    from layertune import LanguageModel, ModelTrainer, TextClassifier
    from tests.conftest import toy_sentiment_corpus

    corpus = toy_sentiment_corpus(16, 8)
    trainer = ModelTrainer(TextClassifier(LanguageModel(tiny_bert, tunable_layers=1), 2), corpus,
                           cache_dir=tmp_path / "cache")
    thesis = foreign_folder(tmp_path / "thesis")
    with monkeypatch.context() as patch:
        patch.setattr(ModelTrainer, "_train_epoch", lambda *a, **k: pytest.fail("training started"))
        with pytest.raises(OutputDirectoryError, match="thesis' already exists and holds files layertune did not"):
            trainer.train(thesis, progress=False, epochs=1, batch_size=8)
    assert contents(thesis) == {"notes/chapter1.tex": "my thesis"}
    trainer.train(thesis, progress=False, overwrite=True, epochs=1, batch_size=8)
    assert not (thesis / "notes").exists() and (thesis / "metrics.json").is_file()
    first = (thesis / "history.json").read_text()
    trainer.train(thesis, progress=False, epochs=2, batch_size=8)  # its own output: replaced without overwrite
    assert len(json.loads((thesis / "history.json").read_text())) == 2 != len(json.loads(first))
    assert json.loads((thesis / MARKER).read_text())["written_by"] == "ModelTrainer.train"


def test_every_catalog_write_is_atomic_and_a_tree_reads_no_staging_file(tmp_path):
    """The pipeline's datasets write through `atomic_file`: a figure or table whose writing fails leaves the file
    of the last build, and a tree of files reads only whole ones."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import pandas as pd
    from kedro.io import DatasetError

    from pipelines.datasets import FileDataset, FileTreeDataset
    from pipelines.plans import DownloadPlan

    figures = FileTreeDataset(str(tmp_path / "figures"), ".png")
    figure, axes = plt.subplots()
    axes.plot([1, 2])
    figures.save({"scores": figure})
    before = (tmp_path / "figures" / "scores.png").read_bytes()

    class Broken:  # a figure that fails half-way through its bytes
        def savefig(self, target, **kwargs):
            target.write(b"\x89PNG half")
            raise OSError("disk full")

    with pytest.raises(DatasetError, match="disk full"), pytest.MonkeyPatch.context() as patch:
        patch.setattr(plt, "close", lambda figure: None)
        figures.save({"scores": Broken()})
    assert (tmp_path / "figures" / "scores.png").read_bytes() == before
    assert [p.name for p in (tmp_path / "figures").iterdir()] == ["scores.png"]

    class BadFrame(pd.DataFrame):
        def to_csv(self, *args, **kwargs):  # stopped half-way
            raise KeyboardInterrupt

    table = FileDataset(str(tmp_path / "scores.csv"))
    table.save(pd.DataFrame({"a": [1], "b": [2]}))
    with pytest.raises(KeyboardInterrupt):
        table.save(BadFrame({"a": [3]}))
    assert table.load().to_dict("list") == {"a": [1], "b": [2]}

    tables = FileTreeDataset(str(tmp_path / "tables"), ".csv")
    tables.save({"sst2/scores": pd.DataFrame({"a": [1]})})
    (tmp_path / "tables" / "sst2" / ".other.csv.partial-1-ab.csv").write_text("a\n")  # a live writer's (pid 1)
    assert list(tables.load()) == ["sst2/scores"]
    plan = FileDataset(str(tmp_path / "download.json"), spec="pipelines.plans.DownloadPlan")
    plan.save(DownloadPlan(tasks=["sst2"], mirror=None))
    assert plan.load().tasks == ["sst2"] and [p.name for p in tmp_path.glob(".*")] == []


def test_dataset_digest_is_of_the_rows_as_they_read_wherever_the_data_lies(tmp_path):
    rows = {"text": ["a b", "c", "d e f", ""], "label": [0, 1, 1, 0]}
    original = datasets.Dataset.from_dict(rows)
    original.to_parquet(tmp_path / "a.parquet")
    original.to_parquet(tmp_path / "b.parquet")
    from_a = datasets.Dataset.from_parquet(str(tmp_path / "a.parquet"), cache_dir=str(tmp_path / "hf-a"))
    from_b = datasets.Dataset.from_parquet(str(tmp_path / "b.parquet"), cache_dir=str(tmp_path / "hf-b"))
    digest = dataset_digest(from_a)
    assert dataset_digest(from_b) == dataset_digest(original) == digest  # the content, not where it came from
    # a selection counts as the rows it gives, however it was made
    assert dataset_digest(from_a.select([1, 2])) == dataset_digest(datasets.Dataset.from_dict(
        {"text": ["c", "d e f"], "label": [1, 1]}, features=from_a.features))
    assert dataset_digest(from_a.select([2, 1])) != dataset_digest(from_a.select([1, 2]))
    assert dataset_digest(from_a, ["label"]) != digest
    assert dataset_digest(from_a.select(range(4)).flatten_indices()) == digest  # how it is stored does not count
    # Contiguous rows (a slice of the table, not an indices mapping), a nullable column, and chunks: the same rows
    # are the same digest.
    nullable = datasets.Dataset.from_dict({"text": ["a", "bb", "ccc", "dddd"], "score": [1.0, None, 3.0, 4.0]})
    for selected in (nullable.select([0, 1]), nullable.select(range(2)), datasets.concatenate_datasets(
            [nullable.select([0]), nullable.select([1])])):
        assert dataset_digest(selected) == dataset_digest(datasets.Dataset.from_dict(
            {"text": ["a", "bb"], "score": [1.0, None]}, features=nullable.features))
    assert dataset_digest(datasets.concatenate_datasets([nullable.select([0, 1]), nullable.select([2, 3])])) \
        == dataset_digest(nullable)
    named = original.cast_column("label", datasets.ClassLabel(names=["no", "yes"]))
    assert dataset_digest(named) != dataset_digest(named.cast_column("label", datasets.ClassLabel(names=["n", "y"])))
    changed = datasets.Dataset.from_dict({**rows, "text": ["a b", "c", "d e g", ""]})
    assert dataset_digest(changed) != digest
    # the same in a fresh process
    code = ("import sys, datasets; from layertune.io import dataset_digest; "
            "print(dataset_digest(datasets.Dataset.from_parquet(sys.argv[1], cache_dir=sys.argv[2])))")
    fresh = subprocess.run([sys.executable, "-c", code, str(tmp_path / "b.parquet"), str(tmp_path / "hf-c")],
                           capture_output=True, text=True, check=True)
    assert fresh.stdout.split()[-1] == digest
