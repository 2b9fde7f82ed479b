"""The package's import structure (docs/architecture.md): every module imports only its own room
and the rooms below it, no two modules import each other through any path, and no source file
holds more than one idea's worth of lines. Read from the source with `ast`, so imports inside
functions and under TYPE_CHECKING count as much as those at the top."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

import diloco

SRC = Path(diloco.__file__).parent

# Bottom to top; the longest matching prefix names a module's room.
LAYERS = [
    ("base", ("diloco.errors", "diloco.settings", "diloco._before_torch")),
    ("core", ("diloco.core",)),
    ("config", ("diloco.config",)),
    ("data", ("diloco.data",)),
    ("model", ("diloco.model",)),
    ("rundir", ("diloco.rundir",)),
    ("runtime", ("diloco.runtime",)),  # runtime.server sits inside it and may import runtime.*
    ("run", ("diloco.run",)),
    ("cli", ("diloco.cli",)),
    ("top", ("diloco", "diloco.__main__")),
]
MAX_LINES = 400
GENERATED = ("_pb2.py", "_pb2_grpc.py")


def _modules() -> dict[str, Path]:
    mods = {}
    for path in sorted(SRC.rglob("*.py")):
        if path.name.endswith(GENERATED):
            continue
        parts = path.relative_to(SRC.parent).with_suffix("").parts
        mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return mods


def _imports(mods: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the diloco modules it imports (a package's own __init__ excluded)."""
    edges: dict[str, set[str]] = defaultdict(set)
    for mod, path in mods.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                names = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            for name in names:
                while name and name not in mods:
                    name = name.rpartition(".")[0]
                if name.startswith("diloco") and name != mod and not mod.startswith(name + "."):
                    edges[mod].add(name)
    return edges


def layer(mod: str) -> int:
    """The index in LAYERS of `mod`'s room: the longest prefix that names it (`diloco` itself
    only by name, so a new top-level module must be given a room)."""
    best = None
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if mod == p or (p != "diloco" and mod.startswith(p + ".")):
                if best is None or len(p) > best[0]:
                    best = (len(p), i)
    assert best is not None, f"{mod} is in no room: add it to LAYERS and docs/architecture.md"
    return best[1]


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while (w := stack.pop()) != v:
                component.append(w)
            if component:
                found.append(sorted([v, *component]))

    for v in list(edges):
        if v not in index:
            visit(v)
    return found


@pytest.mark.timeout(30)
def test_imports_point_down_only():
    edges = _imports(_modules())
    upward = [
        f"{m} ({LAYERS[layer(m)][0]}) imports {t} ({LAYERS[layer(t)][0]})"
        for m, targets in sorted(edges.items())
        for t in sorted(targets)
        if layer(t) > layer(m)
    ]
    assert not upward, "imports that climb a room (docs/architecture.md):\n" + "\n".join(upward)


@pytest.mark.timeout(30)
def test_no_import_circles():
    circles = _cycles(_imports(_modules()))
    assert not circles, "modules that import each other: " + "; ".join(" <-> ".join(c) for c in circles)


@pytest.mark.timeout(30)
def test_the_checker_sees_a_climb_and_a_circle():
    """The two checks above would fail on a tree that had these (so they cannot pass vacuously)."""
    assert layer("diloco.core.codec") < layer("diloco.config") < layer("diloco.run.assemble")
    assert layer("diloco.runtime.server.service") == layer("diloco.runtime.sim")
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    edges = _imports(_modules())
    assert "diloco.core.outer_side" in edges["diloco.run.assemble"]  # the walk sees real imports


@pytest.mark.timeout(30)
def test_no_source_file_holds_more_than_one_idea():
    long = {
        str(p.relative_to(SRC)): n
        for p in _modules().values()
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"files over {MAX_LINES} lines (split them by idea): {long}"
