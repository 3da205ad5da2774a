"""Checkpoints: round trips into any layout, modules and optimizers, and damaged checkpoints."""

from __future__ import annotations

import itertools
import json
import os
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import shardvar
from shardvar import CheckpointError, Layout, ShardedVariable


@st.composite
def layouts_for(draw, rows: int, axis: int):
    kind = draw(st.sampled_from(["div", "mod", "ceil", "explicit"]))
    n = draw(st.integers(1, 6))
    if kind == "explicit":
        cuts = sorted(draw(st.lists(st.integers(0, rows), max_size=4)))
        edges = [0, *cuts, rows]
        return Layout.explicit([b - a for a, b in itertools.pairwise(edges)], axis)
    return getattr(Layout, kind)(rows, n, axis)


@given(st.data())
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_restore_into_any_layout(tmp_path, data) -> None:
    shape = [data.draw(st.integers(0, 20)), data.draw(st.integers(1, 4)), 2]
    dtype = data.draw(st.sampled_from([torch.float32, torch.bfloat16, torch.int64, torch.bool]))
    full = (torch.randn(shape) * 10).to(dtype)
    src_axis = data.draw(st.integers(0, 1))
    src = data.draw(layouts_for(shape[src_axis], src_axis))
    directory = tmp_path / f"ck{data.draw(st.integers(0, 10**9))}"
    shardvar.save({"v": shardvar.shard_tensor(full, src)}, directory)
    dst_axis = data.draw(st.integers(0, 2))
    dst = data.draw(layouts_for(shape[dst_axis], dst_axis))
    target = shardvar.shard_tensor(torch.zeros(shape, dtype=dtype), dst)
    shardvar.load({"v": target}, directory)
    assert torch.equal(target.to_tensor(), full)
    plain = torch.zeros(shape, dtype=dtype)
    shardvar.load({"v": plain}, directory)
    assert torch.equal(plain, full)
    for s in range(dst.num_shards):
        assert torch.equal(shardvar.read_shard(directory, "v", dst, s), target.variables[s])
    for got, want in zip(shardvar.checkpoint.read_shards(directory, "v", dst), target.variables, strict=True):
        assert torch.equal(got, want)


def test_plain_tensor_to_shards_and_back(tmp_path) -> None:
    full = torch.arange(30.0).reshape(10, 3)
    shardvar.save({"w": full, "step": torch.tensor(7)}, tmp_path / "a")
    v = shardvar.shard_tensor(torch.zeros(10, 3), Layout.mod(10, 4))
    step = torch.tensor(0)
    shardvar.load({"w": v, "step": step}, tmp_path / "a")
    assert torch.equal(v.to_tensor(), full) and int(step) == 7
    shardvar.save({"w": v}, tmp_path / "b")
    back = torch.zeros(10, 3)
    shardvar.load({"w": back}, tmp_path / "b")
    assert torch.equal(back, full)


def test_files_are_safetensors(tmp_path) -> None:
    from safetensors import safe_open

    v = shardvar.shard_tensor(torch.arange(12.0).reshape(6, 2), Layout.mod(6, 3))
    shardvar.save({"v": v, "b": torch.tensor([True, False])}, tmp_path)
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    for name, var in manifest["variables"].items():
        for s, piece in enumerate(var["pieces"]):
            with safe_open(str(tmp_path / piece["file"]), framework="pt") as f:
                stored = f.get_tensor(piece["key"])
            expected = v.variables[s] if name == "v" else torch.tensor([True, False])
            assert torch.equal(stored, expected)


class Model(nn.Module):
    def __init__(self, partitioner, strategy) -> None:
        super().__init__()
        self.emb = shardvar.ShardedEmbedding(40, 6, partitioner=partitioner, partition_strategy=strategy)
        self.head = nn.Linear(6, 1)

    def forward(self, ids):
        return self.head(self.emb(ids).mean(1)).squeeze(1)


def steps(model, optimizer, seed: int, n: int = 5) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        ids = torch.randint(0, 40, (8, 3), generator=g)
        loss = (model(ids) - torch.randn(8, generator=g)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


@pytest.mark.parametrize("optimizer_cls", [torch.optim.Adam, torch.optim.SGD, torch.optim.Adagrad])
def test_model_and_optimizer_reshard_and_training_continues_exactly(tmp_path, optimizer_cls) -> None:
    kwargs = {"lr": 0.05, "momentum": 0.9} if optimizer_cls is torch.optim.SGD else {"lr": 0.05}
    torch.manual_seed(0)
    reference = Model(1, "div")
    ref_opt = optimizer_cls(reference.parameters(), **kwargs)
    torch.manual_seed(0)
    model = Model(4, "div")
    opt = optimizer_cls(model.parameters(), **kwargs)
    steps(reference, ref_opt, seed=1)
    steps(model, opt, seed=1)
    shardvar.save({"model": model, "opt": opt}, tmp_path)
    restored = Model(3, "mod")
    restored_opt = optimizer_cls(restored.parameters(), lr=1.0)  # hyper-parameters come from the checkpoint
    shardvar.load({"model": restored, "opt": restored_opt}, tmp_path)
    assert restored_opt.param_groups[0]["lr"] == 0.05
    steps(reference, ref_opt, seed=2)
    steps(restored, restored_opt, seed=2)
    torch.testing.assert_close(restored.emb.weight.to_tensor(), reference.emb.weight.to_tensor(), atol=1e-6, rtol=0)
    torch.testing.assert_close(restored.head.weight, reference.head.weight, atol=1e-6, rtol=0)


def saved(tmp_path: Path) -> Path:
    v = shardvar.shard_tensor(torch.arange(40.0).reshape(20, 2), Layout.div(20, 3))
    shardvar.save({"v": v, "w": torch.ones(3), "u": torch.full((4,), 2.0)}, tmp_path)
    return tmp_path


def targets():
    return {
        "v": shardvar.shard_tensor(torch.full((20, 2), -1.0), Layout.mod(20, 4)),
        "w": torch.full((3,), -1.0),
        "u": torch.full((4,), -1.0),
    }


def edit_manifest(directory: Path, change) -> None:
    # A deliberate (hostile) edit, re-signed so that the manifest's checksum holds: what is left to
    # refuse it is the validation of every field.
    from shardvar.checkpoint._manifest import _checksum

    path = directory / "manifest.json"
    manifest = json.loads(path.read_text())
    change(manifest)
    manifest["checksum"] = _checksum({k: v for k, v in manifest.items() if k != "checksum"})
    path.write_text(json.dumps(manifest))


def data_file(directory: Path) -> Path:
    return next(directory.glob("data-*.safetensors"))


def flip_byte(directory: Path) -> None:
    path = data_file(directory)
    raw = bytearray(path.read_bytes())
    raw[-3] ^= 0x40  # inside the last tensor's data
    path.write_bytes(raw)


DAMAGE = [
    (flip_byte, "checksum mismatch in tensor 'u#0'"),
    (lambda d: os.truncate(data_file(d), data_file(d).stat().st_size - 5), "is truncated"),
    (lambda d: data_file(d).unlink(), "of variable 'v' is missing"),
    (lambda d: (d / "manifest.json").write_text("{not json"), "does not parse as JSON"),
    (lambda d: (d / "manifest.json").unlink(), "manifest.json is missing"),
    (
        lambda d: edit_manifest(d, lambda m: m["variables"]["w"].update(dtype="float128")),
        "variable 'w' has unknown dtype 'float128'",
    ),
    (
        lambda d: edit_manifest(d, lambda m: m["variables"]["v"]["layout"].update(strategy="hash")),
        "variable 'v' has an invalid layout",
    ),
    (
        lambda d: edit_manifest(d, lambda m: m["variables"]["v"]["pieces"][0].update(file="../x.safetensors")),
        "names file '../x.safetensors'",
    ),
    (
        lambda d: edit_manifest(d, lambda m: m["variables"]["v"]["pieces"][0].update(file="/etc/passwd")),
        "not a plain file name",
    ),
    (lambda d: edit_manifest(d, lambda m: m["variables"].pop("u")), "variable 'u' is not in the checkpoint"),
    (
        lambda d: edit_manifest(d, lambda m: m["variables"]["v"].update(shape=[21, 2])),
        "variable 'v' has an invalid layout",
    ),
    (lambda d: edit_manifest(d, lambda m: m.update(version=99)), "format version 99"),
    (
        lambda d: edit_manifest(d, lambda m: m["variables"]["v"]["pieces"][1].update(start=5)),
        "variable 'v', piece 'v#1'",
    ),
]


@pytest.mark.parametrize("damage, match", DAMAGE)
def test_damaged_checkpoints_fail_clearly_and_change_nothing(tmp_path, damage, match) -> None:
    directory = saved(tmp_path)
    damage(directory)
    objects = targets()
    before = {k: (v.to_tensor() if isinstance(v, ShardedVariable) else v).clone() for k, v in objects.items()}
    with pytest.raises(CheckpointError, match=match):
        shardvar.load(objects, directory)
    for k, v in objects.items():
        assert torch.equal(v.to_tensor() if isinstance(v, ShardedVariable) else v, before[k]), k


@pytest.mark.parametrize(
    "objects, match",
    [
        (
            {"v": torch.zeros(20, 3)},
            r"variable 'v' was saved as torch.float32 \[20, 2\]; the target is torch.float32 \[20, 3\]",
        ),
        ({"w": torch.zeros(3, dtype=torch.float64)}, "saved as torch.float32 .3.; the target is torch.float64"),
        ({"missing": torch.zeros(1)}, "variable 'missing' is not in the checkpoint"),
    ],
)
def test_mismatched_targets(tmp_path, objects, match) -> None:
    directory = saved(tmp_path)
    objects = {**objects, "u": torch.full((4,), -1.0)}
    with pytest.raises(CheckpointError, match=match):
        shardvar.load(objects, directory)
    assert bool((objects["u"] == -1).all())


def test_large_targets_take_the_two_pass_path(tmp_path) -> None:
    directory = saved(tmp_path)
    flip_byte(directory)
    objects = targets()
    with pytest.raises(CheckpointError, match="checksum"):
        shardvar.load(objects, directory, staging_bytes=0)
    assert bool((objects["u"] == -1).all()) and bool((objects["v"].to_tensor() == -1).all())
    directory = saved(tmp_path / "again")
    shardvar.load(objects, directory, staging_bytes=0)
    assert torch.equal(objects["v"].to_tensor(), torch.arange(40.0).reshape(20, 2))


def test_resave_replaces_the_files_and_keeps_foreign_ones(tmp_path) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    shardvar.save({"x": torch.ones(2)}, tmp_path)
    first = {p.name for p in tmp_path.iterdir()}
    shardvar.save({"x": torch.zeros(2)}, tmp_path)
    second = {p.name for p in tmp_path.iterdir()}
    assert "notes.txt" in second and first != second
    assert sum(n.startswith("spare-") for n in second) == 1  # the first save's file, kept for reuse
    shardvar.save({"x": torch.full((2,), 5.0)}, tmp_path, keep_spare=False)
    third = {p.name for p in tmp_path.iterdir()}
    assert len(third) == 3 and not any(n.startswith("spare-") for n in third)
    x = torch.ones(2)
    shardvar.load({"x": x}, tmp_path)
    assert x.tolist() == [5.0, 5.0]


def test_reshard(tmp_path) -> None:
    full = torch.randn(50, 3)
    shardvar.save({"t": shardvar.shard_tensor(full, Layout.div(50, 8)), "s": torch.tensor(2.0)}, tmp_path / "a")
    shardvar.reshard(tmp_path / "a", tmp_path / "b", 3, "mod")
    manifest = shardvar.checkpoint.Manifest.read(tmp_path / "b")
    assert manifest.variables["t"].layout == Layout.mod(50, 3)
    out = torch.zeros(50, 3)
    shardvar.load({"t": out}, tmp_path / "b")
    assert torch.equal(out, full)
    with pytest.raises(ValueError, match="unknown partition strategy"):
        shardvar.reshard(tmp_path / "a", tmp_path / "c", 3, "hash")
    with pytest.raises(CheckpointError, match="src and dst are both"):
        shardvar.reshard(tmp_path / "a", tmp_path / "a", 3)


def test_bad_state_dicts(tmp_path) -> None:
    with pytest.raises(TypeError, match=r"state_dict\['x'\] is a str"):
        shardvar.save({"x": "text"}, tmp_path)
    with pytest.raises(TypeError, match="without '/'"):
        shardvar.save({"a/b": torch.ones(1)}, tmp_path)
    (tmp_path / "file").write_text("")
    with pytest.raises(CheckpointError, match="is not a directory"):
        shardvar.save({"x": torch.ones(1)}, tmp_path / "file")


def test_the_format_doc_reads_a_checkpoint_without_shardvar(tmp_path, monkeypatch) -> None:
    import re

    from conftest import ROOT

    doc = (ROOT / "docs" / "checkpoint-format.md").read_text()
    block = re.search(r"## Reading a variable without shardvar\n\n```python\n(.*?)```", doc, re.S).group(1)
    model = nn.Module()
    model.emb = shardvar.ShardedEmbedding(50, 4, partitioner=3, partition_strategy="mod")
    shardvar.save({"model": model}, tmp_path / "ckpt")
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(compile(block, "checkpoint-format.md", "exec"), namespace)
    assert torch.equal(torch.from_numpy(namespace["out"]), model.emb.weight.to_tensor().detach())


def test_version_2_checkpoints_with_crc32_checksums_still_load_and_verify(tmp_path, monkeypatch) -> None:
    from shardvar.checkpoint import _manifest, _safetensors

    t = torch.randn(50, 3)
    with monkeypatch.context() as m:  # write as the previous release did
        m.setattr(_safetensors, "CHECKSUM", "crc32")
        m.setattr(_manifest, "VERSION", 2)
        shardvar.save({"t": shardvar.shard_tensor(t, shardvar.Layout.mod(50, 2))}, tmp_path)
    raw = json.loads((tmp_path / "manifest.json").read_text())
    assert raw["version"] == 2 and "crc32" in raw["variables"]["t"]["pieces"][0]
    assert torch.equal(shardvar.read_shard(tmp_path, "t"), t)
    with shardvar.open(tmp_path) as served:
        assert torch.equal(served["t"].lookup(torch.tensor([49, 0])), t[[49, 0]])
    piece = raw["variables"]["t"]["pieces"][0]
    with open(tmp_path / piece["file"], "r+b") as f:
        f.seek(piece["begin"])
        f.write(b"\x00\x00\x80\x7f")
    with pytest.raises(shardvar.CheckpointError, match="checksum"):
        shardvar.read_shard(tmp_path, "t")
