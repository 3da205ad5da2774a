"""Hostile review of resolve ahead (``tiered/_ahead.py``): the interleavings the Prefetcher's thread allows, replayed
deterministically (the calls are the ones ``_ReadAhead.run`` makes, in an order timing allows; a thread held on an
Event where it must run beside the loop)."""

from __future__ import annotations

import gc
import threading

import pytest
import torch

import shardvar
import shardvar.tiered._mapped as mapped_module
from shardvar import optim
from shardvar.tiered import Prefetcher, RowCache, cache_bytes_for
from test_tiered_mapped import _cached_file, needs_cachestat

pytestmark = needs_cachestat


@pytest.fixture(autouse=True)
def _recheck_now(monkeypatch):
    monkeypatch.setattr(mapped_module, "RECHECK_S", 0.0)


def _warm(path) -> None:
    with open(path, "rb") as raw:  # into the page cache: mapped from the first read
        while raw.read(1 << 20):
            pass


# 1 -- an explicit protect_since evicts rows of a batch resolved ahead, and its entry is still handed out
def test_explicit_protect_since_evicts_rows_resolved_ahead_and_take_hands_out_stale_slots(tmp_path):
    with _cached_file(tmp_path) as f:
        cache = RowCache(f, 20, "lru")
        cache.resolve(torch.arange(5))  # (maps the file)
        assert f.mapped.active
        ahead = torch.arange(100, 115)
        assert cache.prefetch(ahead, 1, cache.ahead_since()) == 15
        # a caller keeping only its own step's rows (documented: ``protect_since``), as before this change
        cache.resolve(torch.arange(200, 215), protect_since=cache.step + 1)
        slots, _ = cache.use(ahead)  # takes the entry resolved ahead
        assert torch.equal(cache.key[slots].to(torch.int64), ahead), "slots handed out now hold other rows"


def _trained_bag(tmp_path) -> shardvar.ShardedEmbeddingBag:
    """A fused sum bag over a file the page cache holds (mapped from its first read)."""
    rows, dim = 300, 4
    storage = shardvar.Tiered(tmp_path / "t.rows", cache_bytes=cache_bytes_for(40, dim, rows=rows, state_width=1))
    torch.manual_seed(0)
    table = shardvar.ShardedEmbeddingBag(rows, dim, mode="sum", sparse=True, storage=storage)
    optim.fuse(optim.RowWiseAdagrad(table, lr=0.05))
    _warm(table.tier.file.path)
    return table


# 3 -- the thread's call after a load switched the table to its new file: the old cache (its file closed) is let go
def test_prefetch_into_the_cache_a_load_let_go_changes_nothing(tmp_path):
    table = _trained_bag(tmp_path)
    table(torch.arange(5).view(1, 5)).sum().backward()
    assert table.tier.file.mapped.active
    shardvar.save({"emb": table}, tmp_path / "ckpt")
    old = table.cache
    since = old.ahead_since()  # (``_ReadAhead.__init__``, on the loop's thread, before the load)
    shardvar.load({"emb": table}, tmp_path / "ckpt")  # in the loop body, after the backward
    assert old.pins.retired
    # the thread for the next batch runs now: it should change and raise nothing (the commit's promise)
    assert old.prefetch(torch.arange(10, 20).view(2, 5), 64, since) == 0
    table.close()


def test_prefetcher_loop_with_a_load_in_its_body_never_raises(tmp_path, monkeypatch):
    """The same through the Prefetcher, its thread held back until the load is done (a slow thread)."""
    table = _trained_bag(tmp_path)
    shardvar.save({"emb": table}, tmp_path / "ckpt")
    go = threading.Event()
    prefetch = RowCache.prefetch

    def slow(self, ids, limit, since):
        if ids[0, 0] == 20:  # the third batch's: runs while the second computes and loads
            go.wait(5)
        return prefetch(self, ids, limit, since)

    monkeypatch.setattr(RowCache, "prefetch", slow)
    batches = [torch.arange(k * 10, k * 10 + 10).view(2, 5) for k in range(4)]
    for k, ids in enumerate(Prefetcher(batches, lambda b: [(table.cache, b)])):
        table(ids).sum().backward()
        if k == 1:
            shardvar.load({"emb": table}, tmp_path / "ckpt")
            go.set()
    table.close()


# 4 -- a table collected on the prefetch thread while it holds its cache's lock (a reference cycle, GC there)
def test_gc_on_the_prefetch_thread_of_a_table_in_a_cycle_does_not_deadlock(tmp_path):
    rows, dim = 300, 4
    storage = shardvar.Tiered(tmp_path / "t.rows", cache_bytes=cache_bytes_for(40, dim, rows=rows))
    table = shardvar.ShardedEmbedding(rows, dim, storage=storage)
    table.__dict__["_cycle"] = [table]  # (a fused optimizer and its sink make such cycles too)
    _warm(table.tier.file.path)
    table(torch.arange(3))
    cache = table.cache
    assert cache.file.mapped.active
    since = cache.ahead_since()
    dropped, resolve = threading.Event(), cache._resolve

    def collecting(ids, step, protect_since):  # inside resolve_ahead, under cache.lock, on the thread
        dropped.wait(5)
        gc.collect()  # any allocation there may trigger it
        return resolve(ids, step, protect_since)

    cache._resolve = collecting
    gc.disable()
    try:
        thread = threading.Thread(target=cache.prefetch, args=(torch.arange(50, 60), 1, since), daemon=True)
        thread.start()
        del table
        dropped.set()
        thread.join(5)
    finally:
        gc.enable()
    assert not thread.is_alive(), "the prefetch thread deadlocked: _close -> cache.close -> flush -> cache.lock"


# checked and fine: two forwards before one backward, inference between, bag and lookup, a small cache: the same
# values and outputs with the Prefetcher as without it (a tiered table's accumulated step differs from the in-memory
# table's with or without the Prefetcher, even with a cache of every row: not this change's)
@pytest.mark.parametrize("bag", [True, False])
def test_accumulated_forwards_and_inference_through_the_prefetcher_equal_the_plain_loop(tmp_path, bag):
    rows, dim = 400, 4

    def train(path, prefetch: bool):
        torch.manual_seed(0)
        storage = shardvar.Tiered(path, cache_bytes=cache_bytes_for(70, dim, rows=rows, state_width=1))
        if bag:
            table = shardvar.ShardedEmbeddingBag(rows, dim, mode="sum", sparse=True, storage=storage)
        else:
            table = shardvar.ShardedEmbedding(rows, dim, sparse=True, storage=storage)
        optim.fuse(optim.RowWiseAdagrad(table, lr=0.05))
        _warm(path)
        g = torch.Generator().manual_seed(3)
        batches = [torch.randint(0, rows, (4, 4), generator=g) for _ in range(30)]
        probe = torch.randint(0, rows, (2, 4), generator=g)
        held, outs = [], []
        loop = Prefetcher(batches, lambda b: [(table.cache, b)]) if prefetch else batches
        for k, ids in enumerate(loop):
            held.append(table(ids).sum())
            if k % 2 == 1:  # two forwards, then one backward
                torch.stack(held).sum().backward()
                held.clear()
            with torch.no_grad():
                outs.append(table(probe))
        values, prefetched = table.tier.peek(torch.arange(rows))[0], table.cache_stats()["prefetched"]
        table.close()
        return values, torch.stack(outs), prefetched

    plain, ahead = train(tmp_path / "a.rows", False), train(tmp_path / "b.rows", True)
    assert torch.equal(plain[0], ahead[0]) and torch.equal(plain[1], ahead[1])
    assert ahead[2] > 0
