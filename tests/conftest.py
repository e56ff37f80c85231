import logging
import os
import sys
from pathlib import Path

# Before any Hugging Face import: their offline switches are read once, at import time.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("KEDRO_DISABLE_TELEMETRY", "1")
os.environ.setdefault("DO_NOT_TRACK", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from layertune.testing import TINY_CONFIGS, make_tiny_model  # noqa: E402

ARCHITECTURES = list(TINY_CONFIGS)


@pytest.fixture(autouse=True)
def logging_and_figures_as_they_were():
    """Each test leaves logging as it found it, and no figure open. A Kedro session run in-process applies
    conf/logging.yml, whose console handler binds the sys.stdout of that moment: pytest's capture of that test,
    closed when it ends. Kept on the root logger, it turned every later warning into a "--- Logging error ---"
    traceback. Pytest's own handlers come and go with each phase of a test and are left to it."""
    loggers = [logging.root] + [logger for logger in logging.Logger.manager.loggerDict.values()
                                if isinstance(logger, logging.Logger)]
    saved = [(logger, set(logger.handlers), logger.level, logger.propagate, logger.disabled) for logger in loggers]
    yield
    for logger, handlers, level, propagate, disabled in saved:
        for handler in logger.handlers[:]:
            if handler not in handlers and not type(handler).__module__.startswith("_pytest"):
                logger.removeHandler(handler)
        if logger.level != level:  # (setLevel clears every logger's cache: a few ms a test, with hundreds)
            logger.setLevel(level)
        logger.propagate, logger.disabled = propagate, disabled
    if "matplotlib.pyplot" in sys.modules:  # a report built in the test process: its figures are the test's
        sys.modules["matplotlib.pyplot"].close("all")


@pytest.fixture(scope="session")
def device() -> torch.device:
    """Where the library trains in these tests, as `ModelTrainer` decides: CUDA on a machine that has it (the GPU
    check, benchmarks/gpu_check.sh, runs this suite there), the CPU otherwise (CI). Tests compare on the model's
    device (`outputs`), never assuming the CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def device_of(module: torch.nn.Module) -> torch.device:
    return next(module.parameters()).device


def outputs(model: torch.nn.Module, batch: dict) -> torch.Tensor:
    """``model(batch)`` computed where the model is (training may have moved it to a GPU), returned on the CPU."""
    with torch.no_grad():
        return model({key: value.to(device_of(model)) for key, value in batch.items()}).cpu()


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory) -> dict[str, Path]:
    """One tiny random encoder per architecture, saved in Hugging Face layout."""
    root = tmp_path_factory.mktemp("tiny-models")
    return {arch: make_tiny_model(root / arch, arch) for arch in ARCHITECTURES}


@pytest.fixture(scope="session")
def tiny_bert(tiny_model_dirs) -> Path:
    return tiny_model_dirs["bert"]


@pytest.fixture(scope="session")
def data_mirror() -> Path:
    """The real-data mirror (../shared/data). In CI its absence is a failure, never a silent skip."""
    path = os.environ.get("LAYERTUNE_DATA_MIRROR")
    if not path or not Path(path).is_dir():
        if os.environ.get("CI"):
            pytest.fail(f"LAYERTUNE_DATA_MIRROR={path!r} is not a folder; .ci/run must point it at ../shared/data")
        pytest.skip("set LAYERTUNE_DATA_MIRROR=../shared/data to run tests on the real data")
    return Path(path)


@pytest.fixture(scope="session")
def minilm_l3(data_mirror) -> Path:
    """The real 3-layer paraphrase-MiniLM-L3-v2 encoder that ships beside the data mirror."""
    path = Path(os.environ.get("LAYERTUNE_MODEL_MIRROR", data_mirror.parent / "models")) / "paraphrase-MiniLM-L3-v2"
    if not path.is_dir():
        pytest.fail(f"real model folder {path} is missing")
    return path


def toy_sentiment_corpus(train_size: int = 64, dev_size: int = 32, regression: bool = False):
    """A small in-memory corpus whose label is readable from the last word, so a tiny model can learn it."""
    import random

    import datasets

    from layertune.corpus import Corpus

    rng = random.Random(0)
    filler = "the movie was a film plot story actor fun really quite so".split()

    def split(n: int) -> datasets.Dataset:
        rows = []
        for i in range(n):
            label = i % 2
            words = [rng.choice(filler) for _ in range(rng.randint(2, 10))]
            rows.append({"sentence": " ".join([*words, "great" if label else "awful"]),
                         "label": float(label) * 5 if regression else label})
        return datasets.Dataset.from_list(rows)

    if regression:
        return Corpus(name="toy-score", train=split(train_size), dev=split(dev_size), text_columns=("sentence",),
                      task_type="regression", metrics=("spearmanr", "pearsonr"), main_metric="spearmanr")
    return Corpus(name="toy", train=split(train_size), dev=split(dev_size), text_columns=("sentence",),
                  task_type="classification", metrics=("accuracy",), main_metric="accuracy",
                  label_names=("negative", "positive"))


@pytest.fixture
def toy_corpus():
    return toy_sentiment_corpus()


class SmallDisks:
    """``small_disks(folder, size, free=None)``: a tmpfs of ``size`` bytes mounted at ``folder`` (made if missing),
    with ``free`` bytes left free by a filler file (``.filler``, at its root) where given; ``release(folder)``
    unmounts it (what was written there goes with it), and every one left is unmounted after the test. A real full
    disk, which every writer meets as it would (safetensors', Arrow's and numpy's own errors included). Mounting needs
    root: CI runs as root, where its absence fails the test; elsewhere it is skipped, saying why."""

    def __init__(self) -> None:
        self.mounted: list[Path] = []

    def __call__(self, folder: Path, size: int, free: int | None = None) -> Path:
        import subprocess

        folder.mkdir(parents=True, exist_ok=True)
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
                              capture_output=True, text=True)
        if done.returncode:
            why = f"a small disk is a tmpfs mounted as root; mount said: {done.stderr.strip()}"
            pytest.fail(why) if os.environ.get("CI") else pytest.skip(why)
        self.mounted.append(folder)
        if free is not None:
            self.fill(folder, free)
        return folder

    @staticmethod
    def fill(folder: Path, free: int) -> None:
        """``folder``'s disk filled to leave ``free`` bytes (by ``.filler`` at its root)."""
        disk = os.statvfs(folder)
        with open(folder / ".filler", "ab") as filler:
            filler.write(bytes(max(disk.f_bavail * disk.f_frsize - free, 0)))

    def release(self, folder: Path) -> None:
        import subprocess

        subprocess.run(["umount", "--lazy", str(folder)], check=True)
        self.mounted.remove(folder)


@pytest.fixture
def small_disk():
    """`SmallDisks`, each unmounted after the test."""
    disks = SmallDisks()
    yield disks
    for folder in reversed(disks.mounted):
        disks.release(folder)


class FakeHub:
    """`huggingface_hub.hf_hub_download` served from ``root/<hub id>/<file>`` (tests/hub: the real config.json of
    the hub models that profiles name), recording each (hub id, file, revision) asked for."""

    def __init__(self, root: Path) -> None:
        self.root, self.asked = root, []

    def hf_hub_download(self, repo_id: str, filename: str, *, revision: str | None = None, **_) -> str:
        from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError

        self.asked.append((repo_id, filename, revision))
        if not (self.root / repo_id).is_dir():
            raise LocalEntryNotFoundError(f"fake hub: no model {repo_id!r}")
        if not (self.root / repo_id / filename).is_file():
            raise EntryNotFoundError(f"fake hub: {repo_id} has no {filename}")
        return str(self.root / repo_id / filename)


@pytest.fixture
def fake_hub(monkeypatch):
    """The hub, offline: model configs come from tests/hub (or the folder set as ``fake_hub.root``)."""
    import huggingface_hub

    from layertune import model_paths

    hub = FakeHub(Path(__file__).parent / "hub")
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", hub.hf_hub_download)
    model_paths._hub_config_files.cache_clear()  # what the real hub (or another fake) answered before
    yield hub
    model_paths._hub_config_files.cache_clear()


def pytest_configure(config):
    # Under pytest-xdist each worker gets one thread: two workers × two threads on two cores thrash. So do the
    # processes a test starts (a DVC build's stages, a worker pool, a Ray node), which read the variable.
    if os.environ.get("PYTEST_XDIST_WORKER"):
        import torch

        torch.set_num_threads(1)
        os.environ.setdefault("OMP_NUM_THREADS", "1")


UNGROUPED = pytest.StashKey[set]()


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """The ``xdist_group`` tests first, each group in its order: a group is one unit of minutes on one worker (the Ray
    cluster's, the scale tests'), and one handed out last keeps that worker busy while the other idles; the other
    tests follow in the order collected and fill both workers around the groups.

    Under ``--dist loadgroup`` each test marked ``xdist_group`` must carry its group in its node id (``…@group``):
    that is how pytest-xdist keeps a group on one worker. Where this no longer takes (pytest 9.2,
    pytest-xdist#1386) the Ray cluster tests would run on two workers at once, two clusters sharing this machine's
    node folders: those tests fail instead, saying why."""
    items.sort(key=lambda item: item.get_closest_marker("xdist_group") is None)  # stable: each group keeps its order
    if getattr(config.option, "loadgroup", False):
        config.stash[UNGROUPED] = {item.nodeid for item in items
                                   if item.get_closest_marker("xdist_group") and "@" not in item.nodeid}


def pytest_runtest_setup(item):
    if item.nodeid in item.config.stash.get(UNGROUPED, set()):
        pytest.fail(f"--dist loadgroup did not keep this test's xdist_group on one worker: pytest {pytest.__version__}"
                    " and this pytest-xdist do not work together (pytest-xdist#1386); install the versions "
                    "pyproject.toml's test extra allows", pytrace=False)
