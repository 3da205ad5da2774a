"""The record log: changed rows written back in sequence into a file's free records, and the free ones
reclaimed by cleaning (``RecordLog``).

Checked against training in memory (every row and its state, bitwise) over random tables, caches,
segments and spare room, with the log's own accounting checked against the file: each row held
by exactly one record, that record's owner naming it, and each segment's live count the number
of rows it holds.
"""

from __future__ import annotations

import json
import os
import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import shardvar
from helpers import TIERED_ROWS, tiered_bag, train_bags
from shardvar import ShardvarTypeError, ShardvarValueError
from shardvar.tiered import RecordLayout, RowCache, RowFile
from shardvar.tiered._header import HEADER
from shardvar.tiered._log import MIN_SEGMENTS, SEGMENT, RecordLog, segment_for, spare_records
from test_tiered_engine import _batches, _init, _train_cached, _train_in_memory


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 1 << 26), st.sampled_from([0.0, 0.001, 0.25, 0.5, 1.0, 3.0]))
def test_spare_records_are_whole_segments_and_at_least_the_fraction(rows, fraction):
    spare, segment = spare_records(rows, fraction), segment_for(rows)
    if fraction == 0 or rows == 0:
        assert spare == 0
        return
    assert (rows + spare) % segment == 0 and 8 <= segment <= SEGMENT
    assert spare >= max(rows * fraction, MIN_SEGMENTS * segment)
    assert spare < max(rows * fraction, MIN_SEGMENTS * segment) + segment
    RecordLog(RecordLayout(rows, 1, "float32", 0, spare))  # a log accepts it


def _check_log(cache: RowCache, f: RowFile) -> torch.Tensor:
    """The log's accounting against the file; returns where each row is."""
    rows, layout = f.layout.rows, f.layout
    places = cache.places_of(torch.arange(rows))
    assert places.unique().numel() == rows and int(places.max()) < layout.places  # one record a row
    assert torch.equal(f.read_owners(places), torch.arange(rows))  # and it names its row
    if cache.log is not None:
        live = torch.bincount(places // cache.log.segment, minlength=cache.log.live.numel()).to(torch.int32)
        assert torch.equal(cache.log.live, live)
        free = cache.log.free
        assert bool((cache.log.live[free] == 0).all()) and bool(cache.log.open[free].all())
    return places


@settings(max_examples=25, deadline=None)
@given(
    st.integers(8, 60),  # rows
    st.sampled_from([1, 2, 3, 4, 8]),  # records a segment
    st.integers(MIN_SEGMENTS, 9),  # spare segments
    st.integers(0, 10_000),  # seed
    st.booleans(),  # prefetch
    st.sampled_from(["lru", "lfu"]),
    st.sampled_from([None, 1, 3]),  # staging and write-behind records: fewer than a batch's, or a segment's
)
def test_training_through_the_log_equals_training_in_memory(tmp_path_factory, rows, segment, spare, seed, prefetch,
                                                            policy, staging):  # fmt: skip
    extra = -rows % segment + spare * segment  # the file a whole number of segments
    layout = RecordLayout(rows, 2, "float32", 1, extra)
    size = max(1, rows // 8)
    batches = _batches(rows, 30, size, seed=seed)
    capacity = int(torch.randint(size, rows + 1, (1,), generator=torch.Generator().manual_seed(seed)))
    expected = _train_in_memory(layout, batches)
    path = tmp_path_factory.mktemp("log") / "t.rows"
    with RowFile.create(path, layout, _init(layout)) as f:
        cache = RowCache(f, capacity, policy, staging=staging, segment=segment)
        _train_cached(cache, batches, prefetch)
        values, state = cache.peek(torch.arange(rows))
        assert torch.equal(values, expected[0]) and torch.equal(state, expected[1])
        cache.flush()
        places = _check_log(cache, f)
        values, state = layout.split(f.read(places))
        assert torch.equal(values, expected[0]) and torch.equal(state, expected[1])
        assert cache.moved == bool((places != torch.arange(rows)).any())


def _runs(places: torch.Tensor) -> int:
    return int((places.diff() != 1).sum()) + 1 if places.numel() else 0


@pytest.mark.parametrize("log", [True, False])
def test_write_backs_go_out_as_runs_of_whole_segments(tmp_path, monkeypatch, log):
    """Through the log a step's write-backs are a few runs of consecutive records (the head's rest, then whole
    free segments); back to their own records, about one run each."""
    rows, segment = 4096, 64
    layout = RecordLayout(rows, 2, "float32", 1, 2 * rows if log else 0)
    batches = _batches(rows, 20, 400, seed=3)
    with RowFile.create(tmp_path / "t.rows", layout, _init(layout)) as f:
        writes, write = [], f.write_from
        monkeypatch.setattr(
            f, "write_from", lambda places, records: (writes.append(places.clone()), write(places, records))
        )
        cache = RowCache(f, 300, segment=segment)
        _train_cached(cache, batches, prefetch=False)
        written = [p for p in writes if p.numel() >= 100]
        assert written and cache.stats.relocated == 0  # (the spare records were never all used)
        for places in written:
            if log:
                assert _runs(places) <= 2 + places.numel() // segment and int(places.min()) >= rows
            else:
                assert _runs(places) > places.numel() // 2


def test_cleaning_chooses_the_segments_with_fewest_live_records_first():
    log = RecordLog(RecordLayout(64, 2, "float32", 0, 16), segment=4)  # segments 16-19 free (open)
    log.live[:16] = torch.tensor([4, 3, 0, 4, 2, 4, 4, 1, 4, 4, 4, 4, 4, 4, 4, 4], dtype=torch.int32)
    assert log._victims(4).tolist() == [2]  # no live record: a whole segment at no cost
    assert log._victims(5).tolist() == [2, 7]  # then one live record: 4 + 3 places
    assert log._victims(8).tolist() == [2, 7, 4]
    assert log._victims(100).tolist() == [2, 7, 4, 1]  # every segment that frees anything; never a free one
    assert log.room() == 16 and log.room(moving=True) == 16
    places = log.claim(6)
    assert places.tolist() == list(range(64, 70)) and log.room() == 10 and log.room(moving=True) == 8
    assert log.claim(3, moving=True).tolist() == [72, 73, 74]  # a segment of its own
    assert log.claim(2).tolist() == [70, 71] and log.claim(1).tolist() == [76]  # the head's rest, then the next


def test_a_tiered_table_gets_spare_records_and_a_closed_file_with_moved_rows_is_refused(tmp_path):
    torch.manual_seed(0)
    ref = shardvar.ShardedEmbeddingBag(TIERED_ROWS, 4, mode="sum", sparse=True)
    tiered = tiered_bag(tmp_path)
    for m in (ref, tiered):
        shardvar.optim.fuse(shardvar.optim.RowWiseAdagrad(m, lr=0.1))
        train_bags(m, steps=30, seed=4)
    layout = tiered.tier.layout
    assert layout.spare >= TIERED_ROWS // 2 and tiered.tier.cache.log is not None
    assert tiered.cache_stats()["relocated"] > 0  # the log was cleaned
    values, _ = tiered.tier.peek(torch.arange(TIERED_ROWS))
    assert torch.equal(values, ref.weight.to_tensor())
    path = tiered.tier.file.path
    assert os.path.getsize(path) == layout.file_bytes
    tiered.close()
    header = json.loads(path.read_bytes()[8:HEADER].decode())
    assert header["clean"] and not header["ordered"]
    with RowFile.open(path) as f, pytest.raises(ShardvarValueError, match=r"not in row order.*not a checkpoint"):
        RowCache(f, 4)


def test_a_file_from_before_spare_records_writes_back_in_place(tmp_path):
    """A header without ``spare`` (files made before the log) reads as none: rows go back to their own records."""
    layout = RecordLayout(40, 2, "float32", 1)
    path = tmp_path / "t.rows"
    RowFile.create(path, layout, _init(layout)).close()
    raw = bytearray(path.read_bytes()[:HEADER])
    meta = json.loads(raw[8:].decode())
    del meta["spare"], meta["ordered"]
    raw[8:] = json.dumps(meta).encode().ljust(HEADER - 8, b" ")
    with open(path, "r+b") as out:
        out.write(raw)
    batches = _batches(40, 20, 6, seed=2)
    expected = _train_in_memory(layout, batches)
    with RowFile.open(path) as f:
        cache = RowCache(f, 8)
        assert f.layout.spare == 0 and cache.log is None
        _train_cached(cache, batches, prefetch=False)
        cache.flush()
        assert not cache.moved and torch.equal(cache.places_of(torch.arange(40)), torch.arange(40))
        assert torch.equal(layout.split(f.read(torch.arange(40)))[0], expected[0])


@pytest.mark.parametrize("spare", [0, 0.1, 2.0])
def test_tiered_spare_sets_the_free_records(tmp_path, spare):
    storage = shardvar.Tiered(tmp_path / "t.rows", cache_bytes=4096, spare=spare)
    emb = shardvar.ShardedEmbedding(1000, 4, storage=storage)
    layout = emb.tier.layout
    assert layout.spare == spare_records(1000, spare) and (layout.spare == 0) == (spare == 0)
    assert (emb.tier.cache.log is None) == (spare == 0)
    emb.tier.close()


@pytest.mark.parametrize("bad, error", [(-0.5, ShardvarValueError), (17, ShardvarValueError),
                                        ("half", ShardvarTypeError), (float("nan"), ShardvarValueError)])  # fmt: skip
def test_a_bad_spare_is_refused(tmp_path, bad, error):
    with pytest.raises(error, match="spare"):
        shardvar.Tiered(tmp_path / "t.rows", cache_bytes=4096, spare=bad)
    assert not list(tmp_path.iterdir())


def test_a_log_needs_whole_segments_and_room(tmp_path):
    with pytest.raises(ShardvarValueError, match="whole segments of 8 records and at least 4 spare"):
        RecordLog(RecordLayout(60, 2, "float32", 0, 20), segment=8)
    with pytest.raises(ShardvarValueError, match="at least 4 spare"):
        RecordLog(RecordLayout(64, 2, "float32", 0, 24), segment=8)


@pytest.mark.usefixtures("unmapped_files")
def test_a_read_ahead_waits_only_for_a_write_of_its_own_records(tmp_path, monkeypatch):
    """A read ahead started while a write-back is in flight reads at once unless that write writes one of its
    records (a row just written back through the log): then it reads after it, and gets the written row."""
    layout = RecordLayout(64, 2, "float32", 1, 32)
    with RowFile.create(tmp_path / "t.rows", layout, _init(layout)) as f:
        cache = RowCache(f, 8, segment=4)
        slots = cache.resolve(torch.arange(8))
        cache.values[slots] += 1.0
        cache.mark_dirty(slots)
        gate, write = threading.Event(), f.write_from

        def held_back(places, records):  # the write-behind thread's write waits for the gate
            if threading.current_thread().name.startswith("shardvar-write-behind"):
                gate.wait(10)
            write(places, records)

        monkeypatch.setattr(f, "write_from", held_back)
        cache.resolve(torch.arange(8, 16))  # evicts rows 0-7: written through the log, held back
        assert not cache.behind.pending.done()
        waits, wait = [], cache.behind.wait
        monkeypatch.setattr(cache.behind, "wait", lambda pending=None: (waits.append(pending), wait(pending))[1])
        assert cache.stage(torch.arange(20, 24), limit=8) == 4 and waits == []  # not among the written records
        threading.Timer(0.2, gate.set).start()
        assert cache.stage(torch.arange(0, 4), limit=8) == 4 and len(waits) == 1  # rows written back right now
        taken = cache.stats.prefetched
        values = cache.values[cache.resolve(torch.arange(0, 4))]
        assert cache.stats.prefetched == taken + 4  # from the read ahead, read after the write
        assert torch.equal(values, _init(layout)(torch.arange(4))[0] + 1.0)
