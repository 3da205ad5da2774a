"""Dynamic tables in checkpoints: restore into other shard counts, optimizer state, deltas, refusals."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import shardvar
from shardvar.dynamic import LRU, CountAdmission, DynamicEmbedding

BATCHES = [torch.randint(-(2**40), 2**40, (48,), generator=torch.Generator().manual_seed(s)) % 97 for s in range(9)]


def _train(emb: DynamicEmbedding, opt: torch.optim.Optimizer, batches: list[torch.Tensor]) -> list[torch.Tensor]:
    outs = []
    for ids in batches:
        opt.zero_grad()
        out = emb(ids)
        (out**2).sum().backward()
        opt.step()
        outs.append(out.detach())
    return outs


def _setup(shards: int) -> tuple[DynamicEmbedding, torch.optim.Optimizer]:
    emb = DynamicEmbedding(6, 120, shards, eviction=LRU(), admission=CountAdmission(2, width=256))
    opt = torch.optim.Adam(emb.parameters(), lr=0.05)
    emb.attach_optimizer(opt)
    return emb, opt


@pytest.mark.parametrize("shards", [1, 2, 3])
def test_restore_into_another_shard_count_continues_exactly(tmp_path: Path, shards: int) -> None:
    emb, opt = _setup(2)
    _train(emb, opt, BATCHES[:5])
    shardvar.save({"emb": emb, "opt": opt}, tmp_path / "ck")
    other, other_opt = _setup(shards)
    shardvar.load({"emb": other, "opt": other_opt}, tmp_path / "ck")
    assert torch.equal(other.held_ids(), emb.held_ids())
    assert torch.equal(other.slots.sketch, emb.slots.sketch) and int(other.slots.step) == int(emb.slots.step)
    rows, keys = emb.to_fixed()
    rows_o, keys_o = other.to_fixed()
    assert torch.equal(keys, keys_o) and torch.equal(rows, rows_o)
    for ids in (torch.arange(97), keys):  # every id on its shard: found by the hash index
        assert torch.equal(other.contains(ids), emb.contains(ids))
    for a, b in zip(_train(emb, opt, BATCHES[5:]), _train(other, other_opt, BATCHES[5:]), strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


def test_overfull_shard_keeps_the_ids_the_policy_ranks_highest(tmp_path: Path) -> None:
    emb = DynamicEmbedding(2, 8, 1, eviction=LRU())
    for i in range(8):
        emb(torch.tensor([i]))
    shardvar.save({"emb": emb}, tmp_path / "ck")
    other = DynamicEmbedding(2, 8, 4, eviction=LRU())  # 2 rows per shard: ids of a shard compete
    shardvar.load({"emb": other}, tmp_path / "ck")
    shard = shardvar.dynamic.shard_of(torch.arange(8), 4)
    for s in range(4):
        mine = torch.arange(8)[shard == s]
        assert other.held_ids()[shardvar.dynamic.shard_of(other.held_ids(), 4) == s].tolist() == mine[-2:].tolist()


def test_capacity_mismatch_is_refused_and_changes_nothing(tmp_path: Path) -> None:
    emb = DynamicEmbedding(2, 8)
    emb(torch.tensor([1, 2]))
    shardvar.save({"emb": emb}, tmp_path / "ck")
    other = DynamicEmbedding(2, 9)
    other(torch.tensor([3]))
    before = other.held_ids()
    with pytest.raises(shardvar.CheckpointError, match=r"saved as .*\[8, 2\].*\[9, 2\]"):
        shardvar.load({"emb": other}, tmp_path / "ck")
    assert torch.equal(other.held_ids(), before) and bool(other.contains(torch.tensor([3])))


def test_corrupt_metadata_is_refused(tmp_path: Path) -> None:
    emb = DynamicEmbedding(2, 8)
    emb(torch.tensor([1, 2]))
    with torch.no_grad():
        emb.slots.meta[:, 0] = 5  # two held slots claim the same id
    with pytest.raises(shardvar.ShardvarValueError, match="corrupt"):
        emb.checkpoint_hook("after_load")


def test_delta_records_evictions_as_deletions(tmp_path: Path) -> None:
    emb = DynamicEmbedding(4, 1000, 2)
    emb(torch.arange(400))
    shardvar.save({"emb": emb}, tmp_path / "base")
    evicted = emb.evict(torch.arange(0, 400, 7))
    emb(torch.tensor([5000, 5001]))
    shardvar.save({"emb": emb}, tmp_path / "delta", delta_of=tmp_path / "base")
    size = {p: sum(f.stat().st_size for f in (tmp_path / p).rglob("*") if f.is_file()) for p in ("base", "delta")}
    assert size["delta"] < size["base"] / 4
    other = DynamicEmbedding(4, 1000, 3)
    shardvar.load({"emb": other}, tmp_path / "delta")
    assert torch.equal(other.held_ids(), emb.held_ids())
    assert not other.contains(evicted).any() and other.contains(torch.tensor([5000, 5001])).all()


def test_read_back_as_a_fixed_table_without_the_module(tmp_path: Path) -> None:
    emb = DynamicEmbedding(3, 16, 2)
    emb(torch.tensor([10, 20]))
    shardvar.save({"emb": emb}, tmp_path / "ck")
    weight = shardvar.read_shard(tmp_path / "ck", "emb/table.weight")
    meta = shardvar.read_shard(tmp_path / "ck", "emb/slots.meta")
    rows, keys = emb.to_fixed()
    held = meta[:, 3] == 1
    order = meta[held, 0].argsort()
    assert torch.equal(meta[held, 0][order], keys) and torch.equal(weight[held][order], rows)
