"""Which source files a pipeline stage runs, so that its DVC dependencies are exact and cannot drift
(docs/pipeline.md, "Dependencies that cannot drift"). Imports are followed inside functions too (layertune imports
torch-heavy modules lazily); imports by a computed name (``importlib.import_module(name)``) are invisible, so the
project's own code imports its modules by name only (``layertune/__init__.py``'s lazy exports serve users)."""

from __future__ import annotations

import ast
import functools
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


def _imported_names(path: Path, module: str, classes: frozenset[str] | None = None) -> frozenset[str]:
    """Every module name ``path`` imports (``from a import b``: a and a.b, b may be a submodule); with ``classes``,
    not those of the file's other classes (a stage using only ``classes`` does not run them)."""
    return _imports_in(path.read_text(), module if path.name == "__init__.py" else module.rpartition(".")[0],
                       classes)


@functools.lru_cache(maxsize=None)  # by the source itself: every stage's closure walks the same shared files
def _imports_in(source: str, package: str, classes: frozenset[str] | None) -> frozenset[str]:
    names = set()
    tree = ast.parse(source)
    if classes is not None:
        tree.body = [node for node in tree.body if not isinstance(node, ast.ClassDef) or node.name in classes]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from . import x, from ..a import b
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}".rstrip(".")
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return frozenset(names)


def import_closure(roots: Iterable[Path], packages: Mapping[str, Path],
                   classes: Mapping[Path, frozenset[str]] | None = None) -> list[Path]:
    """``roots`` and every file of ``packages`` they import, directly or not, with each package's ``__init__.py``
    on the way (importing ``a.b.c`` runs ``a/__init__.py`` and ``a/b/__init__.py``); in a file of ``classes``, only
    the imports of those of its classes (and of the rest of the file) are followed."""
    folders = {folder.resolve(): top for top, folder in packages.items()}
    only = {Path(path).resolve(): names for path, names in (classes or {}).items()}
    files: dict[str, Path | None] = {}  # module name → its resolved file: files import the same modules over and over

    def resolved_file(name: str) -> Path | None:
        if name not in files:
            found = module_file(name, packages)
            files[name] = None if found is None else found.resolve()
        return files[name]

    queue, seen = [Path(root).resolve() for root in roots], set()
    while queue:
        path = queue.pop()
        if path in seen:
            continue
        seen.add(path)
        for name in _imported_names(path, _module_name(path, folders), only.get(path)):
            parts = name.split(".")
            queue.extend(found for depth in range(1, len(parts) + 1)
                         if (found := resolved_file(".".join(parts[:depth]))) is not None)
    return sorted(seen)


def _module_name(path: Path, folders: Mapping[Path, str]) -> str:
    for folder, top in folders.items():
        if path.is_relative_to(folder):
            parts = [top, *path.relative_to(folder).with_suffix("").parts]
            return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
    return path.stem


def code_digest(path: Path) -> str:
    """The sha256 of a Python file's code without comments, docstrings or layout (`ast.unparse`), so that editing
    them changes no fingerprint; of any other file's bytes. (Another Python version may unparse a file otherwise: a
    build moved to it reruns, as for an edit.)"""
    if path.suffix != ".py":
        return hashlib.sha256(path.read_bytes()).hexdigest()
    return _source_digest(path.read_text())


@functools.lru_cache(maxsize=None)  # by the source itself: the plan asks for a file once per stage that runs it
def _source_digest(source: str) -> str:
    tree = ast.parse(source)
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body \
                and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                and isinstance(body[0].value.value, str):
            node.body = body[1:] or [ast.Pass()]
    return hashlib.sha256(ast.unparse(tree).encode()).hexdigest()


def code_fingerprint(roots: Iterable[Path], packages: Mapping[str, Path]) -> str:
    """One digest of ``roots`` (files of ``packages``) and every file of ``packages`` they import, directly or not
    (`import_closure`), each read as code (`code_digest`: a comment or docstring edited changes nothing) and named
    from its package (``layertune/heads.py``) wherever the package is installed."""
    named = fingerprint(import_closure(roots, packages), packages, root=Path.cwd())
    return hashlib.sha256("".join(f"{name}\0{digest}\n" for name, digest in named.items()).encode()).hexdigest()[:32]


def fingerprint(files: Iterable[Path], packages: Mapping[str, Path], root: Path) -> dict[str, str]:
    """``{name: code_digest}``, sorted; a package file is named from its package (``layertune/heads.py``) wherever
    the package is installed, any other file relative to ``root``."""
    names = {}
    for file in files:
        file = Path(file).resolve()
        owner = next((folder.resolve() for folder in packages.values() if file.is_relative_to(folder.resolve())), None)
        name = file.relative_to(owner.parent) if owner else file.relative_to(root.resolve())
        names[str(name)] = code_digest(file)
    return dict(sorted(names.items()))


def stage_fingerprint(stage_folder: Path, followed: Iterable[Path], hashed: Iterable[Path],
                      packages: Mapping[str, Path], root: Path,
                      classes: Mapping[Path, frozenset[str]] | None = None) -> dict[str, str]:
    """The fingerprint of one stage: the Python files of its folder and ``followed`` ones (hooks, settings, the
    datasets module), with everything of ``packages`` they import (of a file of ``classes``, what the stage's
    classes import: `import_closure`); and ``hashed`` files as they are (configuration)."""
    roots = [*sorted(Path(stage_folder).rglob("*.py")), *followed]
    return fingerprint([*import_closure(roots, packages, classes), *hashed], packages, root)
