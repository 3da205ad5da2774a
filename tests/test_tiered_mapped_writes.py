"""Writes through the mapping of a backing file the page cache holds (``tiered/_mapped.py``): the same bytes as
``pwrite``, only into a file with no holes, and a cache that writes each row back to its own place meanwhile."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import shardvar.tiered._mapped as mapped_module
from shardvar.tiered import RecordLayout, RowCache
from shardvar.tiered._header import HEADER
from shardvar.tiered._mapped import MappedRecords, _allocated
from test_tiered_engine import _batches, _train_cached, _train_in_memory
from test_tiered_mapped import _by_system_calls, _cached_file, needs_cachestat


@needs_cachestat
@settings(max_examples=30, deadline=None)
@given(st.sets(st.integers(0, 339), max_size=60), st.integers(0, 255))
def test_mapped_writes_equal_system_call_writes(tmp_path_factory, ids, fill):
    with _cached_file(tmp_path_factory.mktemp("w"), spare=40) as f:
        f.read(torch.tensor([0]))
        assert f.mapped.takes_writes
        ids = torch.tensor(sorted(ids), dtype=torch.int64)
        records = torch.arange(ids.numel() * f.layout.record_bytes).add_(fill).to(torch.uint8)
        records = records.view(-1, f.layout.record_bytes)
        before = f.mapped.scatters
        f.write_from(ids, records)
        assert f.mapped.scatters == before + (1 if ids.numel() else 0)
        assert torch.equal(_by_system_calls(f, ids), records)  # pread sees what the mapping wrote
        untouched = torch.tensor(sorted(set(range(340)) - set(ids.tolist())), dtype=torch.int64)
        f.mapped.release()
        assert torch.equal(f.read(untouched), _by_system_calls(f, untouched))


def test_a_file_with_a_hole_is_not_allocated_and_a_reserved_one_is(tmp_path):
    """A write into a hole allocates a block in the page fault, where a full disk is a SIGBUS: never mapped to write.
    Blocks reserved by ``posix_fallocate`` and never written count as allocated (a created file's spare records)."""
    sparse, reserved = tmp_path / "sparse", tmp_path / "reserved"
    with open(sparse, "wb") as raw:
        raw.truncate(1 << 20)
    fds = [os.open(sparse, os.O_RDWR), os.open(reserved, os.O_RDWR | os.O_CREAT)]
    try:
        os.posix_fallocate(fds[1], 0, 1 << 20)
        assert not _allocated(fds[0]) and _allocated(fds[1])
        os.pwrite(fds[0], b"\1" * (1 << 20), 0)
        assert _allocated(fds[0])
    finally:
        for fd in fds:
            os.close(fd)


@needs_cachestat
def test_a_file_that_may_have_holes_is_mapped_for_reads_only(tmp_path, monkeypatch):
    monkeypatch.setattr(mapped_module, "_allocated", lambda *a: False)
    with _cached_file(tmp_path) as f:
        f.read(torch.tensor([0]))
        assert f.mapped.active and not f.mapped.takes_writes
        records = torch.full((2, f.layout.record_bytes), 9, dtype=torch.uint8)
        f.write_from(torch.tensor([3, 4]), records)  # by pwrite, which the mapping sees
        assert f.mapped.active and f.mapped.scatters == 0 and torch.equal(f.read(torch.tensor([3, 4])), records)


@needs_cachestat
def test_a_file_opened_for_reading_is_mapped_for_reads_only(tmp_path):
    with _cached_file(tmp_path) as f:
        fd = os.open(f.path, os.O_RDONLY)
        try:
            mapped = MappedRecords(fd, HEADER, f.layout.places, f.layout.record_bytes)
            out = torch.empty((1, f.layout.record_bytes), dtype=torch.uint8)
            assert mapped.read(torch.tensor([7]), out) and mapped.active and not mapped.takes_writes
            assert not mapped.write(torch.tensor([7]), out)
            assert torch.equal(out, _by_system_calls(f, torch.tensor([7])))
            mapped.close()
        finally:
            os.close(fd)


@needs_cachestat
@pytest.mark.parametrize("writable", [True, False])
def test_a_cache_writes_rows_back_in_place_while_the_mapping_takes_writes(tmp_path, monkeypatch, writable):
    """Mapped for writes, every row goes back to its own place (a scatter) and the log cleans nothing; mapped for
    reads only, write-backs go through the log as before. Both train exactly as in memory."""
    monkeypatch.setattr(mapped_module, "RECHECK_S", 0.0)
    if not writable:
        monkeypatch.setattr(mapped_module, "_allocated", lambda *a: False)
    layout = RecordLayout(200, 3, "float32", 1, spare=56)
    batches = _batches(200, 60, 24, seed=3)
    expected = _train_in_memory(layout, batches)
    with _cached_file(tmp_path, layout=layout) as f:
        cache = RowCache(f, 40, "lru", segment=8)
        _train_cached(cache, batches, prefetch=False)
        assert cache.stats.written_back > 0
        if writable:
            assert f.mapped.scatters > 0 and cache.stats.relocated == 0 and f.ordered
        else:
            assert f.mapped.scatters == 0 and cache.stats.relocated > 0 and not f.ordered
        values, state = cache.peek(torch.arange(200))
        assert torch.equal(values, expected[0]) and torch.equal(state, expected[1])


@needs_cachestat
@settings(max_examples=25, deadline=None)
@given(st.sets(st.integers(0, 339), max_size=40), st.randoms(use_true_random=False))
def test_rows_move_between_the_mapping_and_slots_as_records_do(tmp_path_factory, places, rnd):
    """``RowFile.move_rows``: a cache's rows from the mapped records straight into their slots (and back), the same
    values and state as the records' system-call reads and writes; unmapped, it does nothing and says so."""
    with _cached_file(tmp_path_factory.mktemp("r"), spare=40) as f:
        f.read(torch.tensor([0]))
        places = torch.tensor(sorted(places, key=lambda _: rnd.random()), dtype=torch.int64)  # any order
        slots = torch.randperm(60, generator=torch.Generator().manual_seed(rnd.randrange(99)))[: places.numel()]
        values, state = torch.zeros((60, f.layout.dim)), torch.zeros((60, f.layout.state_width))
        assert f.move_rows(places, slots, values, state, write=False)
        want_v, want_s = f.layout.split(_by_system_calls(f, places))
        assert torch.equal(values[slots], want_v) and torch.equal(state[slots], want_s)
        values.add_(1.5), state.mul_(-2)
        assert f.move_rows(places, slots, values, state, write=True)
        got_v, got_s = f.layout.split(_by_system_calls(f, places))
        assert torch.equal(got_v, values[slots]) and torch.equal(got_s, state[slots])
        f.mapped.release()
        f.mapped._next_check = float("inf")  # (not asked again here)
        assert not f.move_rows(places, slots, values, state, write=False)
        assert not f.move_rows(places, slots, values, state, write=True)
