"""A study's cell folders prove what they hold (`pipelines.trained_cells`): a cell counts as built only when its
folder's build record names the planned build, its cell.json is the planned spec and every file is the one its build
wrote; a folder that does not prove it is set aside, never deleted, and the cell trains again. A cell folder handed
from a Ray node to the driver (`pack` / `TrainedCells.receive`) comes back whole, and an archive that is not a
packed cell, or one that does not prove its build, is refused before anything is written."""

import io
import json
import logging
import os
import re
import shutil
import tarfile
from pathlib import Path

import pytest

from layertune.cell import TrainedCell
from pipelines.trained_cells import BUILD_FILE, TrainedCells, build_record, pack
from tests.test_tracking import CELL, result

WEIGHTS = bytes(range(256)) * 10


class SavedModel:
    """What a trained model writes into a cell's ``model/`` folder, without a model (`TrainedCell.save` asks no
    more of it)."""

    def __init__(self, weights: bytes = WEIGHTS) -> None:
        self.weights = weights

    def save(self, directory: Path) -> None:
        Path(directory).mkdir(parents=True)
        (Path(directory) / "model.safetensors").write_bytes(self.weights)
        (Path(directory) / "config.json").write_text("{}")


def cells(tmp_path) -> TrainedCells:
    return TrainedCells(tmp_path / "models" / "s", tmp_path / "models" / ".retired" / "s")


def cell(seed: int):
    return CELL.model_copy(update={"seed": seed, "spec": CELL.spec.model_copy(update={
        "training": CELL.spec.training.model_copy(update={"seed": seed})})})


def write(study: TrainedCells, seed: int, weights: bytes = WEIGHTS) -> tuple[str, dict]:
    """Cell ``seed`` trained and written as the train stage writes it; its key and build record."""
    planned = cell(seed)
    build = build_record(planned, code="code", data="data")
    study.write(planned.key, TrainedCell(planned.spec, result(), SavedModel(weights)), build)
    return planned.key, build


def test_a_written_cell_proves_its_build_and_nothing_else(tmp_path):
    study = cells(tmp_path)
    key, build = write(study, 1)
    record = json.loads((study.path / key / BUILD_FILE).read_text())
    assert sorted(record["files"]) == [".layertune-output", "cell.json", "drift.csv", "history.json", "metrics.json",
                                       "model/config.json", "model/model.safetensors", "predictions.json",
                                       "run_info.json"]
    assert study.is_built(key, build["key"]) and study.settle(key, build["key"])
    assert not study.is_built(key, "another build") and record["cell"] == key


def swap_files(source: Path, target: Path) -> None:
    """``target``'s files replaced by ``source``'s, but for its build record (a copy or a hand gone wrong)."""
    for path in target.iterdir():
        if path.name != BUILD_FILE:
            shutil.rmtree(path) if path.is_dir() else path.unlink()
    for path in source.iterdir():
        if path.name != BUILD_FILE:
            (shutil.copytree if path.is_dir() else shutil.copy)(path, target / path.name)


def set_aside(study: TrainedCells, key: str) -> Path:
    return study.retired / ".unverified" / f"{key}-1"


def test_a_folder_holding_another_cells_files_is_set_aside_and_the_cell_trains_again(tmp_path, caplog):
    study = cells(tmp_path)
    (one, build), (two, _) = write(study, 1, WEIGHTS), write(study, 2, WEIGHTS[::-1])
    swap_files(study.path / two, study.path / one)
    with caplog.at_level(logging.WARNING):
        assert not study.settle(one, build["key"])
    assert not (study.path / one).exists() and study.is_built(two, build_record(cell(2), "code", "data")["key"])
    aside = set_aside(study, one)
    assert (aside / "model" / "model.safetensors").read_bytes() == WEIGHTS[::-1]  # kept as it was
    [line] = [record.getMessage() for record in caplog.records]
    assert f"{study.path / one} does not prove it holds cell {one}" in line and "its digest differs" in line
    assert f"set aside, untouched, in {aside}" in line


def test_a_cell_without_its_weights_is_not_built(tmp_path, caplog):
    study = cells(tmp_path)
    key, build = write(study, 1)
    (study.path / key / "model" / "model.safetensors").unlink()  # a copy or a pull cut short
    with caplog.at_level(logging.WARNING):
        assert not study.settle(key, build["key"])
    assert "model/model.safetensors is missing" in caplog.text and set_aside(study, key).is_dir()


def test_a_retired_folder_holding_another_cells_files_is_not_taken_back(tmp_path, caplog):
    study = cells(tmp_path)
    (one, build), (two, _) = write(study, 1), write(study, 2, WEIGHTS[::-1])
    study.set_aside(planned=[])  # both seeds removed from params.yaml: retired
    swap_files(study.retired / two, study.retired / one)
    with caplog.at_level(logging.WARNING):
        assert not study.settle(one, build["key"])  # planned again: not taken back
    assert not (study.path / one).exists() and set_aside(study, one).is_dir() and "digest differs" in caplog.text


def test_an_older_builds_folder_stays_for_the_new_build_to_replace(tmp_path, caplog):
    study = cells(tmp_path)
    key, _ = write(study, 1)
    with caplog.at_level(logging.WARNING):
        assert not study.settle(key, "a newer build")
    assert (study.path / key).is_dir() and not caplog.text


@pytest.mark.parametrize("records", ["naming their cell", "from before records named their cell"])
def test_two_folders_swapped_whole_are_both_set_aside_and_train_again(tmp_path, caplog, records):
    """Each proves its own build, under the other's name: each was taken for an older build of the cell at its place,
    and deleted when that cell trained again (issue 57)."""
    study = cells(tmp_path)
    (one, build_one), (two, build_two) = write(study, 1, WEIGHTS), write(study, 2, WEIGHTS[::-1])
    if records != "naming their cell":
        for key in (one, two):
            record = json.loads((study.path / key / BUILD_FILE).read_text())
            del record["cell"]
            (study.path / key / BUILD_FILE).write_text(json.dumps(record))
    os.replace(study.path / one, study.path / "swap")
    os.replace(study.path / two, study.path / one)
    os.replace(study.path / "swap", study.path / two)
    planned = {one: build_one["key"], two: build_two["key"]}
    with caplog.at_level(logging.WARNING):
        assert not study.settle(one, build_one["key"], planned) and not study.settle(two, build_two["key"], planned)
    assert not list(study.path.iterdir())
    assert (set_aside(study, one) / "model" / "model.safetensors").read_bytes() == WEIGHTS[::-1]  # cell 2's, whole
    assert (set_aside(study, two) / "model" / "model.safetensors").read_bytes() == WEIGHTS
    lines = [record.getMessage() for record in caplog.records]
    assert len(lines) == 2 and f"{study.path / one} does not prove it holds cell {one} (it holds the build of cell " \
        f"{two}, not of {one}): set aside, untouched, in {set_aside(study, one)}" in lines[0], lines


def test_what_a_build_did_not_write_is_moved_aside_and_the_cell_stays_built(tmp_path, caplog):
    """A note, a folder of your own, a file in the model's folder, a link out of the study: the cell proves its
    build, so it stays built, and what its build did not write leaves the study's output (which DVC would track and
    push) for the cell's place aside, each at its path, untouched."""
    study = cells(tmp_path)
    key, build = write(study, 1)
    folder = study.path / key
    written = sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))
    (folder / "notes.txt").write_text("mine")
    (folder / "model" / "extra.bin").write_bytes(b"x")
    (folder / "plots").mkdir()
    (folder / "plots" / "loss.png").write_bytes(b"png")
    outside = tmp_path / "outside.txt"
    outside.write_text("out")
    (folder / "link").symlink_to(outside)
    with caplog.at_level(logging.WARNING):
        assert study.settle(key, build["key"])
    assert sorted(str(p.relative_to(folder)) for p in folder.rglob("*")) == written
    aside = set_aside(study, key)
    assert (aside / "notes.txt").read_text() == "mine" and (aside / "model" / "extra.bin").read_bytes() == b"x"
    assert (aside / "plots" / "loss.png").read_bytes() == b"png" and (aside / "link").is_symlink()
    assert outside.read_text() == "out"
    [line] = [record.getMessage() for record in caplog.records]
    assert line == (f"{folder} holds what its build did not write (link, model/extra.bin, notes.txt, plots): moved "
                    f"aside, untouched, to {aside}; the cell stays built")
    assert study.settle(key, build["key"]) and not (study.retired / ".unverified" / f"{key}-2").exists()


def test_an_older_build_changed_by_hand_is_set_aside_not_replaced(tmp_path, caplog):
    study = cells(tmp_path)
    key, _ = write(study, 1)
    (study.path / key / "metrics.json").write_text("{}")  # yours now: the new build would have deleted it
    with caplog.at_level(logging.WARNING):
        assert not study.settle(key, "a newer build")
    assert not (study.path / key).exists() and (set_aside(study, key) / "metrics.json").read_text() == "{}"
    assert "metrics.json is not the file its build wrote" in caplog.text


@pytest.mark.parametrize("kind", ["a user's folder", "a link out of the study"])
def test_a_folder_no_build_wrote_is_set_aside_never_followed_or_deleted(tmp_path, caplog, kind):
    study = cells(tmp_path)
    key, build = cell(1).key, build_record(cell(1), "code", "data")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "notes.txt").write_text("mine")
    study.path.mkdir(parents=True)
    if kind == "a link out of the study":
        (study.path / key).symlink_to(outside)
    else:
        shutil.copytree(outside, study.path / key)
    with caplog.at_level(logging.WARNING):
        assert not study.settle(key, build["key"])
    assert not (study.path / key).exists() and not (study.path / key).is_symlink()
    assert (set_aside(study, key) / "notes.txt").read_text() == "mine" and (outside / "notes.txt").is_file()
    assert ("it is a link" if "link" in kind else f"no readable {BUILD_FILE}") in caplog.text


def other_study(tmp_path, name: str = "t") -> TrainedCells:
    """Another study of the same project: its folders beside `cells`'s."""
    return TrainedCells(tmp_path / "models" / name, tmp_path / "models" / ".retired" / name)


def test_a_cell_another_study_built_is_copied_whole_under_its_own_name_and_the_source_is_untouched(tmp_path):
    """The default methods study's top-K cells are the ablation's SST-2 cells (the same spec, models, code and data):
    a study finds them built beside it and copies them instead of training them again."""
    donor, study = other_study(tmp_path), cells(tmp_path)
    source_key, build = write(donor, 1)
    (donor.path / source_key / "notes.txt").write_text("mine")  # not the build's: not copied
    before = {path: path.read_bytes() for path in (donor.path / source_key).rglob("*") if path.is_file()}
    found = study.built_elsewhere()
    assert found == {build["key"]: [donor.path / source_key]}
    assert study.copy_built("methods-top_k-0-1", build, donor.path / source_key)
    copied = study.path / "methods-top_k-0-1"
    assert study.is_built("methods-top_k-0-1", build["key"])
    record = json.loads((copied / BUILD_FILE).read_text())
    assert record["cell"] == "methods-top_k-0-1" and record["copied_from"] == f"t/{source_key}"
    assert not (copied / "notes.txt").exists() and (copied / "model" / "model.safetensors").read_bytes() == WEIGHTS
    assert {path: path.read_bytes() for path in (donor.path / source_key).rglob("*") if path.is_file()} == before
    assert study.settle("methods-top_k-0-1", build["key"])  # a later build finds it built, in place


def test_a_cell_is_not_copied_from_a_folder_that_does_not_prove_its_build_and_nothing_is_written(tmp_path, caplog):
    donor, study = other_study(tmp_path), cells(tmp_path)
    source_key, build = write(donor, 1)
    (donor.path / source_key / "model" / "model.safetensors").write_bytes(WEIGHTS[::-1])  # changed by hand
    with caplog.at_level(logging.WARNING):
        assert not study.copy_built("methods-top_k-0-1", build, donor.path / source_key)
    assert not study.path.exists() or not list(study.path.iterdir())
    assert "cell methods-top_k-0-1 is trained, not copied" in caplog.text and "its digest differs" in caplog.text
    assert (donor.path / source_key / "model" / "model.safetensors").read_bytes() == WEIGHTS[::-1]


def test_a_folder_whose_record_was_given_another_cells_key_is_not_copied_as_that_cell(tmp_path, caplog):
    """Seed 2's folder with seed 1's build key written into its record (by hand) proves that key by its files and its
    own spec: what the record says the build is made of is another build, and it is not copied as seed 1's cell."""
    donor, study = other_study(tmp_path), cells(tmp_path)
    wanted = build_record(cell(1), code="code", data="data")
    key, _ = write(donor, 2)
    record = json.loads((donor.path / key / BUILD_FILE).read_text())
    (donor.path / key / BUILD_FILE).write_text(json.dumps({**record, "key": wanted["key"]}))
    with caplog.at_level(logging.WARNING):
        assert not study.copy_built(cell(1).key, wanted, donor.path / key)
    assert "its build record names another build" in caplog.text and not study.is_built(cell(1).key, wanted["key"])


@pytest.mark.parametrize("meanwhile", ["changed", "removed"])
def test_a_source_changed_or_removed_while_it_is_copied_leaves_nothing_and_the_cell_trains(tmp_path, monkeypatch,
                                                                                           caplog, meanwhile):
    donor, study = other_study(tmp_path), cells(tmp_path)
    key, build = write(donor, 1)
    weights = donor.path / key / "model" / "model.safetensors"
    copyfile = shutil.copyfile

    def racing(source, target, **kwargs):
        if Path(source) == weights:  # after the source proved its build, before this file is copied
            weights.write_bytes(WEIGHTS[::-1]) if meanwhile == "changed" else weights.unlink()
        return copyfile(source, target, **kwargs)

    monkeypatch.setattr(shutil, "copyfile", racing)
    with caplog.at_level(logging.WARNING):
        assert not study.copy_built("methods-top_k-0-1", build, donor.path / key)
    assert not study.path.exists() or not list(study.path.iterdir())  # no folder, no staging left
    assert "is trained, not copied" in caplog.text
    assert ("its digest differs" if meanwhile == "changed" else "No such file") in caplog.text


def test_the_cell_is_copied_from_the_first_study_whose_folder_proves_the_build(tmp_path):
    from pipelines.train.nodes import copied_from_other_studies

    study, damaged, intact = cells(tmp_path), other_study(tmp_path, "a"), other_study(tmp_path, "b")
    (key, build), _ = write(damaged, 1), write(intact, 1)
    (damaged.path / key / "metrics.json").write_text("{}")
    assert study.built_elsewhere() == {build["key"]: [damaged.path / key, intact.path / key]}
    assert copied_from_other_studies([cell(1), cell(2)], {key: build, cell(2).key: build_record(cell(2), "c", "d")},
                                     study) == {key}
    assert json.loads((study.path / key / BUILD_FILE).read_text())["copied_from"] == f"b/{key}"


def test_only_other_studies_folders_are_looked_at_never_through_a_link(tmp_path):
    study, donor = cells(tmp_path), other_study(tmp_path)
    own_key, own = write(study, 1)  # its own cells are `settle`'s
    donor_key, build = write(donor, 2)
    elsewhere = tmp_path / "elsewhere"
    linked_key, linked = write(TrainedCells(elsewhere / "x", elsewhere / ".retired"), 3)
    (tmp_path / "models" / "linked-study").symlink_to(elsewhere / "x")
    (donor.path / "linked-cell").symlink_to(elsewhere / "x" / linked_key)
    write(TrainedCells(tmp_path / "models" / ".retired" / "u", tmp_path / "r"), 4)  # retired: not another study
    assert study.built_elsewhere() == {build["key"]: [donor.path / donor_key]}
    assert own["key"] not in study.built_elsewhere() and linked["key"] not in study.built_elsewhere()


@pytest.mark.parametrize("how", ["a path out of the folder", "an absolute path", "through a linked folder"])
def test_a_record_naming_files_outside_its_folder_proves_nothing_and_nothing_is_read_or_written_there(tmp_path, how,
                                                                                                 caplog):
    """A build record written by hand could name any file, with its digest: its folder proves no build, and a study
    that finds it beside it copies nothing from there, nor to there."""
    from layertune.io import file_digest

    donor, study = other_study(tmp_path), cells(tmp_path)
    key, build = write(donor, 1)
    folder = donor.path / key
    secret = tmp_path / "secret.txt"
    secret.write_text("not a cell's")
    record = json.loads((folder / BUILD_FILE).read_text())
    if how == "through a linked folder":
        shutil.rmtree(folder / "model")
        (tmp_path / "elsewhere").mkdir()
        shutil.copy(secret, tmp_path / "elsewhere" / "model.safetensors")
        (folder / "model").symlink_to(tmp_path / "elsewhere")
        record["files"].pop("model/config.json")
        record["files"]["model/model.safetensors"] = file_digest(secret)
    else:
        name = os.path.relpath(secret, study.path / key) if how == "a path out of the folder" else str(secret)
        record["files"][name] = file_digest(secret)
    (folder / BUILD_FILE).write_text(json.dumps(record))
    with caplog.at_level(logging.WARNING):
        assert not study.copy_built("methods-top_k-0-1", build, folder)
    assert "not a path inside the folder" in caplog.text or "is a link, not a folder" in caplog.text
    assert not donor.is_built(key, build["key"])
    assert not study.path.exists() or not list(study.path.iterdir())
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["models", "secret.txt"] +
                                                                (["elsewhere"] if "link" in how else []))


def test_a_packed_cell_is_received_whole_once_it_proves_its_build(tmp_path):
    node = cells(tmp_path / "node")
    key, build = write(node, 1)
    received = cells(tmp_path).receive(key, pack(node.path / key), build["key"])
    assert sorted(str(p.relative_to(received)) for p in received.rglob("*")) == \
        sorted(str(p.relative_to(node.path / key)) for p in (node.path / key).rglob("*"))
    assert (received / "model" / "model.safetensors").read_bytes() == WEIGHTS
    with pytest.raises(ValueError, match=f"the folder of cell {key} that came back does not prove its build: it "
                                         "was built for another key"):
        cells(tmp_path / "other").receive(key, pack(node.path / key), "another build")
    assert not list((tmp_path / "other" / "models" / "s").iterdir())  # nothing written


def archive(*members: tuple[tarfile.TarInfo, bytes]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for info, data in members:
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def link(name: str, target: str) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = tarfile.SYMTYPE, target
    return info


@pytest.mark.parametrize("member, why", [
    (tarfile.TarInfo("../outside.json"), "'../outside.json' (a path out of the folder)"),
    (tarfile.TarInfo("/etc/evil"), "'/etc/evil' (a path out of the folder)"),
    (link("model", "/etc"), "'model' (not a file or folder)"),
])
def test_an_archive_that_is_not_a_packed_cell_is_refused_and_writes_nothing(tmp_path, member, why):
    with pytest.raises(ValueError, match=re.escape(f"not a packed cell folder: archive member {why}")):
        cells(tmp_path).receive("c", archive((tarfile.TarInfo("cell.json"), b"{}"), (member, b"x")), "k")
    assert not (tmp_path / "outside.json").exists()
    assert not list((tmp_path / "models" / "s").iterdir())  # no folder, no staging left


def test_a_full_disk_while_a_cell_is_saved_names_the_folder_and_the_bytes_and_loses_nothing(tmp_path, monkeypatch):
    import errno

    from pipelines.trained_cells import CellDiskFull

    study = cells(tmp_path)
    built, build = write(study, 1)

    def full(self, directory):
        (Path(directory)).mkdir(parents=True)
        (Path(directory) / "model.safetensors").write_bytes(b"half")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(SavedModel, "save", full)
    key = cell(2).key
    with pytest.raises(CellDiskFull, match=rf"^no space left for cell {key}'s folder in "
                                           rf"{re.escape(str(study.path))}: it needs up to 0 bytes and .* are free. "
                                           "Free space there; every cell built so far is kept") as raised:
        write(study, 2)
    assert sorted(p.name for p in study.path.iterdir()) == [built]  # nothing half-written, the built cell kept
    assert study.is_built(built, build["key"])
    from pipelines.param_checks import ParamsCheckHook, StageStopped

    with pytest.raises(StageStopped) as stopped:  # as the stage ends with it
        ParamsCheckHook().on_pipeline_error(error=raised.value)
    assert stopped.value.exit_code == 1 and stopped.value.message == raised.value.strerror


def test_a_full_disk_while_a_cell_is_copied_stops_the_stage_naming_the_folder_and_writes_nothing(tmp_path,
                                                                                               monkeypatch):
    """As for a trained cell: a full disk is not a source to pass over (the next cell's copy or training would
    meet it too), but one line saying where and how much; nothing of the copy is left, the source untouched."""
    import errno

    from pipelines.trained_cells import CellDiskFull

    donor, study = other_study(tmp_path), cells(tmp_path)
    key, build = write(donor, 1)

    def full(source, target, **kwargs):
        Path(target).write_bytes(b"half")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(shutil, "copyfile", full)
    with pytest.raises(CellDiskFull, match=r"^no space left for cell methods-top_k-0-1's folder in .*: it needs up "
                                           r"to \d[\d,.]* (bytes|KiB|MiB)"):
        study.copy_built("methods-top_k-0-1", build, donor.path / key)
    assert not study.path.exists() or not list(study.path.iterdir())
    assert donor.is_built(key, build["key"])
