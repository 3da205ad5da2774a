"""Hostile checks of the one-pass swap (``tiered/_swap.py``, ``sv_swap_rows``) against the cache's own steps.

The native pass must leave everything as ``RowCache._evict`` / ``_bring`` would, the mapping's counts of reads
and writes included (``MappedRecords.gathers`` / ``scatters``: one per call that moved records through it), and a
pass the kernel refuses must change nothing at all. A table collected on the prefetch thread inside the mapping's
pass lets its file go without waiting for the lock that pass holds (this deadlocked before the swap too).
"""

from __future__ import annotations

import gc
import threading

import pytest
import torch

import shardvar
import shardvar.tiered._cache as cache_module
import shardvar.tiered._mapped as mapped_module
from shardvar.tiered import RecordLayout, RowCache, _native, cache_bytes_for
from test_tiered_mapped import needs_cachestat
from test_tiered_swap import _pair

pytestmark = [
    needs_cachestat,
    pytest.mark.skipif(_native.kernel() is None, reason="no native kernel here (no C compiler, or SHARDVAR_NATIVE=0)"),
]


def _counts(cache: RowCache) -> tuple[int, int]:
    return cache.file.mapped.gathers, cache.file.mapped.scatters


def test_a_native_pass_that_writes_no_row_back_counts_no_scatter(tmp_path, monkeypatch):
    """The first fill (free slots, no victims) and steps whose victims are all clean write nothing through the
    mapping: the cache's own steps count one gather and no scatter; the native pass counts a scatter as well."""
    monkeypatch.setattr(mapped_module, "RECHECK_S", 0.0)
    layout = RecordLayout(120, 3, "float32", 1)
    native, steps = _pair(tmp_path, layout, 16, "lru", False)
    for cache in (native, steps):
        cache.file.read(torch.tensor([0]))  # mapped before the first batch: every batch may take the native pass
        assert cache.file.mapped.takes_writes
    seen: dict[str, list[tuple[int, int]]] = {"native": [], "steps": []}
    for step in range(4):
        ids = torch.arange(step * 10, step * 10 + 12, dtype=torch.int64)  # 12 misses a step, victims from step 1 on
        native.resolve(ids)  # (read only: every victim clean, nothing to write back)
        with monkeypatch.context() as m:
            m.setattr(cache_module, "swap_in", lambda *a: None)
            steps.resolve(ids)
        assert torch.equal(native.key, steps.key) and native.stats == steps.stats
        assert native.file.bytes_written == steps.file.bytes_written == 0
        seen["native"].append(_counts(native))
        seen["steps"].append(_counts(steps))
    assert native.stats.evictions > 0
    assert seen["native"] == seen["steps"], "(gathers, scatters) after each step"
    for cache in (native, steps):
        cache.close()
        cache.file.close()


def test_gc_inside_the_mapped_pass_on_the_prefetch_thread_does_not_deadlock(tmp_path, monkeypatch):
    """A table in a reference cycle collected on the prefetch thread while its resolve ahead is inside the mapping's
    pass (``MappedRecords._through``, which holds the mapping's lock while the swap's ctypes arrays, generators and
    ``getrusage``'s result are allocated: any of those may run the collector). The table's finalizer lets the file go
    (``_close`` -> ``RowFile.discard`` -> ``MappedRecords.close``), which takes that same lock again on this thread."""
    rows, dim = 300, 4
    storage = shardvar.Tiered(tmp_path / "t.rows", cache_bytes=cache_bytes_for(40, dim, rows=rows))
    table = shardvar.ShardedEmbedding(rows, dim, storage=storage)
    table.__dict__["_cycle"] = [table]  # (a fused optimizer and its sink make such cycles too)
    with open(table.tier.file.path, "rb") as raw:  # into the page cache: mapped from the first read
        while raw.read(1 << 20):
            pass
    table(torch.arange(3))
    cache = table.cache
    assert cache.file.mapped.takes_writes
    since = cache.ahead_since()
    dropped, real = threading.Event(), mapped_module._major_faults
    fired: list[str] = []

    def faults() -> int:  # (getrusage: an allocation inside the mapping's pass, where the collector may run; a
        # collection there, on the prefetch thread, once the table is garbage: what gc's threshold does by chance)
        if threading.current_thread().name == "prefetch" and not fired:
            fired.append("collected")
            dropped.wait(5)
            gc.collect()
        return real()

    monkeypatch.setattr(mapped_module, "_major_faults", faults)
    gc.disable()
    try:
        thread = threading.Thread(target=cache.prefetch, args=(torch.arange(50, 60), 1, since), name="prefetch",
                                  daemon=True)  # fmt: skip
        thread.start()
        del table, cache
        dropped.set()
        thread.join(3)
    finally:
        gc.enable()
    assert fired and not thread.is_alive(), "deadlocked: _close -> RowFile.discard -> MappedRecords.close (its lock)"
