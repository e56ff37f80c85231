"""A cell folder handed from a Ray node to the driver (`pipelines.trained_cells.pack` / `TrainedCells.receive`):
the same files back, and an archive that is not a packed cell refused before anything is written."""

import io
import re
import tarfile

import pytest

from pipelines.trained_cells import TrainedCells, pack


def cells(tmp_path) -> TrainedCells:
    return TrainedCells(tmp_path / "models" / "s", tmp_path / "models" / ".retired" / "s")


def test_a_packed_cell_is_received_whole(tmp_path):
    folder = tmp_path / "node" / "c"
    (folder / "model").mkdir(parents=True)
    (folder / "cell.json").write_text("{}")
    (folder / "model" / "model.safetensors").write_bytes(bytes(range(256)) * 10)
    received = cells(tmp_path).receive("c", pack(folder))
    assert sorted(str(p.relative_to(received)) for p in received.rglob("*")) == \
        ["cell.json", "model", "model/model.safetensors"]
    assert (received / "model" / "model.safetensors").read_bytes() == bytes(range(256)) * 10


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
        cells(tmp_path).receive("c", archive((tarfile.TarInfo("cell.json"), b"{}"), (member, b"x")))
    assert not (tmp_path / "outside.json").exists()
    assert not list((tmp_path / "models" / "s").iterdir())  # no folder, no staging left
