"""Every public name resolves, and each layer imports only the layers below it."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import shardvar

PACKAGE = Path(shardvar.__file__).parent
# Bottom to top; a module may import its own layer and the ones listed before it.
LAYERS = [
    "_errors",
    "layout",
    "partitioners",
    "variables",
    "nn",
    "optim",
    "dynamic",
    "tiered",
    "checkpoint",
    "quantized",
    "tf",
    "distributed",
    "transform",
    "workloads",
    "cli",
]


def test_every_public_name_resolves() -> None:
    for name in shardvar.__all__:
        assert getattr(shardvar, name) is not None, name
    assert len(set(shardvar.__all__)) == len(shardvar.__all__)
    assert sorted(n for n in dir(shardvar) if not n.startswith("_") and n[0].isupper()) <= sorted(shardvar.__all__)


def _layer_of(path: Path) -> str:
    rel = path.relative_to(PACKAGE).parts
    return rel[0].removesuffix(".py")


def _imported_layers(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    own = path.relative_to(PACKAGE).parts[:-1]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = list(own[: len(own) - node.level + 1])
            target = base + (node.module.split(".") if node.module else [a.name for a in node.names][:1])
            if target:
                found.add(target[0].removesuffix(".py"))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            for n in names:
                if n.startswith("shardvar."):
                    found.add(n.split(".")[1])
    return found


def test_layers_import_only_layers_below() -> None:
    problems = []
    for path in PACKAGE.rglob("*.py"):
        layer = _layer_of(path)
        if layer not in LAYERS:
            continue  # the package's own __init__ and __main__ sit above every layer
        for imported in _imported_layers(path):
            if imported in LAYERS and LAYERS.index(imported) > LAYERS.index(layer):
                problems.append(f"{path.relative_to(PACKAGE)} (layer {layer}) imports {imported}")
    assert not problems, problems


def test_layout_math_does_not_touch_torch_distributed() -> None:
    for path in (PACKAGE / "layout").rglob("*.py"):
        assert not re.search(r"(import|from) torch\.distributed|torch\.distributed\.\w", path.read_text()), path
