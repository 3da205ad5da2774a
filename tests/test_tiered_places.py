"""Changed rows written back through the file's log, and the file put back in row order.

Where the cache keeps a place per row and the file has spare records, an evicted changed row is
written into the next free record of the file (``RecordLog``), not its own; the file's records are
then out of row order. A checkpoint (or anything else that maps the file) first has them rewritten
in row order, and nothing else sees the difference: lookups, training, saves and loads give what
an in-memory table gives.
"""

from __future__ import annotations

import contextlib
import functools
import os
import subprocess
import sys

import pytest
import torch

import shardvar
from helpers import TIERED_ROWS, tiered_bag, train_bags
from shardvar import optim
from shardvar.tiered import BackingFileError
from test_tiered_load_atomic import _lookups, _mount_tmpfs, _same, _snapshot

ROWS = TIERED_ROWS
_train = functools.partial(train_bags, steps=8, seed=2)
# rows move through the log only while the file is not mapped for writes (a file the page cache holds is)
pytestmark = pytest.mark.usefixtures("unmapped_files")


def _pair(tmp_path, **kwargs):
    torch.manual_seed(0)
    ref = shardvar.ShardedEmbeddingBag(ROWS, 4, mode="sum", sparse=True)
    tiered = tiered_bag(tmp_path, **kwargs)
    opts = [optim.RowWiseAdagrad(m, lr=0.1) for m in (ref, tiered)]
    for o in opts:
        optim.fuse(o)
    return ref, tiered, opts


def _file_rows(tiered) -> tuple[torch.Tensor, torch.Tensor]:
    """The backing file's records read in row order, as they lie (not through the cache's places)."""
    tier = tiered.tier
    return tier.layout.split(tier.file.read(torch.arange(ROWS)))


def test_training_moves_rows_and_a_save_puts_them_back_in_order(tmp_path):
    ref, tiered, opts = _pair(tmp_path)
    for m in (ref, tiered):
        _train(m)
    cache = tiered.tier.cache
    assert cache.moved, "no changed row was written through the log"
    places = cache.places_of(torch.arange(ROWS))
    assert places.unique().numel() == ROWS and bool((places >= ROWS).any())  # one record a row, some spare ones
    held = cache.key.clone()
    shardvar.save({"model": tiered, "opt": opts[1]}, tmp_path / "ckpt")
    assert not tiered.tier.cache.moved and torch.equal(tiered.tier.cache.key, held)  # the cache kept its rows
    assert torch.equal(_file_rows(tiered)[0], ref.weight.to_tensor())  # record i is row i again
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "t.rows"]
    target = shardvar.ShardedEmbeddingBag(ROWS, 4, 3, "mod", mode="sum", sparse=True)
    shardvar.load({"model": target}, tmp_path / "ckpt")
    assert torch.equal(target.weight.to_tensor(), ref.weight.to_tensor())
    for m in (ref, tiered):  # training goes on over the rewritten file, exactly
        _train(m, seed=5)
    assert tiered.tier.cache.moved
    values, state = tiered.tier.peek(torch.arange(ROWS))
    assert torch.equal(values, ref.weight.to_tensor())
    assert torch.equal(state[:, 0], opts[0].sharded_variables()["weight/sum"].join())


def test_a_load_into_a_table_whose_rows_moved_keeps_what_the_checkpoint_does_not_hold(tmp_path):
    torch.manual_seed(3)
    saved = shardvar.ShardedEmbeddingBag(ROWS, 4, mode="sum", sparse=True)
    shardvar.save({"model": saved}, tmp_path / "ckpt")
    _, tiered, _ = _pair(tmp_path)
    _train(tiered)
    assert tiered.tier.cache.moved
    state = tiered.tier.peek(torch.arange(ROWS))[1]
    shardvar.load({"model": tiered}, tmp_path / "ckpt")  # the rows only: the state stays, each with its row
    values, after = tiered.tier.peek(torch.arange(ROWS))
    assert torch.equal(values, saved.weight.to_tensor()) and torch.equal(after, state)
    assert not tiered.tier.cache.moved and torch.equal(_file_rows(tiered)[1], state)


def test_a_table_whose_cache_keeps_no_place_per_row_never_moves_a_row(tmp_path, monkeypatch):
    from shardvar.tiered import _cache
    from shardvar.tiered._slots import HashedSlots

    monkeypatch.setattr(_cache, "slot_index", lambda rows, capacity: HashedSlots(capacity))
    ref, tiered, _ = _pair(tmp_path)
    for m in (ref, tiered):
        _train(m)
    tiered.tier.flush()
    assert not tiered.tier.cache.moved and torch.equal(_file_rows(tiered)[0], ref.weight.to_tensor())


def test_a_disk_too_full_to_put_the_rows_in_order_refuses_the_save_and_changes_nothing(tmp_path):
    """A real ENOSPC: the file fits its small filesystem once, not twice; room made, the same save works."""
    disk = tmp_path / "disk"
    disk.mkdir()
    _mount_tmpfs(disk, "16k")  # room for the optimizer's widening (a second copy beside the file) only
    tiered = None
    try:
        ref, tiered, opts = _pair(disk)
        subprocess.run(["mount", "-o", "remount,size=12k", str(disk)], check=True)  # 3 pages: the file takes 2
        for m in (ref, tiered):
            _train(m)
        tiered.tier.flush()  # (a save writes changed rows back first: done here, so the bytes can be compared)
        assert tiered.tier.cache.moved
        looked, before = _lookups(tiered), _snapshot(tiered)
        with pytest.raises(BackingFileError, match=r"out of row order.*needs room for a second copy.*No space left"):
            shardvar.save({"model": tiered, "opt": opts[1]}, tmp_path / "ckpt")
        _same(_snapshot(tiered), before)
        assert torch.equal(_lookups(tiered), looked)
        assert sorted(p.name for p in disk.iterdir()) == ["t.rows"]
        subprocess.run(["mount", "-o", "remount,size=64k", str(disk)], check=True)
        shardvar.save({"model": tiered, "opt": opts[1]}, tmp_path / "ckpt")
        target = shardvar.ShardedEmbeddingBag(ROWS, 4, mode="sum", sparse=True)
        shardvar.load({"model": target}, tmp_path / "ckpt")
        assert torch.equal(target.weight.to_tensor(), ref.weight.to_tensor())
    finally:
        if tiered is not None:
            tiered.close()
        subprocess.run(["umount", "--lazy", str(disk)], check=False)


@pytest.mark.parametrize("log", [True, False])
def test_write_backs_to_a_file_on_the_disk_are_sent_at_once_and_training_stays_exact(tmp_path, monkeypatch, log):
    """When reads show the file is on the disk (``disk_bound``), each write-behind starts the write-out of what
    it wrote (``RowFile.send``), and one into rows' own records first asks for the pages it writes into
    (``RowFile.will_need``: the log's writes fill new pages, none to read); the rows are those of training in
    memory."""
    from shardvar.tiered import RecordLayout, RowCache, RowFile
    from shardvar.tiered._log import RecordLog
    from test_tiered_engine import _batches, _init, _train_cached, _train_in_memory

    layout = RecordLayout(64, 3, "float32", 1, spare=16)
    batches = _batches(64, 40, 12, seed=1)
    expected = _train_in_memory(layout, batches)
    with RowFile.create(tmp_path / "t.rows", layout, _init(layout)) as f:
        sent, send, asked, will_need = [], f.send, [], f.will_need
        monkeypatch.setattr(f, "send", lambda: (sent.append(1), send()))
        monkeypatch.setattr(f, "will_need", lambda ids, owners=False: (asked.append(ids.clone()), will_need(ids)))
        monkeypatch.setattr(RecordLog, "foresee", lambda *a: None)  # (the next test's)
        f.disk_bound = True  # (small reads never reset it)
        cache = RowCache(f, 14, segment=4, relocate=log)
        _train_cached(cache, batches, prefetch=True)
        # through the log, only the write-backs it had no room for ask for their pages
        assert sent and cache.moved == log and (len(asked) < len(sent) if log else len(asked) == len(sent))
        values, state = cache.peek(torch.arange(64))
        assert torch.equal(values, expected[0]) and torch.equal(state, expected[1])


def test_a_read_ahead_asks_for_what_the_next_cleaning_reads(tmp_path, monkeypatch):
    """On the disk, reading ahead asks the kernel for the records and owners of the segments the log cleans next
    (``RecordLog.foresee``), so that step's thread finds them in the page cache; training stays exact."""
    from shardvar.tiered import RecordLayout, RowCache, RowFile
    from shardvar.tiered._log import RecordLog
    from test_tiered_engine import _adagrad, _batches, _init, _train_in_memory

    layout = RecordLayout(64, 3, "float32", 1, spare=32)  # (cleaning ahead by a segment: one cleaning a step)
    batches = _batches(64, 40, 12, seed=1)
    expected = _train_in_memory(layout, batches)
    with RowFile.create(tmp_path / "t.rows", layout, _init(layout)) as f:
        asked, will_need, cleaned, clean = {False: set(), True: set()}, f.will_need, [], RecordLog._clean
        monkeypatch.setattr(f, "will_need", lambda ids, owners=False: (asked[owners].update(ids.tolist()),
                                                                       will_need(ids, owners=owners)))  # fmt: skip
        monkeypatch.setattr(
            RecordLog, "_clean", lambda log, seg, c: (cleaned.append(log._places(seg)), clean(log, seg, c))
        )
        cache, read, foreseen = RowCache(f, 14, segment=4), 0, 0
        for step, ids in enumerate(batches):
            f.disk_bound = True  # (small reads never reset it)
            for owners in (False, True):
                asked[owners].clear()
            cache.stage(ids, 64)
            cleaned.clear()
            slots = cache.resolve(torch.unique(ids))
            if cleaned:  # the first group; later ones follow from the moves of the first (not foreseen)
                assert set(cleaned[0].tolist()) <= asked[False] and set(cleaned[0].tolist()) <= asked[True], step
            read, foreseen = (
                read + sum(c.numel() for c in cleaned),
                foreseen + sum(len(set(c.tolist()) & asked[False]) for c in cleaned),
            )
            grad = torch.sin(cache.values[slots] * (step + 1))
            v, s = cache.values[slots], cache.state[slots]
            _adagrad(v, s, grad)
            cache.values[slots], cache.state[slots] = v, s
            cache.mark_dirty(slots)
        assert cache.stats.relocated > 0 and foreseen * 4 >= read * 3  # (most: here 256 of 300 records)
        values, state = cache.peek(torch.arange(64))
        assert torch.equal(values, expected[0]) and torch.equal(state, expected[1])


def test_saves_inside_a_prefetching_loop_never_read_a_replaced_file(tmp_path, monkeypatch):
    """A checkpoint every few steps of a ``Prefetcher`` loop: the save rewrites the file in row order while the
    next batch's rows may be being read ahead (reads slowed, so the race is real). The read-ahead finishes
    on the old file first or reads the new one; training equals training in memory."""
    import threading
    import time

    from shardvar.tiered import Prefetcher, RowFile

    real = RowFile.read

    def slow(self, ids):
        if threading.current_thread().name == "shardvar-prefetch":
            time.sleep(0.03)  # longer than a step: the save comes while a read-ahead is in the file
        return real(self, ids)

    monkeypatch.setattr(RowFile, "read", slow)
    ref, tiered, opts = _pair(tmp_path)
    g = torch.Generator().manual_seed(11)
    batches = [(torch.rand(8, generator=g) ** 2 * ROWS).long() for _ in range(24)]
    offsets = torch.tensor([0, 3, 5])
    reordered = 0
    for step, ids in enumerate(Prefetcher(batches, lambda b: [(tiered.cache, b)])):
        for m in (ref, tiered):
            m(ids, offsets).square().sum().backward()
        if step % 3 == 2:
            reordered += tiered.tier.cache.moved
            shardvar.save({"model": tiered, "opt": opts[1]}, tmp_path / f"ckpt{step}")
            assert not tiered.tier.cache.moved
    assert reordered >= 4  # most saves rewrote the file under a running read-ahead
    values, state = tiered.tier.peek(torch.arange(ROWS))
    assert torch.equal(values, ref.weight.to_tensor())
    assert torch.equal(state[:, 0], opts[0].sharded_variables()["weight/sum"].join())
    target = shardvar.ShardedEmbeddingBag(ROWS, 4, mode="sum", sparse=True)
    shardvar.load({"model": target}, tmp_path / "ckpt23")
    assert torch.equal(target.weight.to_tensor(), ref.weight.to_tensor())


def test_a_table_closed_by_the_garbage_collector_joins_no_thread(tmp_path, monkeypatch):
    """The finalizer of a tiered table may run inside any allocation, also inside a thread's start while
    threading holds its own lock (a join there deadlocks): it lets its threads go without joining them."""
    import gc
    from concurrent.futures import ThreadPoolExecutor

    waits = []
    shutdown = ThreadPoolExecutor.shutdown

    def recorded(self, wait=True, **kwargs):
        waits.append(wait)
        return shutdown(self, wait=wait, **kwargs)

    ref, tiered, opts = _pair(tmp_path)
    _train(tiered)  # its write-behind and I/O threads started
    assert tiered.tier.cache.behind._pool is not None
    tiered.self_cycle = tiered  # garbage only the collector finds
    monkeypatch.setattr(ThreadPoolExecutor, "shutdown", recorded)
    del ref, tiered, opts
    gc.collect()
    assert waits and not any(waits), waits
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.rows"]
    from shardvar.tiered import RowFile

    RowFile.open(tmp_path / "t.rows").close()  # closed cleanly all the same


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mincore and posix_fadvise are Linux's here")
def test_asking_for_records_brings_their_pages_in_and_changes_no_byte(tmp_path):
    """``RowFile.will_need`` reads the pages of the records asked for (a record across two pages: both), and only
    those, into the page cache, without waiting; every record reads back as it was."""
    from shardvar.tiered import RecordLayout, RowFile
    from shardvar.tiered._file import HEADER

    layout = RecordLayout(4096, 64, "float32", 1)  # 264-byte records: some cross a page boundary
    with RowFile.create(tmp_path / "t.rows", layout, _random_rows) as f:
        before = f.read(torch.arange(layout.rows))
        f.settle()  # out of the page cache
        asked = torch.tensor([0, 15, 16, 17, 1000, 4095])  # 15 crosses pages 1 and 2 of the records
        f.will_need(asked)
        f.will_need(asked[:0])  # nothing asked: nothing done
        rb = layout.record_bytes
        pages = {p for i in asked.tolist() for p in ((HEADER + i * rb) // 4096, (HEADER + (i + 1) * rb - 1) // 4096)}
        for page in sorted(pages):
            assert _cached(f.fd, page), f"page {page} was not read in"
        far = (HEADER + 3000 * rb) // 4096
        assert far not in pages and not _cached(f.fd, far, tries=1)
        assert torch.equal(f.read(torch.arange(layout.rows)), before)


def _random_rows(ids):
    g = torch.Generator().manual_seed(int(ids[0]))
    return torch.randn(ids.numel(), 64, generator=g), torch.rand(ids.numel(), 1, generator=g)


def _cached(fd: int, page: int, tries: int = 200) -> bool:
    """Whether the page cache holds ``page`` of ``fd`` (``mincore`` of a map of it, which reads nothing in: a
    read that may not wait would start reading the page), polled while a read is in flight."""
    import ctypes
    import mmap
    import time

    import numpy as np

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p)
    view = mmap.mmap(fd, 4096, offset=page * 4096, access=mmap.ACCESS_READ)
    try:
        address, vec = np.frombuffer(view, dtype=np.uint8).ctypes.data, ctypes.create_string_buffer(1)
        for _ in range(tries):
            assert libc.mincore(address, 4096, vec) == 0, os.strerror(ctypes.get_errno())
            if vec.raw[0] & 1:
                return True
            time.sleep(0.005)
        return False
    finally:
        view.close()


def test_a_table_collected_inside_its_own_write_back_is_let_go_not_waited_for(tmp_path, monkeypatch):
    """The collector may run a dropped table's finalizer on that table's own write-behind thread, inside its
    write: the finalizer cannot wait for that write. It lets the file go unclean (as after a crash)."""
    import threading
    import time

    from shardvar.tiered import RowFile

    _, tiered, _ = _pair(tmp_path)
    _train(tiered, steps=2)
    tier = tiered.tier
    real, took = tier.file.write_from, []

    def collected_inside(places, records):
        if threading.current_thread().name.startswith("shardvar-write-behind") and not took:
            start = time.monotonic()
            tier._closer()  # what the collector would run here
            took.append(time.monotonic() - start)
        return real(places, records)

    monkeypatch.setattr(tier.file, "write_from", collected_inside)
    done = threading.Event()

    def train() -> None:
        with contextlib.suppress(BackingFileError):  # the table was closed under the step: its file is gone
            _train(tiered, steps=6, seed=4)
        done.set()

    threading.Thread(target=train, daemon=True).start()
    assert done.wait(30), "a finalizer run inside the table's own write-back waited for that write"
    assert took and took[0] < 5
    with pytest.raises(BackingFileError, match="not closed cleanly"):
        RowFile.open(tmp_path / "t.rows")
