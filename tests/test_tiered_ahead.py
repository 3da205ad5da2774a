"""Batches resolved ahead while the page cache holds the backing file (``tiered/_ahead.py``): the ``Prefetcher``'s
thread brings the next batch's rows into their slots, the batch's forward takes them, and which rows stay is decided
in one place (``Pins``), never by the threads' timing."""

from __future__ import annotations

import pytest
import torch

import shardvar
import shardvar.tiered._mapped as mapped_module
from shardvar import optim
from shardvar.tiered import Prefetcher, RecordLayout, RowCache, cache_bytes_for
from test_tiered_engine import _batches, _train_cached, _train_in_memory
from test_tiered_mapped import _cached_file, needs_cachestat

pytestmark = needs_cachestat


def _distinct_batches(rows: int, steps: int, size: int, seed: int) -> list[torch.Tensor]:
    return [torch.unique(b) for b in _batches(rows, steps, size, seed)]  # what the loop resolves: taken as they are


def _trained(tmp_path, capacity: int, batches: list[torch.Tensor]) -> tuple[RowCache, torch.Tensor, torch.Tensor]:
    layout = RecordLayout(200, 3, "float32", 1)
    f = _cached_file(tmp_path, layout=layout)
    f.read(torch.tensor([0]))  # (mapped from the first read: every batch is resolved ahead, or refused)
    assert f.mapped.active
    cache = RowCache(f, capacity, "lru")
    _train_cached(cache, batches, prefetch=True)
    assert f.mapped.active
    values, state = cache.peek(torch.arange(200))
    return cache, values, state


def test_each_batch_is_resolved_ahead_and_taken_and_training_equals_memory(tmp_path, monkeypatch):
    monkeypatch.setattr(mapped_module, "RECHECK_S", 0.0)
    batches = _distinct_batches(200, 60, 24, seed=5)
    expected = _train_in_memory(RecordLayout(200, 3, "float32", 1), batches)
    cache, values, state = _trained(tmp_path, 60, batches)
    assert torch.equal(values, expected[0]) and torch.equal(state, expected[1])
    # every miss was brought in ahead, before its batch asked (the first batch's too: readied before it is yielded)
    assert cache.stats.misses == cache.stats.prefetched
    assert cache.stats.evictions > 0 and cache.stats.written_back > 0


def test_what_a_resolve_ahead_evicts_never_depends_on_timing(tmp_path, monkeypatch):
    monkeypatch.setattr(mapped_module, "RECHECK_S", 0.0)
    batches = _distinct_batches(200, 40, 24, seed=6)
    runs = []
    for k in range(2):
        (tmp_path / str(k)).mkdir()
        cache, _, _ = _trained(tmp_path / str(k), 50, batches)
        runs.append((cache.stats, cache.key.clone(), cache.used.clone()))
    assert runs[0][0] == runs[1][0]
    assert torch.equal(runs[0][1], runs[1][1]) and torch.equal(runs[0][2], runs[1][2])


def test_a_cache_that_fits_one_batch_but_not_two_trains_exactly(tmp_path, monkeypatch):
    """Each resolve ahead is refused (the batch computing keeps its rows), changes nothing, and its batch is
    resolved when it runs: never an error a loop without the prefetcher would not raise."""
    monkeypatch.setattr(mapped_module, "RECHECK_S", 0.0)
    batches = _distinct_batches(200, 30, 24, seed=7)
    need = max(b.numel() for b in batches)
    expected = _train_in_memory(RecordLayout(200, 3, "float32", 1), batches)
    cache, values, state = _trained(tmp_path, need, batches)
    assert torch.equal(values, expected[0]) and torch.equal(state, expected[1])
    assert cache.stats.prefetched < cache.stats.misses


def test_a_plain_resolve_that_needs_their_room_lets_batches_resolved_ahead_go(tmp_path, monkeypatch):
    monkeypatch.setattr(mapped_module, "RECHECK_S", 0.0)
    with _cached_file(tmp_path) as f:
        cache = RowCache(f, 20, "lru")
        cache.resolve(torch.arange(5))  # (maps the file)
        ahead = torch.arange(100, 115)
        assert cache.prefetch(ahead, 1, cache.ahead_since()) == 15
        other = torch.arange(200, 215)  # 15 more: does not fit beside the 15 resolved ahead
        slots = cache.resolve(other)
        assert torch.equal(cache.key[slots].to(torch.int64), other)
        assert cache.pins.take(ahead, pin=False) is None  # let go: its batch is resolved again
        slots = cache.resolve(ahead)
        assert torch.equal(cache.key[slots].to(torch.int64), ahead)
        values, _ = cache.peek(ahead)
        expected, _ = f.layout.split(f.read(ahead))
        assert torch.equal(values, expected)


def test_a_resolve_ahead_keeps_the_rows_of_batches_in_flight(tmp_path, monkeypatch):
    """A pending backward's batch (pinned) and a batch resolved ahead but not yet taken keep their slots while the
    next batch is resolved ahead; the batch computing with no backward keeps them for the resolve ahead started
    beside it (what it keeps is decided before the thread starts: ``ahead_since``)."""
    monkeypatch.setattr(mapped_module, "RECHECK_S", 0.0)
    with _cached_file(tmp_path) as f:
        cache = RowCache(f, 30, "lru")
        first = torch.arange(0, 10)
        pinned, step = cache.use(first, pin=True)
        second = torch.arange(50, 60)
        cache.prefetch(second, 1, cache.ahead_since())
        since = cache.ahead_since()  # asked while ``second`` is not yet taken: its rows are kept
        taken, _ = cache.use(second)
        assert cache.prefetch(torch.arange(100, 110), 1, since) == 10  # fits beside both: 30 slots
        assert cache.prefetch(torch.arange(150, 160), 1, cache.ahead_since()) == 0  # does not: refused, nothing moved
        assert torch.equal(cache.key[pinned].to(torch.int64), first)
        assert torch.equal(cache.key[taken].to(torch.int64), second)
        cache.pins.unpin(step)
        assert not cache.pins.pinned


@pytest.mark.parametrize("bag", [True, False])
def test_a_table_trained_through_the_prefetcher_over_a_cached_file_equals_memory(tmp_path, monkeypatch, bag):
    """The module families' own paths: a sum bag's forward resolves the batch's ids as given, a lookup's its distinct
    ids (taken by the batch they come from): both take the slots resolved ahead; inference beside it too."""
    monkeypatch.setattr(mapped_module, "RECHECK_S", 0.0)
    rows, dim = 500, 8

    def make(**storage):
        torch.manual_seed(0)
        if bag:
            return shardvar.ShardedEmbeddingBag(rows, dim, mode="sum", sparse=True, **storage)
        return shardvar.ShardedEmbedding(rows, dim, sparse=True, **storage)

    memory = make()
    tiered = make(storage=shardvar.Tiered(tmp_path / "t.rows", cache_bytes=cache_bytes_for(90, dim, rows=rows,
                                                                                         state_width=1)))  # fmt: skip
    for m in (memory, tiered):
        optim.fuse(optim.RowWiseAdagrad(m, lr=0.05))
    with open(tiered.tier.file.path, "rb") as raw:  # into the page cache: the file is mapped from the first read
        while raw.read(1 << 20):
            pass
    tiered.tier.file.read(torch.tensor([0]))  # (so the first batch is resolved ahead too)
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, rows, (8, 4), generator=g) for _ in range(40)]
    for ids in batches:
        memory(ids).sum().backward()
    for ids in Prefetcher(batches, lambda ids: [(tiered.cache, ids)]):
        tiered(ids).sum().backward()
    with torch.no_grad():
        for ids in Prefetcher(batches[:10], lambda ids: [(tiered.cache, ids)]):
            assert torch.equal(tiered(ids), memory(ids))
    stats = tiered.cache_stats()
    assert tiered.tier.file.mapped.active and stats["evictions"] > 0
    assert stats["prefetched"] == stats["misses"]  # every batch taken as resolved ahead (a lookup: by its batch)
    assert torch.equal(tiered.tier.peek(torch.arange(rows))[0], memory.weight.to_tensor())
    tiered.close()


def test_a_cache_let_go_resolves_nothing_ahead(tmp_path, monkeypatch):
    """A resolve ahead still to run in a cache its table let go (a load forgot its rows, or it closed) changes
    nothing: written back, its changed rows would overwrite what the load wrote."""
    monkeypatch.setattr(mapped_module, "RECHECK_S", 0.0)
    with _cached_file(tmp_path) as f:
        cache = RowCache(f, 20, "lru")
        slots = cache.resolve(torch.arange(20))
        cache.values[slots] += 1.0
        cache.mark_dirty(slots)  # every slot changed: any eviction would write
        before = f.read(torch.arange(300))
        with cache.lock:
            cache.pins.retire()
        assert cache.prefetch(torch.arange(100, 110), 1, cache.ahead_since()) == 0
        assert torch.equal(f.read(torch.arange(300)), before)
        assert torch.equal(cache.key[slots].to(torch.int64), torch.arange(20))


def test_loading_a_checkpoint_lets_the_old_cache_go(tmp_path):
    rows, dim = 300, 4
    storage = shardvar.Tiered(tmp_path / "t.rows", cache_bytes=cache_bytes_for(40, dim, rows=rows))
    tiered = shardvar.ShardedEmbedding(rows, dim, storage=storage)
    shardvar.save({"emb": tiered}, tmp_path / "ckpt")
    tiered(torch.arange(10))
    old = tiered.cache
    shardvar.load({"emb": tiered}, tmp_path / "ckpt")
    assert old.pins.retired and tiered.cache is not old and not tiered.cache.pins.retired
    tiered.close()
    assert tiered.cache.pins.retired


@pytest.mark.parametrize("share", [True, False])
def test_the_loop_body_gives_the_resolve_ahead_one_intra_op_thread(tmp_path, monkeypatch, share):
    """While the next batch is resolved ahead (CPU work, the file mapped), the body runs with one intra-op thread
    fewer (``share_cores``), the count restored after each step, after the loop, and when the loop is left early;
    the last batch, with nothing resolved behind it, and a file read ahead (on the disk: I/O) keep them all."""
    monkeypatch.setattr(mapped_module, "RECHECK_S", 0.0)
    f = _cached_file(tmp_path, layout=RecordLayout(200, 3, "float32", 1))
    f.read(torch.tensor([0]))
    cache = RowCache(f, 60, "lru")
    threads = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        batches = _distinct_batches(200, 5, 12, seed=8)
        seen = [torch.get_num_threads() for _ in Prefetcher(batches, lambda b: [(cache, b)], share_cores=share)]
        assert seen == ([2, 2, 2, 2, 3] if share else [3] * 5) and torch.get_num_threads() == 3
        for _ in Prefetcher(batches, lambda b: [(cache, b)], share_cores=share):
            break  # (the generator is closed at the yield)
        assert torch.get_num_threads() == 3
        f.mapped.release()
        f.mapped._next_check = float("inf")  # on the disk from here: records read ahead, no resolve
        assert [torch.get_num_threads() for _ in Prefetcher(batches, lambda b: [(cache, b)])] == [3] * 5
    finally:
        torch.set_num_threads(threads)
        cache.close()
        f.close()


def test_share_cores_must_be_a_bool():
    with pytest.raises(shardvar.ShardvarTypeError, match="share_cores"):
        Prefetcher([], lambda b: [], share_cores="yes")
