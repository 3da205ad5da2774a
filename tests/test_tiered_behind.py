"""Write-behind: the rows an eviction gives up are written on a thread while the step goes on.

Exact whatever the timing: a row written behind and wanted again is read after its write (slow
writes make the race real), a read-ahead started during a write reads after it, and training
through write-behind equals training in memory. A write that fails is never silent: every later
use raises, and the file is left not clean (refused when opened again).
"""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from shardvar.tiered import BackingFileError, Prefetcher, RecordLayout, RowCache, RowFile
from test_tiered_engine import _batches, _init, _train_cached, _train_in_memory


def _slow_writes(monkeypatch, f: RowFile, delay: float, fail: bool = False) -> list[int]:
    """Writes from the write-behind thread wait ``delay`` first (or fail); returns how many it made."""
    write, made = f.write_from, []

    def slow(ids, records):
        if threading.current_thread().name.startswith("shardvar-write-behind"):
            made.append(ids.numel())
            time.sleep(delay)
            if fail:
                raise BackingFileError("cannot write to backing file: Input/output error (injected)")
        write(ids, records)

    monkeypatch.setattr(f, "write_from", slow)
    return made


@pytest.mark.parametrize("staging", [1, 3, 64])
@pytest.mark.parametrize("prefetch", [False, True])
def test_training_through_write_behind_equals_training_in_memory(tmp_path, monkeypatch, staging, prefetch):
    layout = RecordLayout(64, 3, "float32", 1)
    batches = _batches(64, 50, 12, seed=staging)
    expected = _train_in_memory(layout, batches)
    with RowFile.create(tmp_path / "t.rows", layout, _init(layout)) as f:
        made = _slow_writes(monkeypatch, f, 0.002)  # the step runs on while a write is in flight
        cache = RowCache(f, 14, staging=staging)
        _train_cached(cache, batches, prefetch)
        assert made, "no eviction was written behind"
        values, state = cache.peek(torch.arange(64))
        assert torch.equal(values, expected[0]) and torch.equal(state, expected[1])
        cache.close()
        assert torch.equal(layout.split(f.read(cache.places_of(torch.arange(64))))[0], expected[0])


def _evicted_dirty(tmp_path, monkeypatch, fail: bool = False):
    layout = RecordLayout(40, 4, "float32", 1)
    f = RowFile.create(tmp_path / "t.rows", layout, _init(layout))
    made = _slow_writes(monkeypatch, f, 0.3, fail)
    cache = RowCache(f, 2, staging=2)
    slot = cache.resolve(torch.tensor([9]))
    cache.values[slot] = 42.0
    cache.mark_dirty(slot)
    cache.resolve(torch.tensor([10, 11]))  # evicts row 9: its write is in flight for 0.3 s
    return f, cache, made


def test_a_row_written_behind_and_missed_again_is_read_after_its_write(tmp_path, monkeypatch):
    f, cache, made = _evicted_dirty(tmp_path, monkeypatch)
    assert made == [1] and cache.behind.pending is not None
    assert torch.equal(cache.values[cache.resolve(torch.tensor([9]))], torch.full((1, 4), 42.0))
    cache.close()
    f.close()


@pytest.mark.usefixtures("unmapped_files")
def test_a_read_ahead_started_during_a_write_reads_after_it(tmp_path, monkeypatch):
    f, cache, _ = _evicted_dirty(tmp_path, monkeypatch)
    assert cache.stage(torch.tensor([9]), limit=4) == 1  # issued after the write: waits for it
    assert torch.equal(cache.layout.split(cache._staged[-1].records)[0], torch.full((1, 4), 42.0))
    slot = cache.resolve(torch.tensor([9]))
    assert cache.stats.prefetched == 1 and torch.equal(cache.values[slot], torch.full((1, 4), 42.0))
    cache.close()
    f.close()


def test_a_read_ahead_under_way_when_a_write_starts_is_read_again(tmp_path, monkeypatch):
    layout = RecordLayout(40, 4, "float32", 1)
    with RowFile.create(tmp_path / "t.rows", layout, _init(layout)) as f:
        _slow_writes(monkeypatch, f, 0.05)
        cache = RowCache(f, 2, staging=2)
        batches = [torch.tensor([9]), torch.tensor([10, 11]), torch.tensor([9])]
        for step, ids in enumerate(Prefetcher(batches, lambda ids: [(cache, ids)])):
            slots = cache.resolve(ids)
            if step == 0:
                cache.values[slots] = 42.0
                cache.mark_dirty(slots)
            if step == 2:  # row 9 was staged before its write-back started: stale, read again after it
                assert torch.equal(cache.values[slots], torch.full((1, 4), 42.0))
        cache.close()


def test_a_failed_write_behind_is_raised_by_every_later_use_and_the_file_stays_unclean(tmp_path, monkeypatch):
    f, cache, _ = _evicted_dirty(tmp_path, monkeypatch, fail=True)
    for use in (lambda: cache.resolve(torch.tensor([12])), lambda: cache.peek(torch.tensor([9])), cache.flush):
        with pytest.raises(BackingFileError, match=r"earlier write-back .* failed .*Input/output error.*checkpoint"):
            use()
    with pytest.raises(BackingFileError, match="earlier write-back"):
        cache.close()
    path = f.path
    os.close(f.fd)  # the process ends without a clean close
    f.fd = -1
    with pytest.raises(BackingFileError, match="not closed cleanly"):
        RowFile.open(path)
