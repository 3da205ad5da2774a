"""The import graph of the package has no cycles, module by module."""

from __future__ import annotations

import ast
from pathlib import Path

import shardvar

PACKAGE = Path(shardvar.__file__).parent


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _resolve(path: Path, node: ast.ImportFrom) -> list[str]:
    package = _module_name(path) if path.name == "__init__.py" else _module_name(path).rpartition(".")[0]
    base = package.split(".")
    if node.level > 1:
        base = base[: len(base) - node.level + 1]
    prefix = ".".join(base + ([node.module] if node.module else []))
    # `from . import _x` imports a module; `from .m import name` imports m.
    return [f"{prefix}.{a.name}" for a in node.names] if not node.module else [prefix]


def _graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.ImportFrom) and node.level:
                targets = _resolve(path, node)
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("shardvar"):
                targets = [node.module]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names if a.name.startswith("shardvar")]
            graph[name] |= {t for t in targets if t in modules and t != name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    found, state, stack = [], {}, []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                found.append([*stack[stack.index(nxt) :], nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
    return found


def test_no_import_cycles() -> None:
    graph = _graph()
    assert len(graph) > 30  # the walk found the package
    assert _cycles(graph) == []


def test_the_cycle_finder_finds_cycles() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_workloads_import_without_the_command_line() -> None:
    # benchmarks/ and examples/ stand on shardvar.workloads; the command line stands on it, not under it.
    import subprocess
    import sys

    code = "import sys, shardvar.workloads; print(sorted(m for m in sys.modules if m.startswith('shardvar.cli')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# Modules that may re-point a tensor at other memory (``Tensor.set_``): the memory module and the
# in-place relayout (shards into slabs), and the recycler (its own buffers, never a shard).
MEMORY_MODULES = {"variables/_memory.py", "variables/_relayout.py", "_recycle.py"}


def _calls(attr: str) -> list[str]:
    found = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == attr:
                found.append(f"{path.relative_to(PACKAGE).as_posix()}:{node.lineno}")
    return found


def test_only_the_memory_modules_repoint_tensors() -> None:
    """Slab memory has one owner: no other module moves a shard's memory with ``set_``."""
    calls = _calls("set_")
    assert calls  # the walk finds them
    assert sorted(c for c in calls if c.rpartition(":")[0] not in MEMORY_MODULES) == []


def _store_assignments(source: str) -> list[int]:
    """Lines that assign an attribute of a store (``x.store.a = ...``, ``store.a = ...``, ``x._store.a += ...``)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Assign | ast.AugAssign | ast.AnnAssign):
            continue
        for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
            owner = t.value if isinstance(t, ast.Attribute) else None
            named = isinstance(owner, ast.Name) and owner.id in ("store", "_store")
            if named or (isinstance(owner, ast.Attribute) and owner.attr in ("store", "_store")):
                found.append(node.lineno)
    return found


def test_no_layer_assigns_attributes_onto_a_store() -> None:
    """What the layers above add to a store is attached through ``ShardStore.attach`` (typed hooks declared
    in the variables layer), never assigned onto it."""
    outside = [p for p in PACKAGE.rglob("*.py") if p.relative_to(PACKAGE).parts[0] != "variables"]
    assert len(outside) > 30
    found = [f"{p.relative_to(PACKAGE)}:{n}" for p in outside for n in _store_assignments(p.read_text())]
    assert found == []


def test_the_assignment_finder_finds_assignments() -> None:
    source = "table.store.sink = f\nself._store.exchange = e\nstore.x += 1\nstore = s\nx.store = s\ny.a.b = 1\n"
    assert _store_assignments(source) == [1, 2, 3]
