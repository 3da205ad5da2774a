"""Property-based fuzzing of the loader: whatever happens to a checkpoint's files, a load either
returns the saved values or raises CheckpointError, and never changes a target when it raises.

The longer-running coverage-guided target is tests/fuzz/fuzz_manifest.py (atheris).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import shardvar
from shardvar import CheckpointError, Layout
from shardvar.checkpoint._manifest import _checksum

TABLE = torch.arange(60.0).reshape(20, 3)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=6,
)  # fmt: skip


def pristine(root: Path) -> Path:
    source = root / "pristine"
    if not source.exists():
        shardvar.save({"t": shardvar.shard_tensor(TABLE, Layout.mod(20, 3)), "s": torch.tensor(7.0)}, source)
    return source


def _paths(obj, prefix=()):
    yield prefix
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _paths(v, (*prefix, i))


def _set(obj, path, value):
    for k in path[:-1]:
        obj = obj[k]
    obj[path[-1]] = value


@st.composite
def damage(draw, directory: Path):
    files = sorted(p.name for p in directory.iterdir())
    kind = draw(st.sampled_from(["flip", "truncate", "link", "fifo", "resign"]))
    name = draw(st.sampled_from(files))
    return kind, name, draw(st.integers(0, 10**9)), draw(json_values)


def apply(directory: Path, kind: str, name: str, n: int, value) -> None:
    path = directory / name
    if kind == "flip":
        raw = bytearray(path.read_bytes())
        raw[n % len(raw)] ^= 1 << (n % 8)
        path.write_bytes(raw)
    elif kind == "truncate":
        os.truncate(path, n % max(path.stat().st_size, 1))
    elif kind == "link":
        other = directory.parent / "elsewhere"
        other.write_bytes(path.read_bytes())
        path.unlink()
        path.symlink_to(other if n % 2 else "/dev/zero")
    elif kind == "fifo":
        path.unlink()
        os.mkfifo(path)
    else:
        manifest_path = directory / "manifest.json"
        manifest = json.loads(manifest_path.read_text())
        paths = [p for p in _paths(manifest) if p and p[0] != "checksum"]
        _set(manifest, paths[n % len(paths)], value)
        manifest["checksum"] = _checksum({k: v for k, v in manifest.items() if k != "checksum"})
        manifest_path.write_text(json.dumps(manifest))


@given(st.data())
@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_damaged_checkpoints_load_right_or_raise_checkpoint_error(tmp_path_factory, data) -> None:
    root = tmp_path_factory.getbasetemp() / "fuzz"
    root.mkdir(exist_ok=True)
    work = root / "work"
    shutil.rmtree(work, ignore_errors=True)
    shutil.copytree(pristine(root), work)
    kind, name, n, value = data.draw(damage(work))
    apply(work, kind, name, n, value)
    t = shardvar.shard_tensor(torch.full((20, 3), -1.0), Layout.div(20, 2))
    s = torch.tensor(-1.0)
    try:
        shardvar.load({"t": t, "s": s}, work)
    except CheckpointError:
        assert bool((t.to_tensor() == -1).all()) and float(s) == -1.0  # nothing written
        return
    assert torch.equal(t.to_tensor(), TABLE) and float(s) == 7.0  # or the right values, in full
