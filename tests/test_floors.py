"""The library stands in floors: a module imports only modules of its own floor or of the floors below, and no two
import each other, however they import (at the top, inside a function, or for type checking alone). A newcomer reads
which file may use which from `FLOORS`; docs/pipeline.md draws them ("The house")."""

import ast
import sys
from pathlib import Path

import layertune

LIBRARY = Path(layertune.__file__).resolve().parent

# From the ground up. A package (corpora/, reports/) is one room; "__init__" is the package's face, which hands the
# public names on (loaded on first use) and imports nothing itself.
FLOORS = (
    ("ground", ("errors", "io", "timing", "distributed", "training_config", "host_memory", "testing")),
    ("data and tokens", ("corpus", "corpora", "metrics", "batching", "tokenization")),
    ("model parts and tuning methods", ("model_paths", "model_loading", "layer_stack", "tuning_methods")),
    ("the frozen-prefix cache", ("cache_costs", "frozen_prefix")),
    ("encoders", ("language_model", "multi_encoder", "encoder")),
    ("task models", ("model_specs", "initialization", "persistence", "heads", "drift")),
    ("the trainer", ("trainer",)),
    ("cells", ("specs", "cell", "cli")),
    ("studies", ("study", "statistics", "rounds", "probes")),
    ("reports", ("reports",)),
    ("the package's face", ("__init__",)),
)
FLOOR = {room: number for number, (_, rooms) in enumerate(FLOORS) for room in rooms}


def room_of(path: Path) -> str:
    """A file's room: its module's name in the package, or the subpackage that holds it."""
    parts = path.relative_to(LIBRARY).with_suffix("").parts
    return parts[0]


def imported_rooms(path: Path, source: str | None = None) -> set[str]:
    """The rooms of the library that the file at ``path`` (its text, or ``source``) imports, however it imports them
    (relative imports resolved)."""
    package = (LIBRARY.name, *path.relative_to(LIBRARY).parent.parts)
    rooms = set()
    for node in ast.walk(ast.parse(path.read_text() if source is None else source, filename=str(path))):
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = (*package[: len(package) - node.level + 1], *(node.module or "").split(".")) if node.level \
                else tuple((node.module or "").split("."))
            base = tuple(part for part in base if part)
            # `from layertune import cache_costs`: the names are modules
            modules = [".".join((*base, alias.name)) for alias in node.names] if base == (LIBRARY.name,) \
                else [".".join(base)]
        else:
            continue
        for module in modules:
            parts = module.split(".")
            if parts[0] == LIBRARY.name:
                rooms.add(parts[1] if len(parts) > 1 else "__init__")
    return rooms


def import_graph() -> dict[str, set[str]]:
    """Room → the other rooms it imports."""
    graph: dict[str, set[str]] = {}
    for path in sorted(LIBRARY.rglob("*.py")):
        room = room_of(path)
        graph.setdefault(room, set()).update(imported_rooms(path) - {room})
    return graph


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    return sorted(f"{room} (floor {FLOOR[room] + 1}) imports {other} (floor {FLOOR[other] + 1})"
                  for room, others in graph.items() for other in others if FLOOR[other] > FLOOR[room])


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every set of rooms that import one another round a loop (strongly connected, more than one room)."""
    index, low, stack, found, counter = {}, {}, [], [], [0]
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(graph)))

    def visit(room: str) -> None:
        index[room] = low[room] = counter[0]
        counter[0] += 1
        stack.append(room)
        for other in sorted(graph.get(room, ())):
            if other not in index:
                visit(other)
                low[room] = min(low[room], low[other])
            elif other in stack:
                low[room] = min(low[room], index[other])
        if low[room] == index[room]:
            members = []
            while not members or members[-1] != room:
                members.append(stack.pop())
            if len(members) > 1:
                found.append(sorted(members))

    for room in sorted(graph):
        if room not in index:
            visit(room)
    return found


def test_every_library_module_stands_on_a_floor():
    assert sorted(set(import_graph()) - set(FLOOR)) == [], "place the new module on one of FLOORS"
    assert sorted(set(FLOOR) - set(import_graph())) == [], "a room of FLOORS is gone: remove it there"


def test_no_module_imports_a_higher_floor():
    assert upward_imports(import_graph()) == []


def test_no_modules_import_each_other():
    assert circles(import_graph()) == []


def test_the_check_fails_on_an_upward_import_of_any_kind():
    """An import from below, at the top, for type checking alone or inside a function, is seen, and fails."""
    source = ("from typing import TYPE_CHECKING\nfrom . import io\n"
              "if TYPE_CHECKING:\n    from layertune.frozen_prefix import BoundaryStates\n"
              "def f():\n    from layertune.corpora.sources import fetch_dataset\n    from .heads import TaskModel\n")
    seen = imported_rooms(LIBRARY / "batching.py", source)
    assert seen == {"io", "frozen_prefix", "corpora", "heads"}
    graph = import_graph()
    assert upward_imports({**graph, "batching": seen}) == [
        "batching (floor 2) imports frozen_prefix (floor 4)", "batching (floor 2) imports heads (floor 6)"]
    assert circles({**graph, "specs": graph["specs"] | {"study"}}) == [["specs", "study"]]
