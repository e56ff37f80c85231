"""A full disk, wherever a build writes (a cell's model and files, the cache's tokenized data and frozen-prefix states,
a prepared corpus, the plan, the reports), is one line naming the folder, the bytes needed and those free, whatever the
writer raised (safetensors' and Arrow's own errors as much as an OSError); nothing half-written is left, and nothing
built before is lost. Each on a real small disk (a tmpfs: the `small_disk` fixture), so that every writer meets the
full disk as it would."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from layertune.cli import main
from layertune.io import DiskFull, in_bytes
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
                        r"([\d,]+) bytes \([\d.]+ KiB\) and ([\d,]+) bytes \([\d.]+ KiB\) are free\. Free space "
                        r"there, or write it to another disk; nothing of it was written, and what was there is kept\.",
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
    assert re.fullmatch(rf"no space left in {re.escape(str(cache))} for pairs-train-\w+: it needs about [\d,]+ bytes"
                        r"( \([\d.]+ KiB\))? and 0 bytes are free\. Free space there, .*", raised.value.strerror)
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
        f"no space left in {disk} for {name}: it needs about {in_bytes(needed)} and 0 bytes are free. "), \
        stopped.value.message
    assert sorted(path.name for path in disk.iterdir()) == [".filler"]


def test_a_prepared_corpus_that_does_not_fit_names_the_task_and_its_bytes(tmp_path, small_disk, toy_corpus):
    from kedro.io import DatasetError

    from pipelines.datasets import CorporaDataset

    disk = small_disk(tmp_path / "prepared", 4 * PAGE, free=0)
    with pytest.raises(DatasetError) as raised:
        CorporaDataset(str(disk / "study")).save({"toy": toy_corpus})
    nbytes = sum(split.data.nbytes for split in toy_corpus.splits().values())
    assert f"no space left in {disk / 'study'} for toy: it needs about {in_bytes(nbytes)} and 0 bytes are free" \
        in str(raised.value)
    assert "DiskFull" in causes(raised.value) and sorted(os.listdir(disk)) == [".filler", "study"]
    assert os.listdir(disk / "study") == []


# ------------------------------------------------------------------------- every place a build writes, in a build

STUDY = {"download": {"mirror": "mirror"}, "studies": {"s": {
    "report": {"kind": "layers", "resamples": 200, "examples": 2}, "tasks": ["sst2"],
    "encoders": {"tiny": "models/tiny-a"},
    "tunable_layers": [0, "all"], "seeds": [1], "data": {"seed": 1},
    "training": {"learning_rate": 1.0e-3, "batch_size": 8, "epochs": 2, "max_length": 32}}}}
STAGES = ("plan", "download", "prepare", "tokenize", "train", "evaluate", "aggregate")
REPORTS = ("s.json", "s/details.json", "s.scores.csv", "s.losses.csv")  # without timings: a rebuild's bytes


def stage(project: Path, name: str) -> subprocess.CompletedProcess:
    """``kedro run`` of stage ``name``, as DVC runs it."""
    from tests.projects import project_env

    runtime = [] if name in ("plan", "download") else ["--params", "study=s"]
    return subprocess.run([sys.executable, "-m", "kedro", "run", "--pipelines", name, *runtime], cwd=project,
                          env={**os.environ, **project_env(project), "TQDM_DISABLE": "1"}, capture_output=True,
                          text=True, timeout=600)


def one_line(done: subprocess.CompletedProcess, folder: Path) -> str:
    """The stage's one `Error:` line, which names ``folder`` (no traceback, exit status 1)."""
    output = done.stdout + done.stderr
    assert done.returncode == 1 and "Traceback" not in output, output[-3000:]
    [line] = [line for line in output.splitlines() if line.startswith("Error:")]
    assert str(folder) in line and " are free" in line, line
    return line


def cell_pages(folder: Path, but: str = "") -> int:
    return sum(pages(path.stat().st_size) for path in folder.rglob("*") if path.is_file() and path.name != but)


@pytest.mark.slow
def test_a_full_disk_at_each_place_a_build_writes_is_one_line_and_the_report_is_a_clean_builds(tmp_path, small_disk):
    """Issue 57: a full disk under the model gave two tracebacks (safetensors' own error), under the cache the right
    sentence inside Kedro's failure and a 25-line traceback. A tiny study is built stage by stage; before each stage,
    each folder it writes is a full disk (a tmpfs), the stage ends in one line naming it, and nothing half-written is
    left; the cells built before the disk filled are kept, and once there is room the build ends with the report of
    a clean build, byte for byte."""
    from tests.projects import make_project, run

    clean = make_project(tmp_path / "clean", STUDY)
    for name in STAGES:
        run(clean, name, **({} if name in ("plan", "download") else {"study": "s"}))
    project = make_project(tmp_path / "full", STUDY)
    data = project / "data"
    cells = clean / "data" / "04_models" / "s"
    full = 0  # a disk with no room left
    # per stage, each place it writes: (folder, what the disk holds first, bytes left free, the line's words)
    places = {
        "plan": [(data / "00_plan", None, full, f"no space left in {data}/00_plan")],
        "download": [(data / "01_raw", None, full, f"no space left in {data}/01_raw for sst2")],
        "prepare": [(data / "02_prepared", None, full, f"no space left in {data}/02_prepared/s for sst2")],
        "tokenize": [(data / "cache", None, full, f"no space left in {data}/cache/tokenized for "),
                     (data / "cache", "tokenized", PAGE, "Not enough disk space for the frozen-prefix cache in "
                                                         f"{data}/cache/frozen_prefix"),
                     (data / "03_features", None, full, f"no space left in {data}/03_features/s for ")],
        # the first cell fits; of the second, every file but its model (the largest: safetensors meets the disk)
        "train": [(data / "04_models", None, full,
                   f"no space left for cell sst2-tiny-0-1's folder in {data}/04_models/s"),
                  (data / "04_models", None, cell_pages(cells / "sst2-tiny-0-1") + cell_pages(
                      cells / "sst2-tiny-all-1", but="model.safetensors") + pages(
                      (cells / "sst2-tiny-all-1" / "model" / "model.safetensors").stat().st_size // 2),
                   f"no space left for cell sst2-tiny-all-1's folder in {data}/04_models/s")],
        "evaluate": [(data / "05_model_output", None, full,
                      f"no space left in {data}/05_model_output/s for scores.csv")],
        "aggregate": [(project / "reports", None, full, f"no space left in {project}/reports")],
    }
    for name in STAGES:
        for folder, holding, free, words in places[name]:
            disk = small_disk(folder, 4 * 2**20)
            if holding:  # the tokenized data there already: only the states are left to write
                shutil.copytree(clean / "data" / "cache" / holding, disk / holding)
            small_disk.fill(disk, free)
            line = one_line(stage(project, name), folder)
            assert words in line, line
            left = sorted(str(path.relative_to(disk)) for path in disk.rglob("*") if ".partial-" in path.name)
            assert left == [], left  # nothing half-written
            if "sst2-tiny-all-1" in words:  # the cell built before the disk filled is kept, whole
                from pipelines.trained_cells import proof_problem

                assert sorted(path.name for path in (disk / "s").iterdir()) == ["sst2-tiny-0-1"]
                assert proof_problem(disk / "s" / "sst2-tiny-0-1") is None
                shutil.copytree(disk / "s", tmp_path / "kept")
            small_disk.release(disk)
        if name == "train":  # room again: the next build trains only the rest
            shutil.copytree(tmp_path / "kept", data / "04_models" / "s")
            done = stage(project, name)
            assert done.returncode == 0 and "s: 1 of 2 cell(s) to train" in done.stdout + done.stderr, \
                (done.stdout + done.stderr)[-3000:]
        else:
            run(project, name, **({} if name in ("plan", "download") else {"study": "s"}))
    for report in REPORTS:
        assert (project / "reports" / report).read_bytes() == (clean / "reports" / report).read_bytes(), report
