"""The layout as the architecture: which way the rooms depend, and no import cycles.

Pure Python: the source is parsed, nothing is imported. Every import counts, function-local
ones too (they hide a dependency, they do not remove it); imports only for type checking do
not. docs/design.md draws the rooms.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "rewind"

# Rooms and the rooms they must never import: dependencies point one way.
NEVER = {
    "rewind.store": ("rewind.engine", "rewind.guard", "rewind.serve", "rewind.sandbox", "rewind.cli",
                     "rewind.fleet", "rewind.bench"),
    "rewind.engine": ("rewind.guard", "rewind.serve", "rewind.sandbox", "rewind.cli", "rewind.fleet",
                      "rewind.bench"),
    "rewind.guard": ("rewind.serve", "rewind.sandbox", "rewind.cli", "rewind.fleet", "rewind.bench"),
    "rewind.guest": ("rewind.engine", "rewind.store", "rewind.guard", "rewind.serve", "rewind.sandbox",
                     "rewind.cli"),
    # The engine's parts, below the machines and their history:
    **dict.fromkeys(("rewind.engine.process", "rewind.engine.memory", "rewind.engine.disk",
                     "rewind.engine.network"),
                    ("rewind.engine.engine", "rewind.engine.machine", "rewind.engine.timeline",
                     "rewind.engine.handoff", "rewind.engine.points", "rewind.engine.pending",
                     "rewind.engine.checkpoint", "rewind.engine.changes", "rewind.guard", "rewind.serve")),
    # The ground floor the faces share (the guard's verdicts, a leaf, travel in its Refused).
    "rewind.results": ("rewind.engine", "rewind.store", "rewind.guard.classify", "rewind.serve",
                       "rewind.sandbox"),
}

def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _imported(module: str, path: Path, known: dict[str, Path]) -> Iterator[str]:
    tree = ast.parse(path.read_text())
    typing_only = {id(node) for block in ast.walk(tree)
                   if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test)
                   for node in ast.walk(block)}
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # from . import x: relative to the module's package
                parts = package.split(".")
                base = ".".join([*parts[:len(parts) - node.level + 1], base]).strip(".")
            names = [base, *(f"{base}.{alias.name}" for alias in node.names)]
        else:
            continue
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name and name != module:
                yield name


def _graph() -> dict[str, set[str]]:
    known = _modules()
    return {module: set(_imported(module, path, known)) for module, path in known.items()}


def _cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected parts of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = set()
            while True:
                w = stack.pop()
                part.add(w)
                if w == v:
                    break
            if len(part) > 1:
                found.append(part)

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles() -> None:
    assert _cycles(_graph()) == []


def test_the_rooms_depend_one_way() -> None:
    wrong = [f"{module} imports {target}" for module, targets in _graph().items() for target in targets
             for room, banned in NEVER.items()
             if (module == room or module.startswith(room + ".")) and target.startswith(banned)]
    assert wrong == []


def test_the_walk_sees_a_cycle_and_a_function_local_import(tmp_path: Path) -> None:
    """The checks above can fail: a cycle closed inside a function is found."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [{"a", "b", "c"}]
    (tmp_path / "m.py").write_text("def f():\n    from rewind.store import store\n")
    assert set(_imported("rewind.x", tmp_path / "m.py", _modules())) == {"rewind.store", "rewind.store.store"}
