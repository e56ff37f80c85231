"""Stage code fingerprints: each stage depends on exactly the source it runs (dvc.yaml's deps cannot drift)."""

import ast
import shutil
from pathlib import Path

import layertune
from pipelines.provenance import import_closure, stage_fingerprint
from pipelines.plan.nodes import FOLLOWED, HASHED, PROJECT, code_fingerprints

ROOT = Path(__file__).resolve().parents[1]


def test_closure_follows_imports_inside_functions(tmp_path):
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("")
    (package / "a.py").write_text("def f():\n    from pkg.sub import b\n")
    (package / "sub" / "b.py").write_text("from . import c\nimport json\n")
    (package / "sub" / "c.py").write_text("")
    (package / "unused.py").write_text("")
    found = {p.relative_to(tmp_path).as_posix() for p in import_closure([package / "a.py"], {"pkg": package})}
    assert found == {"pkg/__init__.py", "pkg/a.py", "pkg/sub/__init__.py", "pkg/sub/b.py", "pkg/sub/c.py"}


def test_training_runs_the_trainer_and_no_report_code():
    fingerprints = code_fingerprints()
    train, aggregate = set(fingerprints["train"]), set(fingerprints["aggregate"])
    assert {"layertune/trainer.py", "layertune/cell.py", "layertune/frozen_prefix.py", "pipelines/hooks.py",
            "pipelines/tracking.py", "conf/base/catalog.yml"} <= train  # trainer: imported inside train_cell
    assert not {name for name in train if name.startswith(("layertune/reports/", "pipelines/aggregate/"))}
    assert {"layertune/reports/layers.py", "layertune/reports/ner.py", "layertune/reports/encoders.py",
            "layertune/statistics.py"} <= aggregate
    assert not {name for name in fingerprints["prepare"] if name.startswith("layertune/reports/")}


def test_the_log_configuration_is_in_no_stage_fingerprint():
    # log levels change no output: editing conf/logging.yml must rerun no stage of a build
    assert all("conf/logging.yml" not in files for files in code_fingerprints().values())
    assert all("conf/base/catalog.yml" in files for files in code_fingerprints().values())


def test_editing_a_report_changes_only_the_aggregate_fingerprint(tmp_path):
    project = tmp_path / "project"
    shutil.copytree(ROOT / "pipelines", project / "pipelines")
    shutil.copytree(ROOT / "conf", project / "conf")
    library = project / "layertune"
    shutil.copytree(Path(layertune.__file__).parent, library)
    packages = {"layertune": library, "pipelines": project / "pipelines"}

    def fingerprint(stage):
        return stage_fingerprint(project / "pipelines" / stage, [project / f for f in FOLLOWED],
                                 [project / f for f in HASHED], packages, project)

    before = {stage: fingerprint(stage) for stage in ("train", "aggregate")}
    with open(library / "reports" / "layers.py", "a") as source:
        source.write("\nEDITED = 1\n")
    assert fingerprint("train") == before["train"] and fingerprint("aggregate") != before["aggregate"]
    with open(library / "trainer.py", "a") as source:
        source.write("\nEDITED = 1\n")
    assert fingerprint("train") != before["train"]


def copied_project(tmp_path, monkeypatch) -> tuple[Path, Path]:
    """This repository's pipelines, conf and library copied, and the plan stage pointed at the copy."""
    from pipelines.plan import nodes

    project, library = tmp_path / "project", tmp_path / "project" / "src" / "layertune"
    shutil.copytree(ROOT / "pipelines", project / "pipelines", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(ROOT / "conf", project / "conf")
    shutil.copytree(Path(layertune.__file__).parent, library, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(nodes, "PROJECT", project)
    monkeypatch.setattr(nodes, "LIBRARY", library)
    return project, library


def test_editing_a_module_a_stage_does_not_run_reruns_no_stage(tmp_path, monkeypatch):
    """The datasets module is followed into what a stage's own datasets import: the cells' folders
    (pipelines/trained_cells.py) are read by train, evaluate and aggregate alone (it reran every stage: 3-5.5
    minutes, nothing changed)."""
    project, _ = copied_project(tmp_path, monkeypatch)
    before = code_fingerprints()
    with open(project / "pipelines" / "trained_cells.py", "a") as source:
        source.write("\nEDITED = 1\n")
    after = code_fingerprints()
    assert sorted(stage for stage in before if after[stage] != before[stage]) == ["aggregate", "evaluate", "train"]


def test_a_comment_or_docstring_edit_changes_no_fingerprint_and_retrains_no_cell(tmp_path, monkeypatch):
    """Fingerprints read code as code (`pipelines.provenance.code_digest`): a comment or a docstring edited in the
    trainer (it retrained every cell of a study: 131 s for 10 tiny cells) changes neither a cell's build key nor a
    stage's fingerprint; an edit of its code changes both."""
    from pipelines.plan import nodes

    _, library = copied_project(tmp_path, monkeypatch)
    before = (nodes.cell_code_fingerprint(), code_fingerprints()["train"])
    trainer = library / "trainer.py"
    source = trainer.read_text()
    docstring = source.index('"""', source.index("class ModelTrainer")) + 3
    trainer.write_text(source[:docstring] + "Edited, in prose. " + source[docstring:] + "\n# and a comment\n")
    assert (nodes.cell_code_fingerprint(), code_fingerprints()["train"]) == before
    trainer.write_text(trainer.read_text() + "EDITED = 1\n")
    after = (nodes.cell_code_fingerprint(), code_fingerprints()["train"])
    assert after[0] != before[0] and after[1] != before[1]


def test_a_cells_build_key_follows_the_code_that_trains_it_and_no_other(monkeypatch, tmp_path):
    """The library code a cell's training runs is part of its build key: editing the trainer retrains every cell,
    editing a report or the pipeline's scheduling none (the train stage reruns, and finds every cell built)."""
    from pipelines.plan import nodes

    library = tmp_path / "layertune"
    shutil.copytree(Path(layertune.__file__).parent, library)
    monkeypatch.setattr(nodes, "LIBRARY", library)
    before = nodes.cell_code_fingerprint()
    for edited in (library / "reports" / "layers.py", library / "statistics.py"):
        with open(edited, "a") as source:
            source.write("\nEDITED = 1\n")
    assert nodes.cell_code_fingerprint() == before
    with open(library / "trainer.py", "a") as source:
        source.write("\nEDITED = 1\n")
    assert nodes.cell_code_fingerprint() != before


def test_the_package_imports_its_modules_by_name():
    """The closure cannot see a name taken from the lazy exports of layertune/__init__.py, so the project's own
    code imports layertune.<module>, never ``from layertune import <Class>``."""
    modules = {p.stem for p in Path(layertune.__file__).parent.iterdir()}
    offenders = []
    for path in [*Path(layertune.__file__).parent.rglob("*.py"), *(PROJECT / "pipelines").rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "layertune":
                offenders += [f"{path.name}: {a.name}" for a in node.names if a.name not in modules]
    assert offenders == []
