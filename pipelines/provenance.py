"""Which source files a pipeline stage runs, so that its DVC dependencies are exact and cannot drift.

`import_closure` follows every ``import`` of the given files into the project's own packages, at module level and
inside functions (layertune imports torch-heavy modules lazily), transitively. `fingerprint` hashes what it found.
The plan stage writes one fingerprint per stage; each stage depends on its own, so editing a report's code reruns
the reports and no training, and editing the trainer reruns every cell.

Imports by a computed name (``importlib.import_module(name)``) are invisible to this, so the project's own code
imports its modules by name only (``layertune/__init__.py``'s lazy exports serve users, not the package itself).
"""

from __future__ import annotations

import ast
import hashlib
from collections.abc import Iterable, Mapping
from pathlib import Path


def module_file(name: str, packages: Mapping[str, Path]) -> Path | None:
    """The source file of module ``name`` if it belongs to one of ``packages`` ({top-level name: folder})."""
    top, _, rest = name.partition(".")
    if top not in packages:
        return None
    base = packages[top].joinpath(*rest.split(".")) if rest else packages[top]
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _imported_names(path: Path, module: str) -> set[str]:
    """Every module name ``path`` imports; ``from a import b`` counts a and a.b (b may be a submodule)."""
    names = set()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from . import x, from ..a import b
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}".rstrip(".")
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def import_closure(roots: Iterable[Path], packages: Mapping[str, Path]) -> list[Path]:
    """``roots`` and every file of ``packages`` they import, directly or not, with each package's ``__init__.py``
    on the way (importing ``a.b.c`` runs ``a/__init__.py`` and ``a/b/__init__.py``)."""
    folders = {folder.resolve(): top for top, folder in packages.items()}
    queue, seen = [Path(root).resolve() for root in roots], set()
    while queue:
        path = queue.pop()
        if path in seen:
            continue
        seen.add(path)
        for name in _imported_names(path, _module_name(path, folders)):
            parts = name.split(".")
            for depth in range(1, len(parts) + 1):
                found = module_file(".".join(parts[:depth]), packages)
                if found is not None:
                    queue.append(found.resolve())
    return sorted(seen)


def _module_name(path: Path, folders: Mapping[Path, str]) -> str:
    for folder, top in folders.items():
        if path.is_relative_to(folder):
            parts = [top, *path.relative_to(folder).with_suffix("").parts]
            return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
    return path.stem


def fingerprint(files: Iterable[Path], packages: Mapping[str, Path], root: Path) -> dict[str, str]:
    """``{name: sha256 of the file's bytes}``, sorted; a package file is named from its package
    (``layertune/heads.py``) wherever the package is installed, any other file relative to ``root``."""
    names = {}
    for file in files:
        file = Path(file).resolve()
        owner = next((folder.resolve() for folder in packages.values() if file.is_relative_to(folder.resolve())), None)
        name = file.relative_to(owner.parent) if owner else file.relative_to(root.resolve())
        names[str(name)] = hashlib.sha256(file.read_bytes()).hexdigest()
    return dict(sorted(names.items()))


def stage_fingerprint(stage_folder: Path, followed: Iterable[Path], hashed: Iterable[Path],
                      packages: Mapping[str, Path], root: Path) -> dict[str, str]:
    """The fingerprint of one stage: the Python files of its folder and ``followed`` ones (hooks, datasets,
    settings), with everything of ``packages`` they import; and ``hashed`` files as they are (configuration)."""
    roots = [*sorted(Path(stage_folder).rglob("*.py")), *followed]
    return fingerprint([*import_closure(roots, packages), *hashed], packages, root)
