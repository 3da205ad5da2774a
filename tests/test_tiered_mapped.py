"""Reads through a mapping of a backing file the page cache holds (``tiered/_mapped.py``), and the rules that say when."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import shardvar.tiered._mapped as mapped_module
from shardvar.tiered import BackingFileError, RecordLayout, RowCache, RowFile
from shardvar.tiered._header import HEADER
from shardvar.tiered._mapped import cached_pages
from test_tiered_engine import _batches, _init, _train_cached, _train_in_memory

needs_cachestat = pytest.mark.skipif(
    cached_pages(0, 0, 1) is None, reason="the kernel cannot say what the page cache holds (cachestat: Linux 6.5+)"
)


def _cached_file(tmp_path, rows: int = 300, spare: int = 0, layout: RecordLayout | None = None) -> RowFile:
    """A backing file whose every page the page cache holds (created files are dropped from it: read back)."""
    layout = layout or RecordLayout(rows, 5, "float32", 2, spare)
    f = RowFile.create(tmp_path / "t.rows", layout, _init(layout))
    with open(f.path, "rb") as raw:
        while raw.read(1 << 20):
            pass
    f.mapped._next_check = 0.0  # ask now
    return f


def _by_system_calls(f: RowFile, ids: torch.Tensor) -> torch.Tensor:
    f.mapped.enabled, was = False, f.mapped.enabled
    try:
        return f.read(ids)
    finally:
        f.mapped.enabled = was


@needs_cachestat
@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(0, 339), max_size=60), st.booleans())
def test_mapped_reads_equal_unmapped_files(tmp_path_factory, ids, into):
    with _cached_file(tmp_path_factory.mktemp("m"), spare=40) as f:
        f.write(torch.tensor([310, 2]), torch.full((2, f.layout.record_bytes), 7, dtype=torch.uint8))  # seen at once
        ids = torch.tensor(ids, dtype=torch.int64)
        expected = _by_system_calls(f, ids)
        before = f.mapped.gathers
        if into:
            ids = ids.unique()
            expected = _by_system_calls(f, ids)
            got = torch.empty_like(expected)
            f.read_into(ids, got)
        else:
            got = f.read(ids)
        assert torch.equal(got, expected)
        assert f.mapped.gathers == before + (1 if ids.numel() else 0)


@needs_cachestat
def test_a_file_the_page_cache_lacks_is_read_by_system_calls_and_asked_again_later(tmp_path, monkeypatch):
    layout = RecordLayout(4096, 16, "float32", 1)
    with RowFile.create(tmp_path / "t.rows", layout, _init(layout)) as f:  # created: dropped from the page cache
        f.mapped._next_check = 0.0
        f.read(torch.tensor([0, 4000]))
        assert not f.mapped.active and f.mapped.gathers == 0
        f.read(torch.arange(4096))  # now it is all there, but the next question is RECHECK_S away
        f.read(torch.tensor([5]))
        assert not f.mapped.active
        f.mapped._next_check = 0.0
        f.read(torch.tensor([5]))
        assert f.mapped.active and f.mapped.gathers == 1


@needs_cachestat
def test_major_faults_in_a_gather_release_the_mapping(tmp_path, monkeypatch):
    """The file left the page cache (what a gather's major faults say): back to system calls until the next check."""
    with _cached_file(tmp_path) as f:
        f.read(torch.tensor([1]))
        assert f.mapped.active
        faults = iter([0, 100])
        monkeypatch.setattr(mapped_module, "_major_faults", lambda: next(faults))
        expected = _by_system_calls(f, torch.arange(20))
        assert torch.equal(f.read(torch.arange(20)), expected)  # this gather's records are still right
        assert not f.mapped.active
        gathers = f.mapped.gathers
        assert torch.equal(f.read(torch.arange(20)), expected) and f.mapped.gathers == gathers


def test_reads_are_never_mapped_when_turned_off(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDVAR_MAP_FILES", "0")
    with _cached_file(tmp_path) as f:
        f.read(torch.arange(10))
        assert not f.mapped.enabled and not f.mapped.active and f.mapped.gathers == 0


def test_a_kernel_that_cannot_say_never_maps(tmp_path, monkeypatch):
    monkeypatch.setattr(mapped_module, "cached_pages", lambda *a: None)
    with _cached_file(tmp_path) as f:
        assert torch.equal(f.read(torch.arange(10)), _by_system_calls(f, torch.arange(10)))
        assert not f.mapped.enabled and f.mapped.gathers == 0


@needs_cachestat
def test_closing_unmaps_and_a_closed_file_still_refuses_reads(tmp_path):
    f = _cached_file(tmp_path)
    f.read(torch.tensor([3]))
    assert f.mapped.active
    f.close()
    assert not f.mapped.active and not f.mapped.enabled
    with pytest.raises(Exception, match="closed"):
        f.read(torch.tensor([3]))


@needs_cachestat
@pytest.mark.parametrize("prefetch", [False, True])
def test_training_over_a_mapped_file_equals_training_in_memory(tmp_path, monkeypatch, prefetch):
    """Every read checks (``RECHECK_S`` 0), so reads go through the mapping from the first step the file is cached,
    and write-backs too (``test_tiered_mapped_writes``: with and without writes through it)."""
    monkeypatch.setattr(mapped_module, "RECHECK_S", 0.0)
    layout = RecordLayout(200, 3, "float32", 1, spare=56)
    batches = _batches(200, 60, 24, seed=3)
    expected = _train_in_memory(layout, batches)
    with _cached_file(tmp_path, layout=layout) as f:
        cache = RowCache(f, 40, "lru", segment=8)
        _train_cached(cache, batches, prefetch)
        assert f.mapped.gathers > 0 and f.mapped.scatters > 0
        values, state = cache.peek(torch.arange(200))
        assert torch.equal(values, expected[0]) and torch.equal(state, expected[1])


def test_cleaning_runs_ahead_of_what_a_step_needs(tmp_path):
    """Once the log cleans, it frees a staging area's worth of places more than asked (at most an eighth of the
    spare ones), so it cleans every few steps in large groups; asked for no more than it has, it cleans nothing."""
    layout = RecordLayout(256, 2, "float32", 1, spare=256)
    with RowFile.create(tmp_path / "t.rows", layout, _init(layout)) as f:
        cache = RowCache(f, 64, "lru", segment=8, staging=16)
        log = cache.log
        for ids in _batches(256, 40, 40, seed=5):  # until the log has cleaned: its free places are few
            slots = cache.resolve(ids)
            cache.mark_dirty(slots)
        assert cache.stats.relocated > 0
        reserve, ahead = 2 * log.segment, 16  # min(staging, 256 // 8), whole segments
        moved = cache.stats.relocated
        assert log.make_room(log.room() - reserve, cache) == log.room() - reserve and cache.stats.relocated == moved
        n = log.room() - reserve + 1
        assert log.make_room(n, cache) == n
        assert log.room() >= n + reserve + ahead and cache.stats.relocated > moved


@needs_cachestat
def test_nothing_is_read_ahead_while_reads_are_gathers(tmp_path):
    """Reading ahead a file the page cache holds costs more than it saves; released, the mapping reads ahead again."""
    with _cached_file(tmp_path) as f:
        cache = RowCache(f, 50, "lru", reserve=40)
        cache.resolve(torch.arange(10))
        assert f.mapped.active
        assert cache.stage(torch.arange(100, 120), limit=20) == 0 and cache.staged_rows == 0
        f.mapped.release()
        assert cache.stage(torch.arange(100, 120), limit=20) == 20 and cache.staged_rows == 20
        cache.resolve(torch.arange(100, 120))
        assert cache.stats.prefetched == 20


@needs_cachestat
def test_a_file_cut_short_under_the_mapping_raises_instead_of_crashing(tmp_path):
    """Another process truncating the file (a hostile act: the file is locked) gets the system calls' clear error,
    not a SIGBUS from a gather past the file's end."""
    with _cached_file(tmp_path) as f:
        f.read(torch.tensor([1]))
        assert f.mapped.active
        os.truncate(f.path, HEADER + 10 * f.layout.record_bytes)
        with pytest.raises(BackingFileError, match="backing file"):
            f.read(torch.tensor([200]))
        assert not f.mapped.active
        f.discard()
