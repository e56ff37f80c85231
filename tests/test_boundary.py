"""The library and the pipeline are two rooms: `layertune` (src/layertune) imports nothing of Kedro, DVC, MLflow or
the pipeline package, so it is usable, and testable, without any of them."""

import ast
import subprocess
import sys
from pathlib import Path

import layertune

LIBRARY = Path(layertune.__file__).resolve().parent
ORCHESTRATION = ("kedro", "dvc", "mlflow", "pipelines", "ray")


def imported_modules(path: Path) -> set[str]:
    """Every module a file imports, at the top or inside a function."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


def test_no_library_module_imports_the_orchestration():
    offending = {str(path.relative_to(LIBRARY)): sorted(name for name in imported_modules(path)
                                                        if name.split(".")[0] in ORCHESTRATION)
                 for path in sorted(LIBRARY.rglob("*.py"))}
    assert {path: names for path, names in offending.items() if names} == {}


def test_importing_every_library_module_loads_no_orchestration_package():
    modules = sorted(".".join(path.relative_to(LIBRARY.parent).with_suffix("").parts).removesuffix(".__init__")
                     for path in LIBRARY.rglob("*.py"))
    code = ("import importlib, sys\n"
            f"for name in {modules!r}: importlib.import_module(name)\n"
            f"print(sorted(m for m in sys.modules if m.split('.')[0] in {ORCHESTRATION!r}))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert loaded == "[]"


def test_the_check_sees_an_import_inside_a_function(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from mlflow import log_metric\n")
    assert "mlflow" in imported_modules(module)
