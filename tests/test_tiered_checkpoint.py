"""Checkpoints of tiered tables: streamed from the backing file into a normal checkpoint, and back.

A tiered table's checkpoint loads into an in-memory module of any layout (rows and optimizer
state), and an in-memory module's checkpoint loads into a tiered table (its file written, its
cache forgotten); training then goes on exactly as in memory.
"""

from __future__ import annotations

import pytest
import torch

import shardvar
from shardvar import optim
from shardvar.tiered import _views

ROWS, DIM = 50, 4


def _tiered(tmp_path, name="t.rows", seed=0, cache_rows=10):
    torch.manual_seed(seed)
    storage = shardvar.Tiered(tmp_path / name, cache_bytes=cache_rows * (DIM * 4 + 4))
    return shardvar.ShardedEmbeddingBag(ROWS, DIM, mode="sum", sparse=True, storage=storage)


def _train(module, steps=8, seed=2):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        ids = (torch.rand(8, generator=g) ** 2 * ROWS).long()
        module(ids, torch.tensor([0, 3, 5])).square().sum().backward()


def _fused(module):
    opt = optim.RowWiseAdagrad(module, lr=0.1)
    optim.fuse(opt)
    return opt


@pytest.mark.parametrize("layout", [(1, "div"), (3, "mod"), (4, "div")])
def test_a_tiered_checkpoint_loads_into_a_table_in_memory(tmp_path, monkeypatch, layout):
    monkeypatch.setattr(_views, "STREAM_ROWS", 7)  # many pieces per shard
    torch.manual_seed(0)
    ref = shardvar.ShardedEmbeddingBag(ROWS, DIM, mode="sum", sparse=True)
    tiered = _tiered(tmp_path)
    opts = [_fused(m) for m in (ref, tiered)]
    for m in (ref, tiered):
        _train(m)
    shardvar.save({"model": tiered, "opt": opts[1]}, tmp_path / "ckpt")
    target = shardvar.ShardedEmbeddingBag(ROWS, DIM, *layout, mode="sum", sparse=True)
    target_opt = optim.RowWiseAdagrad(target, lr=0.1)
    shardvar.load({"model": target, "opt": target_opt}, tmp_path / "ckpt")
    assert torch.equal(target.weight.to_tensor(), ref.weight.to_tensor())
    saved = target_opt.sharded_variables()["weight/sum"]
    assert torch.equal(saved.join(), opts[0].tables[0].state["sum"][0])


def test_a_checkpoint_in_memory_loads_into_a_tiered_table_and_training_goes_on(tmp_path):
    torch.manual_seed(0)
    ref = shardvar.ShardedEmbeddingBag(ROWS, DIM, 2, "mod", mode="sum", sparse=True)
    ref_opt = _fused(ref)
    _train(ref)
    shardvar.save({"model": ref, "opt": ref_opt}, tmp_path / "ckpt")
    tiered = _tiered(tmp_path, seed=5)  # other values, and a warm cache that the load makes stale
    opt = _fused(tiered)
    _train(tiered, steps=3, seed=9)
    shardvar.load({"model": tiered, "opt": opt}, tmp_path / "ckpt")
    values, state = tiered.tier.peek(torch.arange(ROWS))
    assert torch.equal(values, ref.weight.to_tensor())
    assert torch.equal(state[:, 0], ref_opt.sharded_variables()["weight/sum"].join())
    for m in (ref, tiered):
        _train(m, steps=6, seed=4)
    values, state = tiered.tier.peek(torch.arange(ROWS))
    assert torch.equal(values, ref.weight.to_tensor())


def test_saving_writes_back_changed_rows_and_keeps_the_cache(tmp_path):
    tiered = _tiered(tmp_path)
    _fused(tiered)
    _train(tiered, steps=3)
    assert bool(tiered.tier.cache.dirty.any())
    expected = tiered.tier.peek(torch.arange(ROWS))[0]
    shardvar.save({"model": tiered}, tmp_path / "ckpt")
    assert not bool(tiered.tier.cache.dirty.any()) and int((tiered.tier.cache.key >= 0).sum()) > 0
    target = shardvar.ShardedEmbeddingBag(ROWS, DIM, mode="sum")
    shardvar.load({"model": target}, tmp_path / "ckpt")
    assert torch.equal(target.weight.to_tensor(), expected)
