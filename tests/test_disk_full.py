"""A full disk, wherever a build writes (a cell's model and files, the cache's tokenized data and frozen-prefix states,
a prepared corpus, the plan, the reports), is one line naming the folder, the bytes needed and those free, whatever the
writer raised (safetensors' and Arrow's own errors as much as an OSError); nothing half-written is left, and nothing
built before is lost. Each on a real small disk (a tmpfs: the `small_disk` fixture), so that every writer meets the
full disk as it would."""

import json
import os
import re

import pandas as pd
import pytest

from layertune.cli import main
from layertune.io import DiskFull
from tests.test_cli import data_folder

PAGE = 4096  # a tmpfs counts whole pages


def pages(size: int) -> int:
    return -(-size // PAGE) * PAGE


def causes(error: BaseException) -> list[str]:
    """The names of ``error``'s class and of every error it was raised from."""
    found = []
    while error is not None:
        found.append(type(error).__name__)
        error = error.__cause__ or error.__context__
    return found


def test_a_model_that_does_not_fit_is_one_line_naming_the_folder_and_its_bytes(tiny_bert, tmp_path, small_disk,
                                                                                capsys):
    """safetensors says a full disk in its own error, not an OSError: `layertune train-cell` printed its traceback
    (and the pipeline two). The disk holds every other file of the cell, not its model."""
    cell = ["train-cell", "--path", data_folder(tmp_path), "--model", str(tiny_bert), "--tunable-layers", "all",
            "--seed", "1", "--epochs", "1", "--batch-size", "8", "--cache-dir", str(tmp_path / "cache")]
    assert main([*cell, "--output-dir", str(tmp_path / "fits")]) == 0
    capsys.readouterr()
    files = [path for path in (tmp_path / "fits").rglob("*") if path.is_file()]
    model = (tmp_path / "fits" / "model" / "model.safetensors").stat().st_size
    rest = sum(pages(path.stat().st_size) for path in files if path.name != "model.safetensors")
    disk = small_disk(tmp_path / "disk", rest + pages(model // 2))

    assert main([*cell, "--output-dir", str(disk / "cell")]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("error") == 1, err
    said = re.fullmatch(rf"layertune: error: no space left in {re.escape(str(disk))} for cell: it needs at least "
                        r"([\d,]+) bytes \([\d.]+ MiB\) and ([\d,]+) bytes are free\. Free space there, or write it "
                        r"to another disk; nothing of it was written, and what was there is kept\.",
                        err.splitlines()[-1])  # (above it, the progress bar of loading the model)
    assert said and int(said[1].replace(",", "")) >= model * 0.9 > int(said[2].replace(",", "")), err
    assert list(disk.iterdir()) == []  # no half-written cell, no staging folder

    assert main([*cell, "--output-dir", str(disk / "cell"), "--verbose"]) == 2  # the writer that met the disk
    assert "safetensors_rust.SafetensorError: Error while serializing" in capsys.readouterr().err


def test_tokenized_data_that_does_not_fit_names_the_cache_folder_and_its_bytes(tmp_path, small_disk):
    """datasets and Arrow say it as an OSError: said again with the folder and the bytes, nothing left behind."""
    from layertune.testing import build_tokenizer
    from layertune.tokenization import tokenize_corpus
    from tests.test_tokenization import pair_corpus

    corpus = pair_corpus()
    cache = small_disk(tmp_path / "cache", 16 * PAGE, free=0)
    with pytest.raises(DiskFull) as raised:
        tokenize_corpus(corpus, build_tokenizer(tmp_path / "tokenizer"), max_length=10, cache_dir=cache)
    assert re.fullmatch(rf"no space left in {re.escape(str(cache))} for pairs-train-\w+: it needs about [\d,]+ bytes "
                        r"\([\d.]+ MiB\) and 0 bytes are free\. Free space there, .*", raised.value.strerror)
    assert sorted(path.name for path in cache.iterdir()) == [".filler"]


@pytest.mark.parametrize("name, data", [
    ("report.md", "# a report\n" * 100),
    ("scores.csv", pd.DataFrame({"a": range(100)})),
    ("details.json", {"a": list(range(100))}),
    ("figure.png", "figure"),
    ("train.json", "plan"),
])
def test_a_file_a_stage_writes_ends_the_stage_in_one_line_with_its_exact_bytes(tmp_path, small_disk, name, data):
    """Plans, scores, reports, figures: each rendered first, so the line names the bytes it needs exactly; the stage
    (Kedro's failed node, then its traceback) ends in one `Error:` line, exit status 1."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from kedro.io import DatasetError

    from pipelines.datasets import FileDataset, _payload
    from pipelines.param_checks import ParamsCheckHook, StageStopped
    from pipelines.plans import DownloadPlan

    spec = "pipelines.plans.DownloadPlan" if isinstance(data, str) and data == "plan" else None
    if spec:
        data = DownloadPlan(tasks=["sst2"], mirror=None)
    disk = small_disk(tmp_path / "disk", 4 * PAGE, free=0)
    if isinstance(data, str) and data == "figure":
        needed, data = len(_payload(disk / name, plt.subplots()[0], spec)), plt.subplots()[0]
    elif isinstance(data, dict):  # `layertune.io.write_json`'s bytes
        needed = len(json.dumps(data, indent=2, sort_keys=True) + "\n")
    else:
        needed = len(_payload(disk / name, data, spec))
    with pytest.raises(DatasetError) as raised:
        FileDataset(str(disk / name), spec=spec).save(data)
    with pytest.raises(StageStopped) as stopped:
        ParamsCheckHook().on_pipeline_error(error=raised.value)
    assert stopped.value.exit_code == 1 and stopped.value.message.startswith(
        f"no space left in {disk} for {name}: it needs about {needed:,} bytes ("), stopped.value.message
    assert sorted(path.name for path in disk.iterdir()) == [".filler"]


def test_a_prepared_corpus_that_does_not_fit_names_the_task_and_its_bytes(tmp_path, small_disk, toy_corpus):
    from kedro.io import DatasetError

    from pipelines.datasets import CorporaDataset

    disk = small_disk(tmp_path / "prepared", 4 * PAGE, free=0)
    with pytest.raises(DatasetError) as raised:
        CorporaDataset(str(disk / "study")).save({"toy": toy_corpus})
    nbytes = sum(split.data.nbytes for split in toy_corpus.splits().values())
    assert f"no space left in {disk / 'study'} for toy: it needs about {nbytes:,} bytes" in str(raised.value)
    assert "DiskFull" in causes(raised.value) and sorted(os.listdir(disk)) == [".filler", "study"]
    assert os.listdir(disk / "study") == []
