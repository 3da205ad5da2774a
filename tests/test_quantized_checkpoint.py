"""Quantized tables in checkpoints: save, load, reshard, serve, inspect, and quantizing a checkpoint."""

from __future__ import annotations

import json
import re

import pytest
import torch

import shardvar
from shardvar import CheckpointError, EmbeddingBagCollection, ShardedEmbeddingBag, TableConfig, quantize
from shardvar.checkpoint import Manifest
from shardvar.checkpoint import _chain as chain_module
from shardvar.cli._main import main


def _bag(shards=3, strategy="mod", rows=50, dim=8) -> ShardedEmbeddingBag:
    torch.manual_seed(0)
    return ShardedEmbeddingBag(rows, dim, partitioner=shards, partition_strategy=strategy, mode="sum")


@pytest.mark.parametrize("dtype", [torch.quint8, torch.quint4x2, torch.float16])
def test_save_then_load_into_another_layout(tmp_path, dtype) -> None:
    q = quantize(_bag(), dtype)
    shardvar.save({"emb": q}, tmp_path)
    manifest = Manifest.read(tmp_path)
    entry = manifest.variables["emb/weight"]
    width = row_format_width(dtype, 8)
    assert entry.shape == (50, width) and entry.layout == q.layout
    assert manifest.extra["packed"] == {"emb/weight": {"dtype": str(dtype).removeprefix("torch."), "dim": 8}}
    other = quantize(_bag(shards=2, strategy="div"), dtype)
    with torch.no_grad():
        other.shard_0.zero_()
    shardvar.load({"emb": other}, tmp_path)
    assert torch.equal(other.dequantize(), q.dequantize())
    ids = torch.randint(0, 50, (4, 3))
    assert torch.equal(other(ids), q(ids))


def row_format_width(dtype, dim) -> int:
    return shardvar.quantized.row_format(dtype).width(dim)


def test_float_and_packed_do_not_load_into_each_other(tmp_path) -> None:
    bag = _bag()
    shardvar.save({"emb": bag}, tmp_path / "float")
    q = quantize(bag, torch.quint8)
    shardvar.save({"emb": q}, tmp_path / "q8")
    with pytest.raises(CheckpointError, match="saved as float rows; the target holds quint8 rows of dim 8"):
        shardvar.load({"emb": q}, tmp_path / "float")
    with pytest.raises(CheckpointError, match="saved as quint8 rows of dim 8; the target holds float rows"):
        shardvar.load({"emb": _bag()}, tmp_path / "q8")
    fp16 = quantize(bag, torch.float16)
    shardvar.save({"emb": fp16}, tmp_path / "f16")
    plain = ShardedEmbeddingBag(50, 8, 3, "mod", dtype=torch.float16)
    with pytest.raises(CheckpointError, match="saved as float16 rows of dim 8; the target holds float rows"):
        shardvar.load({"emb": plain}, tmp_path / "f16")


def test_reshard_and_serve_packed_rows(tmp_path) -> None:
    q = quantize(_bag(), torch.quint4x2)
    shardvar.save({"emb": q}, tmp_path / "a")
    shardvar.reshard(tmp_path / "a", tmp_path / "b", 4, "div")
    entry = Manifest.read(tmp_path / "b").variables["emb/weight"]
    assert entry.layout.num_shards == 4 and entry.layout.strategy == "div"
    ids = torch.tensor([[49, 0], [7, 7]])
    with shardvar.open(tmp_path / "b") as served:
        table = served["emb/weight"]
        assert table.packed == "quint4x2" and "packed='quint4x2'" in repr(table)
        assert torch.equal(table.lookup(ids), q.lookup(ids))
        packed = table.lookup(ids, packed=True)
        assert packed.dtype == torch.uint8 and packed.shape == (2, 2, 8)
        assert torch.equal(packed, q.store.full_slab[q.store.slab_rows(ids)])
        assert torch.equal(table.read(), q.dequantize())
        assert table.read(packed=True).shape == (50, 8)
    loaded = quantize(_bag(shards=4, strategy="div"), torch.quint4x2)
    shardvar.load({"emb": loaded}, tmp_path / "b")
    assert torch.equal(loaded.dequantize(), q.dequantize())


def test_inspect_shows_the_format_and_bytes(tmp_path, capsys) -> None:
    shardvar.save({"emb": quantize(_bag(rows=1000, dim=64), torch.quint8)}, tmp_path)
    assert main(["inspect", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "quint8 (dim 64, uint8 rows)" in out and "70.3 KiB" in out  # 1000 x (64 + 8) bytes


def test_quantize_a_checkpoint_streams_shard_by_shard(tmp_path, monkeypatch) -> None:
    torch.manual_seed(0)
    ebc = EmbeddingBagCollection({"a": TableConfig(40, 8, 4, "mod"), "b": TableConfig(30, 6, 2)})
    dense = torch.nn.Linear(3, 2)
    opt = torch.optim.Adagrad(ebc.parameters(), lr=0.1)
    ebc(shardvar.KeyedJagged(("a", "b"), torch.tensor([1, 2, 3]), torch.tensor([[2], [1]])))["a"].sum().backward()
    opt.step()
    shardvar.save({"ebc": ebc, "dense": dense, "opt": opt}, tmp_path / "float")
    reads = []
    original = chain_module.Chain.read

    def counting(self, name, layout, shards):
        reads.append((name, len(shards)))
        return original(self, name, layout, shards)

    monkeypatch.setattr(chain_module.Chain, "read", counting)
    tables = ["ebc/embedding_bags.a.weight", "ebc/embedding_bags.b.weight"]
    out = quantize(str(tmp_path / "float"), torch.quint8, dst=tmp_path / "q8", tables=tables)
    assert out == tmp_path / "q8"
    assert all(n == 1 for _, n in reads) and len([r for r in reads if r[0] == tables[0]]) == 4  # one shard at a time
    manifest = Manifest.read(out)
    assert sorted(manifest.variables) == sorted([*tables, "dense/bias", "dense/weight"])  # optimizer state left out
    assert manifest.variables["dense/weight"].dtype == torch.float32
    expected = quantize(ebc, torch.quint8)
    served = quantize(EmbeddingBagCollection({"a": TableConfig(40, 8, 2), "b": TableConfig(30, 6, 3, "mod")}), "quint8")
    shardvar.load({"ebc": served}, out)
    for k in ("a", "b"):
        assert torch.equal(served.embedding_bags[k].dequantize(), expected.embedding_bags[k].dequantize())


def test_quantize_a_checkpoint_refuses_bad_input_before_writing(tmp_path) -> None:
    ints = shardvar.shard_tensor(torch.arange(12).reshape(6, 2), shardvar.Layout.balanced("div", 6, 2))
    shardvar.save(
        {"ids": ints, "t": shardvar.shard_tensor(torch.randn(6, 3), shardvar.Layout.balanced("div", 6, 2))},
        tmp_path / "s",
    )
    with pytest.raises(shardvar.ShardvarDTypeError, match="int64; only floating-point"):
        quantize(tmp_path / "s", torch.quint8, dst=tmp_path / "d", tables=["ids"])
    with pytest.raises(shardvar.ShardvarValueError, match="embedding_dim 3"):
        quantize(tmp_path / "s", torch.quint4x2, dst=tmp_path / "d", tables="t")
    with pytest.raises(CheckpointError, match="'nope'"):
        quantize(tmp_path / "s", torch.quint8, dst=tmp_path / "d", tables=["nope"])
    with pytest.raises(CheckpointError, match="pass dst"):
        quantize(tmp_path / "s", torch.quint8)
    with pytest.raises(shardvar.ShardvarTypeError, match="dst"):
        quantize(_bag(), torch.quint8, dst=tmp_path / "d")
    assert not (tmp_path / "d").exists()


def test_a_damaged_packed_record_is_refused(tmp_path) -> None:
    shardvar.save({"emb": quantize(_bag(), torch.quint8)}, tmp_path)
    manifest = Manifest.read(tmp_path)
    manifest.extra["packed"]["emb/weight"]["dim"] = 9
    (tmp_path / "manifest.json").write_text(manifest.to_json())
    json.loads((tmp_path / "manifest.json").read_text())
    with pytest.raises(CheckpointError, match="does not match its stored shape"):
        shardvar.open(tmp_path)["emb/weight"]


def test_demo_serves_the_trained_model_quantized(capsys) -> None:
    args = ["demo", "--tables", "2", "--steps", "2", "--batch", "32", "--scale", "0.002", "--no-progress"]
    assert main([*args, "--quantize"]) == 0
    out = capsys.readouterr().out
    labels = {"float32", "int8 (quint8)", "int4 (quint4x2)"}
    cells = [re.split(r"\s{2,}", line.strip()) for line in out.splitlines()]  # plain table: columns 2+ spaces apart
    lines = {c[0]: c[1:] for c in cells if c[0] in labels}
    assert set(lines) == labels
    assert float(lines["int4 (quint4x2)"][1].strip().rstrip("x")) < float(lines["int8 (quint8)"][1].strip().rstrip("x"))
    assert abs(float(lines["int8 (quint8)"][3].strip().rstrip("%"))) <= 0.5  # logloss change, relative
    with pytest.raises(SystemExit, match=r"^2$"):  # refused where parsed, before any training
        main(["demo", "--procs", "2", "--quantize"])
    assert "--quantize serves the one-process model" in capsys.readouterr().err
