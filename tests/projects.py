"""Tiny study projects for tests: this repository's pipelines and conf, a toy data mirror in the official layouts,
tiny random models, and a way to run a stage through Kedro as `kedro run` does."""

import contextlib
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import yaml

from layertune.testing import make_tiny_model

ROOT = Path(__file__).resolve().parents[1]
TOY_SENTENCES = ["the movie was great", "a good film", "best story ever", "i love this plot",
                 "the movie was awful", "a bad film", "worst story ever", "i hate this plot"]


def write_toy_mirror(root: Path) -> Path:
    """glue/SST-2 and ner/conll2003 in their official layouts, a few dozen lines each."""
    sst2 = root / "glue" / "SST-2"
    sst2.mkdir(parents=True)
    for split, repeats in (("train", 6), ("dev", 3)):
        rows = [f"{s} {'really ' * (i % 3)}\t{int(j < 4)}" for i in range(repeats) for j, s in enumerate(TOY_SENTENCES)]
        (sst2 / f"{split}.tsv").write_text("sentence\tlabel\n" + "\n".join(rows) + "\n")
    conll = root / "ner" / "conll2003"
    conll.mkdir(parents=True)
    sentence = ["EU NNP B-NP I-ORG", "rejects VBZ B-VP O", "German JJ B-NP I-MISC", "call NN I-NP O",
                "by IN B-PP O", "Peter NNP B-NP I-PER", "in IN B-PP O", "Paris NNP B-NP I-LOC"]
    for split, repeats in (("train", 12), ("dev", 6), ("test", 5)):
        (conll / f"{split}.txt").write_text("-DOCSTART- -X- -X- O\n\n" + "\n\n".join(
            "\n".join(sentence[i % 3 :] + sentence[: i % 3]) for i in range(repeats)) + "\n")
    return root


def study(kind: str, tasks: list, encoders: dict, layers: list, seeds: list, **extra) -> dict:
    return {"report": {"kind": kind, "resamples": 200, "examples": 2}, "tasks": tasks, "encoders": encoders,
            "tunable_layers": layers, "seeds": seeds, "data": {"seed": 1},
            # float32 on every machine: what these projects' tests expect (a round's outcome) must not depend on
            # whether the CPU computes bfloat16 natively (mixed_precision auto)
            "training": {"learning_rate": 1.0e-3, "batch_size": 8, "epochs": 2, "max_length": 32,
                         "mixed_precision": "no"}, **extra}


def make_project(folder: Path, params: dict) -> Path:
    """A project folder with this repository's pipelines and conf, ``params``, the toy mirror and tiny models
    ``models/tiny-a`` and ``models/tiny-b`` (another vocabulary)."""
    for name in ("pipelines", "conf"):
        shutil.copytree(ROOT / name, folder / name)
    for name in ("pyproject.toml", ".telemetry"):
        shutil.copy(ROOT / name, folder)
    (folder / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    (folder / "rounds.yaml").write_text("decided: {}\n")  # no decided study has rounds yet
    write_toy_mirror(folder / "mirror")
    make_tiny_model(folder / "models" / "tiny-a", "bert", seed=0)
    make_tiny_model(folder / "models" / "tiny-b", "bert", seed=1, extra_words=("really", "peter", "paris"))
    return folder


def project_env(project: Path) -> dict:
    return {"MLFLOW_TRACKING_URI": f"sqlite:///{project / 'mlflow.db'}", "LAYERTUNE_DATA_MIRROR": "",
            "TQDM_DISABLE": "1", "PYTHONPATH": str(ROOT / "src")}


@contextlib.contextmanager
def inside(project: Path):
    """Working folder and environment of a stage of ``project``, restored afterwards."""
    previous_dir, previous_env = Path.cwd(), dict(os.environ)
    os.chdir(project)
    os.environ.update(project_env(project))
    try:
        from kedro.framework.startup import bootstrap_project

        bootstrap_project(project)
        yield
    finally:
        os.chdir(previous_dir)
        os.environ.clear()
        os.environ.update(previous_env)


def run(project: Path, pipeline: str, **runtime) -> None:
    """One stage through a Kedro session, as `kedro run --pipelines <pipeline> --params ...` runs it."""
    from kedro.framework.session import KedroSession

    with inside(project), KedroSession.create(project_path=project, runtime_params=runtime) as session:
        session.run(pipeline_names=[pipeline])


def make_dvc_project(folder: Path, params: dict) -> Path:
    """`make_project` with this repository's dvc.yaml, as a git repository with DVC set up and everything committed
    (clones of it are the machines of a team)."""
    import subprocess

    make_project(folder, params)
    shutil.copytree(ROOT / "src" / "layertune", folder / "src" / "layertune",
                    ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("dvc.yaml", ".dvcignore", ".gitignore"):
        shutil.copy(ROOT / name, folder / name)
    for command in (["git", "init", "--quiet"], ["dvc", "init", "--quiet"]):
        subprocess.run(command, cwd=folder, check=True, capture_output=True)
    shutil.copy(ROOT / ".dvc" / "config", folder / ".dvc" / "config")  # this repository's settings and remote
    shutil.copytree(ROOT / ".dvc" / "plots", folder / ".dvc" / "plots")  # the templates of dvc.yaml's plots
    for command in (["git", "add", "-A"], ["git", "-c", "user.name=test", "-c", "user.email=test@example.com",
                                           "commit", "--quiet", "-m", "tiny studies"]):
        subprocess.run(command, cwd=folder, check=True, capture_output=True)
    return folder


def built_once(tmp_path_factory, name: str, build: Callable[[Path], object]) -> Path:
    """Folder ``name``, made by ``build(folder)`` once per test run, however many pytest-xdist workers ask for it:
    the first builds it under a file lock in the run's shared temporary folder (pytest's own, private to this user),
    the others wait and get the same folder. For what tests only read (a built project they clone or copy); a
    build that fails is tried again by the next worker that asks, and fails there too."""
    from filelock import FileLock

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # each worker's base is below the run's
    folder, done = root / f"built-once-{name}", root / f"built-once-{name}.done"
    with FileLock(root / f"built-once-{name}.lock"):
        if not done.is_file():
            shutil.rmtree(folder, ignore_errors=True)  # a build that failed half-way
            folder.mkdir()
            build(folder)
            done.touch()
    return folder
