"""``cache_bytes`` bounds every row and state a tiered table holds in RAM, in transit included.

The slots, the read-ahead reserve, the staging and the write-behind areas are carved out of
``cache_bytes``; every record read from or written to the backing file while a table trains (a
batch's misses, rows written back on eviction and flush, rows read ahead) moves through the
staging area, the write-behind area or a read-ahead set within the reserve, never through a
buffer of its own. Checked through the
engine's own accounting: each transfer's buffer is located, and what is held summed, at the
moment it happens.
"""

from __future__ import annotations

import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import shardvar
from shardvar import optim
from shardvar.tiered import Prefetcher, RowFile, cache_bytes_for

ROWS, DIM = 60, 4
OPTIMIZERS = {"rowwise_adagrad": (optim.RowWiseAdagrad, 1), "adam": (optim.Adam, 2 * DIM)}


def _inside(buffer, tensor) -> bool:
    if tensor is None:
        return False
    start, size = buffer.__array_interface__["data"][0], buffer.nbytes
    return tensor.data_ptr() <= start and start + size <= tensor.data_ptr() + tensor.nbytes


class _Audit:
    """Wraps ``RowFile._transfer``: where each buffer lies, and the bytes held when it moves."""

    def __init__(self, table) -> None:
        self.table, self.moves, self.peak, self.errors = table, 0, 0, []

    def __call__(self, transfer):
        def audited(file, ids, buffer, **how):
            cache = self.table.tier.cache
            if file is cache.file:
                self.check(cache, buffer)
            return transfer(file, ids, buffer, **how)

        return audited

    def check(self, cache, buffer) -> None:
        self.moves += 1
        staged = sum(s.records.nbytes for s in cache._staged if s.records is not None)
        if threading.current_thread().name == "shardvar-prefetch":  # a read ahead, into a set of its own
            held = staged + buffer.nbytes
            if held > (cache.reserve or 0) * cache.layout.record_bytes:
                self.errors.append(f"read ahead: {held} bytes staged, the reserve is {cache.reserve} records")
        elif threading.current_thread().name.startswith("shardvar-write-behind"):  # an eviction's rows
            if not _inside(buffer, cache.behind.area):
                self.errors.append(f"a {buffer.nbytes}-byte write behind, outside the write-behind area")
        elif not (_inside(buffer, cache.staging) or _inside(buffer, cache.behind.area)):  # (the log's cleaning
            self.errors.append(f"a {buffer.nbytes}-byte buffer outside the staging area")  # writes from the area)
        slots = cache.values.nbytes + cache.state.nbytes
        self.peak = max(self.peak, slots + cache.staging.nbytes + cache.behind.area.nbytes + staged)


@settings(max_examples=12, deadline=None)
@given(
    slots=st.integers(20, 40),
    read_ahead=st.sampled_from([0.0, 0.125, 0.4]),
    optimizer=st.sampled_from(sorted(OPTIMIZERS)),
    policy=st.sampled_from(["lru", "lfu"]),
    batch=st.integers(1, 10),
    seed=st.integers(0, 2**16),
)
def test_every_row_in_ram_stays_within_cache_bytes(tmp_path_factory, slots, read_ahead, optimizer, policy, batch, seed):
    cls, width = OPTIMIZERS[optimizer]
    folder = tmp_path_factory.mktemp("budget")
    cache_bytes = cache_bytes_for(slots, DIM, rows=ROWS, state_width=width, read_ahead=read_ahead)
    storage = shardvar.Tiered(folder / "t.rows", cache_bytes=cache_bytes, policy=policy, read_ahead=read_ahead)
    table = shardvar.ShardedEmbeddingBag(ROWS, DIM, mode="sum", sparse=True, storage=storage)
    optim.fuse(cls(table, lr=0.05))
    audit = _Audit(table)
    g = torch.Generator().manual_seed(seed)
    batches = [((torch.rand(2 * batch, generator=g) ** 2 * ROWS).long(), torch.tensor([0, batch])) for _ in range(12)]
    transfer = RowFile._transfer
    RowFile._transfer = audit(transfer)
    try:
        for ids, offsets in Prefetcher(batches, lambda b: [(table.cache, b[0])], limit=1 << 10):
            table(ids, offsets).square().sum().backward()
            assert table.cache.held_bytes <= table.cache.nbytes <= cache_bytes
        table.tier.flush()
    finally:
        RowFile._transfer = transfer
    shardvar.save({"model": table}, folder / "ckpt")  # still saves (the file's rows are current)
    table.close()
    assert audit.moves > 0 and audit.errors == []
    assert audit.peak <= cache_bytes


@pytest.mark.parametrize("staging", [1, 3, 64])
def test_a_batch_larger_than_the_staging_area_moves_through_it_in_pieces(tmp_path, staging):
    """Misses and write-backs of more records than the staging area holds: the same rows as in memory."""
    torch.manual_seed(0)
    ref = shardvar.ShardedEmbeddingBag(ROWS, DIM, mode="sum", sparse=True)
    torch.manual_seed(0)
    storage = shardvar.Tiered(tmp_path / "t.rows", cache_bytes=cache_bytes_for(40, DIM, rows=ROWS, state_width=1))
    tiered = shardvar.ShardedEmbeddingBag(ROWS, DIM, mode="sum", sparse=True, storage=storage)
    opts = [optim.RowWiseAdagrad(m, lr=0.1) for m in (ref, tiered)]
    for o in opts:
        optim.fuse(o)
    tier = tiered.tier
    tier.cache = tier.spec.cache_of(tier.file, (tier.cache.capacity, tier.cache.reserve or 0, staging))
    g = torch.Generator().manual_seed(3)
    for _ in range(8):
        ids = torch.randperm(ROWS, generator=g)[:30]  # 30 distinct: most miss, many evictions
        for m in (ref, tiered):
            m(ids, torch.tensor([0, 10, 20])).square().sum().backward()
    values, state = tier.peek(torch.arange(ROWS))
    assert torch.equal(values, ref.weight.to_tensor())
    assert torch.equal(state[:, 0], opts[0].tables[0].state["sum"][0])
    assert tier.cache.staging.shape[0] == staging


@pytest.mark.parametrize("how", ["an optimizer adds its state", "a checkpoint is loaded"])
def test_a_new_cache_is_made_only_after_the_old_one_is_let_go(tmp_path, monkeypatch, how):
    """Two caches never live at once (the capped-memory run: widening the file for an optimizer's state held
    the old cache while it made the new, twice ``cache_bytes``)."""
    import gc
    import weakref

    storage = shardvar.Tiered(tmp_path / "t.rows", cache_bytes=cache_bytes_for(40, DIM, rows=ROWS, state_width=1))
    tiered = shardvar.ShardedEmbeddingBag(ROWS, DIM, mode="sum", sparse=True, storage=storage)
    if how == "a checkpoint is loaded":
        optim.fuse(optim.RowWiseAdagrad(tiered, lr=0.1))
        tiered(torch.arange(20), torch.tensor([0, 10])).sum().backward()  # rows held: the load forgets them
        shardvar.save({"model": tiered}, tmp_path / "ck")
    old = weakref.ref(tiered.tier.cache)
    alive = []
    make = type(storage).cache_of

    def watched(self, *args):
        gc.collect()
        alive.append(old() is not None)
        return make(self, *args)

    monkeypatch.setattr(type(storage), "cache_of", watched)
    if how == "a checkpoint is loaded":
        shardvar.load({"model": tiered}, tmp_path / "ck")
    else:
        optim.fuse(optim.RowWiseAdagrad(tiered, lr=0.1))
    assert alive and not any(alive), alive
