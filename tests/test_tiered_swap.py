"""A batch's misses in one native pass while the file is mapped (``tiered/_swap.py``, ``sv_swap_rows``).

Two caches over copies of one mapped file train on the same batches, one through the native pass and one
through ``RowCache``'s own steps: after every step they hold the same slots, keys, homes, steps, flags, use
counts, free slots, map and rows, count the same, and their files hold the same bytes. Where the pass does not
apply, or the kernel refuses an index, nothing changes and the cache's own steps run.
"""

from __future__ import annotations

import copy
import shutil

import pytest
import torch

import shardvar.tiered._cache as cache_module
import shardvar.tiered._mapped as mapped_module
from shardvar.tiered import RecordLayout, RowCache, RowFile, _native
from shardvar.tiered._swap import swap_in
from test_tiered_engine import _adagrad, _batches
from test_tiered_mapped import _cached_file, needs_cachestat

pytestmark = [
    needs_cachestat,
    pytest.mark.skipif(_native.kernel() is None, reason="no native kernel here (no C compiler, or SHARDVAR_NATIVE=0)"),
]

FIELDS = ("key", "home", "used", "dirty", "count", "free", "values", "state")


def _pair(tmp_path, layout: RecordLayout, capacity: int, policy: str, wide: bool) -> list[RowCache]:
    """Two caches over two mapped files of the same bytes: the first swaps natively, the second never."""
    (tmp_path / "a").mkdir()
    first = _cached_file(tmp_path / "a", layout=layout)
    first.close()
    shutil.copyfile(first.path, tmp_path / "b.rows")
    caches = []
    for path in (first.path, tmp_path / "b.rows"):
        f = RowFile.open(path)
        with open(path, "rb") as raw:  # every page in the page cache: mapped at the first read
            while raw.read(1 << 20):
                pass
        f.mapped._next_check = 0.0
        cache = RowCache(f, capacity, policy)
        if wide:  # (a file of over 2**31 rows has these; the kernel takes both widths)
            cache.key, cache.home = cache.key.to(torch.int64), cache.home.to(torch.int64)
            cache.index.table = cache.index.table.to(torch.int64)
        caches.append(cache)
    return caches


def _step(cache: RowCache, ids: torch.Tensor, step: int, native: bool, monkeypatch) -> torch.Tensor:
    with monkeypatch.context() as m:
        if not native:
            m.setattr(cache_module, "swap_in", lambda *a: None)
        slots = cache.resolve(ids)
    distinct = slots.unique()
    v, s = cache.values[distinct], cache.state[distinct]
    _adagrad(v, s, torch.sin(v * (step + 1)))
    cache.values[distinct], cache.state[distinct] = v, s
    cache.mark_dirty(distinct)
    return slots


def _assert_same(a: RowCache, b: RowCache) -> None:
    for name in FIELDS:
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert torch.equal(a.index.table, b.index.table) and a.stats == b.stats
    assert (a.file.bytes_read, a.file.bytes_written) == (b.file.bytes_read, b.file.bytes_written)
    assert (a.file.mapped.gathers, a.file.mapped.scatters) == (b.file.mapped.gathers, b.file.mapped.scatters)


@pytest.mark.parametrize("capacity", [13, 24, 40])  # (the direct map: a place per row)
@pytest.mark.parametrize("policy", ["lru", "lfu"])
@pytest.mark.parametrize("wide", [False, True])
def test_the_native_pass_equals_the_caches_own_steps(tmp_path, monkeypatch, capacity, policy, wide):
    monkeypatch.setattr(mapped_module, "RECHECK_S", 0.0)
    layout = RecordLayout(160, 3, "float32", 1)
    seed = capacity + 7 * wide
    native, steps = _pair(tmp_path, layout, capacity, policy, wide)
    calls = []
    real = cache_module.swap_in
    monkeypatch.setattr(cache_module, "swap_in", lambda *a: calls.append(1) or real(*a))
    for step, ids in enumerate(_batches(160, 30, capacity, seed=seed)):
        assert torch.equal(_step(native, ids, step, True, monkeypatch), _step(steps, ids, step, False, monkeypatch))
        _assert_same(native, steps)
    assert len(calls) > 0 and native.stats.evictions > 0 and native.file.mapped.takes_writes
    assert native.file.mapped.scatters > 0 and native.file.mapped.gathers > 0
    for cache in (native, steps):
        cache.close()
        cache.file.close()
    assert native.file.path.read_bytes() == steps.file.path.read_bytes()


def test_it_does_not_apply_where_the_file_is_not_mapped_for_writes(tmp_path, monkeypatch):
    monkeypatch.setattr(mapped_module, "RECHECK_S", 0.0)
    layout = RecordLayout(50, 3, "float32", 1)
    with _cached_file(tmp_path, layout=layout) as f:
        cache = RowCache(f, 10, "lru")
        ids = torch.arange(4, dtype=torch.int64)
        f.mapped.release()
        f.mapped._next_check = float("inf")
        before = {name: getattr(cache, name).clone() for name in FIELDS}
        assert swap_in(cache, None, ids) is None
        assert all(torch.equal(getattr(cache, name), before[name]) for name in FIELDS)
        cache.close()


def test_an_index_the_kernel_refuses_changes_nothing(tmp_path, monkeypatch):
    """A new id already held, a victim out of range, ids out of order: None, every slot, count and the file as they
    were."""
    monkeypatch.setattr(mapped_module, "RECHECK_S", 0.0)
    layout = RecordLayout(50, 3, "float32", 1)
    with _cached_file(tmp_path, layout=layout) as f:
        cache = RowCache(f, 10, "lru")
        cache.resolve(torch.arange(10, dtype=torch.int64))
        cache.mark_dirty(torch.arange(10))
        cache.values.add_(1.0)
        assert f.mapped.takes_writes
        records = f.read(torch.arange(50))
        before = {name: getattr(cache, name).clone() for name in FIELDS}
        counts = (f.mapped.gathers, f.mapped.scatters, f.bytes_read, f.bytes_written, copy.copy(cache.stats))
        table = cache.index.table.clone()
        for victims, ids in (
            (torch.tensor([0, 1]), torch.tensor([3, 20])),  # 3 is held
            (torch.tensor([0, 10]), torch.tensor([20, 21])),  # slot 10 of 10
            (torch.tensor([1, 0]), torch.tensor([20, 21])),  # victims out of order
            (torch.tensor([0, 1]), torch.tensor([21, 20])),  # ids out of order
            (torch.tensor([0]), torch.tensor([20, 21])),  # more ids than room
        ):
            assert swap_in(cache, victims, ids) is None
            assert all(torch.equal(getattr(cache, name), before[name]) for name in FIELDS)
            assert (f.mapped.gathers, f.mapped.scatters, f.bytes_read, f.bytes_written, cache.stats) == counts
            assert torch.equal(cache.index.table, table) and torch.equal(f.read(torch.arange(50)), records)
            counts = (f.mapped.gathers, f.mapped.scatters, f.bytes_read, f.bytes_written, counts[4])
        cache.close()
