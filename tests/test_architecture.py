"""The package's architecture: no import cycles, one owner of slab memory, hooks attached not assigned,
twins by composition (no chain of Module subclasses more than three deep), and one lookup implementation."""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
import re
from pathlib import Path

import pytest
import torch

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


# Twins by composition (issue 35, point 5): a distributed or quantized module is its local module plus
# what differs (a placement attached to its store, packed rows), composed from mixins that are not
# Modules, never a deep chain of Module subclasses.
MAX_MODULE_DEPTH = 3


def _module_depth(cls: type) -> int:
    """The longest chain of shardvar ``nn.Module`` subclasses from ``cls`` (itself counted) up to torch's."""
    if not (issubclass(cls, torch.nn.Module) and (cls.__module__ or "").startswith("shardvar")):
        return 0  # torch's modules, and mixins that are not Modules, are no level
    return 1 + max((_module_depth(base) for base in cls.__bases__), default=0)


def _shardvar_classes() -> set[type]:
    """Every class the package defines: in its modules' namespaces, and every Module subclass it made."""
    found: set[type] = set()
    for info in pkgutil.walk_packages(shardvar.__path__, "shardvar."):
        if info.name.rpartition(".")[2] == "__main__":
            continue  # runs the command line
        module = importlib.import_module(info.name)
        found |= {c for c in vars(module).values() if inspect.isclass(c)}
    todo = [torch.nn.Module]
    while todo:
        cls = todo.pop()
        found.add(cls)
        todo += cls.__subclasses__()
    return {c for c in found if (c.__module__ or "").startswith("shardvar")}


def test_no_module_chain_is_more_than_three_deep() -> None:
    classes = _shardvar_classes()
    assert len(classes) > 100  # the walk found the package
    deep = {f"{c.__module__}.{c.__qualname__}": _module_depth(c) for c in classes}
    assert {name: d for name, d in deep.items() if d > MAX_MODULE_DEPTH} == {}


def test_the_depth_counts_module_levels_only() -> None:
    class Mixin:
        pass

    class A(torch.nn.Module):
        pass

    class B(Mixin, A):
        pass

    class C(B, torch.nn.Embedding):
        pass

    for cls in (Mixin, A, B, C):
        cls.__module__ = "shardvar.example"
    assert [_module_depth(c) for c in (Mixin, A, B, C, torch.nn.Embedding)] == [0, 1, 2, 3, 0]


def test_the_twins_keep_their_public_isinstance_relations() -> None:
    from shardvar.distributed import (
        DistributedDynamicEmbedding,
        DistributedEmbedding,
        DistributedEmbeddingBag,
        DistributedEmbeddingBagCollection,
        DistributedEmbeddingCollection,
        QuantizedDistributedEmbeddingBagCollection,
        QuantizedDistributedEmbeddingCollection,
    )
    from shardvar.dynamic import DynamicEmbedding
    from shardvar.nn import ShardedEmbedding, ShardedEmbeddingBag, ShardedLinear
    from shardvar.nn._sharded_weight import ShardedWeight

    nn = torch.nn
    relations = [
        (DistributedEmbeddingBag, ShardedEmbeddingBag),
        (DistributedEmbeddingBag, nn.EmbeddingBag),
        (DistributedEmbedding, ShardedEmbedding),
        (DistributedEmbedding, nn.Embedding),
        (ShardedEmbeddingBag, nn.EmbeddingBag),
        (ShardedEmbedding, nn.Embedding),
        (ShardedLinear, nn.Linear),
        *[(cls, ShardedWeight) for cls in (ShardedEmbedding, ShardedEmbeddingBag, ShardedLinear)],
        (DistributedDynamicEmbedding, DynamicEmbedding),
        (DistributedEmbeddingCollection, DistributedEmbeddingBagCollection),
        (QuantizedDistributedEmbeddingCollection, QuantizedDistributedEmbeddingBagCollection),
    ]
    assert [(a.__name__, b.__name__) for a, b in relations if not issubclass(a, b)] == []
    assert not issubclass(ShardedEmbedding, nn.EmbeddingBag) and not issubclass(ShardedEmbeddingBag, nn.Embedding)


def test_distributed_modules_are_their_local_modules(one_rank) -> None:
    """Built, a distributed module (and a distributed collection's group table) is an instance of the local
    sharded module and of the torch module both replace, with the exchange on its store."""
    from shardvar.distributed import (
        DistributedEmbedding,
        DistributedEmbeddingBag,
        DistributedEmbeddingBagCollection,
        DistributedEmbeddingCollection,
    )
    from shardvar.nn import ShardedEmbedding, ShardedEmbeddingBag, TableConfig

    nn = torch.nn
    bag, rows = DistributedEmbeddingBag(6, 3, 2, mode="sum"), DistributedEmbedding(6, 3, 2)
    tables = {"t": TableConfig(6, 3, partitioner=2, mode="sum")}
    ebc, ec = DistributedEmbeddingBagCollection(tables), DistributedEmbeddingCollection(tables)
    for module, local, torch_module in [
        (bag, ShardedEmbeddingBag, nn.EmbeddingBag),
        (rows, ShardedEmbedding, nn.Embedding),
        (ebc.bags[0], ShardedEmbeddingBag, nn.EmbeddingBag),
        (ec.bags[0], ShardedEmbedding, nn.Embedding),
    ]:
        assert isinstance(module, local) and isinstance(module, torch_module), type(module)
        assert module.store.exchange is not None
    assert isinstance(ec, DistributedEmbeddingBagCollection)
    assert "rank=0/1, owned=[0, 1]" in repr(ebc.bags[0]) and "rank=0/1, owned=[0, 1]" in repr(bag)
    assert set(ebc.bags[0].sharded_variables()) == set() and set(bag.sharded_variables()) == {"weight"}
    out = bag(torch.tensor([0, 5, 1]), torch.tensor([0, 2]))
    torch.testing.assert_close(out, torch.stack([bag.weight.to_tensor()[[0, 5]].sum(0), bag.weight.to_tensor()[1]]))


# The functional module and the kernels it owns: the only modules that run an embedding kernel.
# (The workloads' baselines are plain torch on purpose: what a benchmark compares shardvar against.)
KERNEL_MODULES = {
    "variables/_functional.py",
    "variables/_kernels.py",  # the functional module's row-level half: which kernel, and how
    "variables/_gather.py",  # huge-page F.embedding and its backward
    "variables/_distinct.py",  # segment sums and the distinct rows' expansion
    "variables/_packed.py",  # the packed row formats' prepack and bag kernels
}
BASELINES = {"workloads/_bench.py", "workloads/_roofline.py"}
_KERNEL = re.compile(r"_?embedding")  # embedding, embedding_bag, _embedding_bag_forward_only, embedding_renorm_, ...


def _dotted(node: ast.expr) -> list[str]:
    """``a.b.c`` as ``["a", "b", "c"]`` ([] for anything else)."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return [node.id, *reversed(parts)] if isinstance(node, ast.Name) else []


def _kernel_calls(source: str) -> list[int]:
    """Lines that call an embedding kernel of torch's: through ``torch``, a name bound to a torch module or
    namespace (``F``, ``aten = torch.ops.aten``, ``from torch.nn import functional``), or to a kernel itself
    (``lookup = torch._embedding_bag_forward_only``, ``from torch.nn.functional import embedding``)."""
    tree = ast.parse(source)
    torchy, kernels = {"torch"}, set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            torchy |= {a.asname or a.name.split(".")[0] for a in node.names if a.name.split(".")[0] == "torch"}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch" and not node.level:
            for a in node.names:
                (kernels if _KERNEL.match(a.name) else torchy).add(a.asname or a.name)
    pairs = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign | ast.AnnAssign) and node.value is not None:
            for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                if isinstance(t, ast.Tuple) and isinstance(node.value, ast.Tuple):
                    pairs += zip(t.elts, node.value.elts, strict=False)
                else:
                    pairs.append((t, node.value))
    for target, value in pairs:  # in source order: an alias of an alias is found too
        chain = _dotted(value)
        if isinstance(target, ast.Name) and chain and chain[0] in torchy:
            (kernels if any(_KERNEL.match(p) for p in chain[1:]) else torchy).add(target.id)
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        chain = _dotted(node.func)
        if chain and (chain[0] in kernels or (chain[0] in torchy and any(_KERNEL.match(p) for p in chain[1:]))):
            found.append(node.lineno)
    return sorted(found)


def test_only_the_functional_module_runs_embedding_kernels() -> None:
    """One lookup implementation: every module above the functional module says what to look up (rows,
    offsets, weights) and calls ``functional.embedding_rows`` / ``embedding_bag_rows`` / ``bag_parts`` /
    ``packed_bag_rows`` / ``packed_rows`` / ``renorm_rows`` for how; none calls a kernel itself."""
    paths = {p.relative_to(PACKAGE).as_posix(): p for p in PACKAGE.rglob("*.py")}
    found = {name: _kernel_calls(p.read_text()) for name, p in paths.items()}
    assert all(found[m] for m in ("variables/_gather.py", "variables/_packed.py", *BASELINES))  # the finder finds them
    assert {m: lines for m, lines in found.items() if lines and m not in KERNEL_MODULES | BASELINES} == {}


@pytest.mark.parametrize(
    ("source", "lines"),
    [
        ("import torch.nn.functional as F\nF.embedding(i, w)\nF.embedding_bag(i, w, o)\nF.linear(x, w)\n", [2, 3]),
        ("import torch\ntorch.nn.functional.embedding(i, w)\ntorch.embedding_renorm_(w, i, 1.0, 2.0)\n", [2, 3]),
        ("import torch\nn, f = 1, torch._embedding_bag_forward_only\nf(w, i, o)\n", [3]),
        ("import torch\naten = torch.ops.aten\naten._embedding_bag_forward_only.out(w)\naten.add(x, y)\n", [3]),
        ("import torch\n_Q = torch.ops.quantized\n_Q.embedding_bag_byte_rowwise_offsets(w, i, o)\n", [3]),
        ("from torch.nn.functional import embedding_bag as eb\neb(i, w, o)\n", [2]),
        ("from torch.nn import functional\nfunctional.embedding(i, w)\n", [2]),
        # shardvar's own functional module is not torch's: its lookups are what the modules should call
        ("from ..variables import functional\nfunctional.embedding(store, i)\nfunctional.embedding_rows(i, w)\n", []),
        ("import torch\ntorch.index_select(w, 0, i)\nw.embedding(i)\n", []),
    ],
)
def test_the_kernel_call_finder_finds_kernel_calls(source: str, lines: list[int]) -> None:
    assert _kernel_calls(source) == lines


# Ground-floor modules every layer may use (the error family, argument checks, pages, buffers, formats,
# native kernels compiled on first use, the threads their jobs run on).
GROUND = {"_errors", "_validate", "_pages", "_recycle", "_format", "_deprecation", "_native", "_threads"}


def _reach_ins(own: str, source: str) -> list[tuple[int, str]]:
    """(line, text) of each import, in a module of subpackage ``own``, of another subpackage's private module."""
    lines, found = source.splitlines(), []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.level >= 2 and node.module:
            parts = node.module.split(".")
            if parts[0] not in (own, *GROUND) and any(p.startswith("_") for p in parts):
                found.append((node.lineno, lines[node.lineno - 1]))
    return found


def test_a_subpackage_reaches_into_another_s_private_modules_rarely_and_says_why() -> None:
    """At most 10 imports of another subpackage's private module, each with a reason on its line;
    otherwise the name is public in its package (or moved down a layer)."""
    found = [
        (str(path.relative_to(PACKAGE)), *hit)
        for path in PACKAGE.rglob("*.py")
        for hit in _reach_ins(path.relative_to(PACKAGE).parts[0], path.read_text())
    ]
    assert len(found) <= 10, found
    assert [f for f in found if "#" not in f[2]] == []


def test_the_reach_in_finder_finds_them() -> None:
    source = (
        "from ..variables._store import ShardStore\n"  # another subpackage's private module: found
        "from ..variables import ShardStore\n"  # its public package
        "from ._pack import pack\n"  # its own subpackage
        "from .._errors import ShardvarError\n"  # the ground floor
        "def f():\n    from ..checkpoint._chain import Chain  # why\n"
    )
    assert [line for line, _ in _reach_ins("nn", source)] == [1, 6]
