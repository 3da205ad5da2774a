"""The cache's native bookkeeping (``tiered/_slots_native.py``) against its torch path.

The native select gives exactly what sorting by (value, position) gives, skipped positions counted
as their given value; the native look-up gives the torch ops' slots and hits and undoes what it
marked; and two caches run over the same batches, one through the kernels and one through torch,
stay equal in every slot, step, statistic and refusal (ties, rows kept for a batch in flight,
batches that do not fit, a direct map of int64). Without the kernels the torch path is taken.
"""

from __future__ import annotations

import contextlib
import copy
import tempfile
from pathlib import Path
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import shardvar._native as native
import shardvar.tiered._cache as cache_module
from shardvar import ShardvarValueError
from shardvar.tiered import RecordLayout, RowCache, RowFile, _slots_native
from shardvar.tiered._log import spare_records
from shardvar.tiered._slots import DirectSlots, smallest


@pytest.fixture(scope="module")
def kernel():
    found = _slots_native.kernel()
    if found is None:
        if native.compiler_command() is None or not native.enabled():
            pytest.skip("no native kernel here (no C compiler, or SHARDVAR_NATIVE=0)")
        _slots_native.built()  # a compiler is here, so the kernel must be: this raises why it is not
        raise AssertionError("the kernel builds, yet did not load")
    return found


@contextlib.contextmanager
def _torch_path():
    """The torch path for what runs inside (the kernels' loader answers None)."""
    real = _slots_native.kernel
    _slots_native.kernel = lambda: None
    try:
        yield
    finally:
        _slots_native.kernel = real


@settings(max_examples=100, deadline=None)
@given(
    values=st.lists(st.integers(0, 40), min_size=1, max_size=300),
    spread=st.sampled_from([1, 1 << 14, 1 << 20, 1 << 40]),
    wide=st.booleans(),
    data=st.data(),
)
def test_the_native_select_is_what_sorting_gives(kernel, values, spread, wide, data):
    if not wide:
        spread = min(spread, 1 << 20)
    values = [v * spread for v in values]  # ties, and spans wider than one pass of the select
    n = len(values)
    skip = sorted(data.draw(st.sets(st.integers(0, n - 1), max_size=n)))
    masked = data.draw(st.sampled_from([0, 40 * spread + 1, 7 * spread]))
    above = data.draw(st.integers(0, 41)) * spread
    seen = [masked if i in set(skip) else v for i, v in enumerate(values)]
    eligible = [i for i in range(n) if seen[i] < above]
    k = data.draw(st.integers(0, n + 1))
    t = torch.tensor(values, dtype=torch.int64 if wide else torch.int32)
    before = t.clone()
    below, chosen = kernel.smallest(t, k, above, torch.tensor(skip, dtype=torch.int32), masked)
    assert below == len(eligible)
    expected = sorted(sorted(eligible, key=lambda i: (seen[i], i))[:k]) if k <= len(eligible) else []
    assert chosen.tolist() == expected and chosen.dtype == torch.int64
    assert torch.equal(t, before)  # nothing copied, nothing changed
    if 0 < k <= len(eligible):  # the same through ``smallest`` (the caller's copy holds the skipped values)
        priority = torch.tensor(seen, dtype=t.dtype)
        with _torch_path():
            assert smallest(priority.clone(), k, above).tolist() == expected
        assert smallest(priority, k, above).tolist() == expected


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(4097, 30000),  # past the select's sample of 4096 values: its guess can be off, and is checked
    pattern=st.sampled_from(["random", "periodic", "ascending", "descending", "runs"]),
    distinct=st.sampled_from([1, 2, 3, 40, 5000, 1 << 30]),
    wide=st.booleans(),
    data=st.data(),
)
def test_the_native_select_of_many_values_is_what_sorting_gives(kernel, n, pattern, distinct, wide, data):
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31)))
    base = data.draw(st.sampled_from([0, 1000, 2**31 - (1 << 30) - 2]))
    position = torch.arange(n, dtype=torch.int64)
    values = {
        "random": torch.randint(0, distinct, (n,), generator=g),
        "periodic": position % data.draw(st.sampled_from([2, 7, 4096, n // 3 + 1])) % distinct,
        "ascending": position * distinct // n,
        "descending": (n - 1 - position) * distinct // n,
        "runs": (position // data.draw(st.integers(1, 500))) % distinct,
    }[pattern] + base
    skip = (torch.rand(n, generator=g) < data.draw(st.sampled_from([0.0, 0.01, 0.5]))).nonzero().squeeze(1)
    masked = base + data.draw(st.sampled_from([0, distinct // 2, distinct + 1]))
    above = base + data.draw(st.sampled_from([1, 2, distinct // 2 + 1, distinct, distinct + 2]))
    seen = values.clone()
    seen[skip] = masked
    eligible = int((seen < above).sum())
    k = data.draw(st.sampled_from([1, 2, max(1, eligible // 100), eligible // 2, eligible, eligible + 1, n]))
    t = values.to(torch.int64 if wide else torch.int32)
    below, chosen = kernel.smallest(t, k, above, skip.to(torch.int32), masked)
    assert below == eligible
    order = torch.sort(seen, stable=True).indices  # by value, ties by position
    expected = order[:k].sort().values if 0 < k <= eligible else order[:0]
    assert torch.equal(chosen, expected)


def test_the_native_select_refuses_skipped_positions_out_of_order(kernel):
    values = torch.zeros(8, dtype=torch.int32)
    for skip in ([3, 2], [1, 1], [8], [-1]):
        assert kernel.smallest(values, 1, 1, torch.tensor(skip, dtype=torch.int32), 0) is None


@settings(max_examples=60, deadline=None)
@given(data=st.data(), wide=st.booleans())
def test_the_native_look_up_gives_the_torch_slots_and_undoes_its_marks(kernel, data, wide):
    rows, capacity = data.draw(st.integers(1, 60)), data.draw(st.integers(1, 20))
    index = DirectSlots(rows, capacity)
    held = data.draw(st.lists(st.integers(0, rows - 1), unique=True, max_size=min(rows, capacity)))
    slots = data.draw(st.permutations(range(capacity)))[: len(held)]
    index.insert(torch.tensor(held, dtype=torch.int64), torch.tensor(slots, dtype=torch.int64))
    if wide:
        index.table = index.table.to(torch.int64)
    ids = torch.tensor(data.draw(st.lists(st.integers(0, rows - 1), max_size=50)), dtype=torch.int64)
    used = torch.tensor(data.draw(st.lists(st.integers(0, 9), min_size=capacity, max_size=capacity)),
                        dtype=torch.int32)  # fmt: skip
    before = used.clone()
    looked = kernel.lookup(index.table, ids, used, 10)
    slot = index.find(ids)
    assert torch.equal(looked.slot, slot)
    assert looked.missed.tolist() == (slot < 0).nonzero().squeeze(1).tolist()
    assert torch.equal(looked.missed_ids, ids[slot < 0])
    expected = before.clone().index_fill_(0, slot[slot >= 0], 10)
    assert torch.equal(used, expected) and looked.hit.numel() == int((expected == 10).sum())
    looked.undo(used)
    assert torch.equal(used, before)


@settings(max_examples=30, deadline=None)
@given(data=st.data(), wide=st.booleans())
def test_the_native_look_up_of_a_long_batch_gives_the_torch_slots(kernel, data, wide):
    # Batches longer than the distance the kernel fetches ahead (ids and the slots' steps), repeats included
    rows, capacity = data.draw(st.integers(50, 400)), data.draw(st.integers(1, 200))
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31)))
    index = DirectSlots(rows, capacity)
    held = torch.randperm(rows, generator=g)[:capacity]
    index.insert(held, torch.randperm(capacity, generator=g)[: held.numel()])
    if wide:
        index.table = index.table.to(torch.int64)
    ids = torch.randint(0, rows, (data.draw(st.integers(65, 3000)),), generator=g)
    used = torch.randint(0, 9, (capacity,), generator=g, dtype=torch.int32)
    before = used.clone()
    looked = kernel.lookup(index.table, ids, used, 10)
    slot = index.find(ids)
    assert torch.equal(looked.slot, slot) and torch.equal(looked.missed_ids, ids[slot < 0])
    assert torch.equal(used, before.clone().index_fill_(0, slot[slot >= 0], 10))
    bad = ids.clone()
    bad[data.draw(st.integers(0, ids.numel() - 1))] = rows  # out of range, anywhere: nothing stays changed
    kept = before.clone()
    assert kernel.lookup(index.table, bad, before, 10) is None and torch.equal(before, kept)


def test_the_native_look_up_leaves_ids_or_slots_out_of_range_to_torch(kernel):
    index = DirectSlots(10, 4)
    index.insert(torch.tensor([1, 2]), torch.tensor([0, 1]))
    used = torch.zeros(4, dtype=torch.int32)
    assert kernel.lookup(index.table, torch.tensor([1, 2, 10]), used, 5) is None
    index.table[3] = 4  # a slot past the cache's
    assert kernel.lookup(index.table, torch.tensor([1, 2, 3]), used, 5) is None
    assert not bool(used.any())  # (the hits before it put back)
    assert kernel.lookup(index.table, torch.tensor([1.0]), used, 5) is None  # not int64 ids
    assert kernel.lookup(index.table, torch.tensor([1, 2]), used.long(), 5) is None  # not int32 steps


def _file(folder: Path, name: str, rows: int, spare: int) -> RowFile:
    layout = RecordLayout(rows, 2, "float32", 1, spare_records(rows, 0.25) if spare else 0)

    def init(ids):
        return ids.to(torch.float32)[:, None].expand(-1, 2).clone(), torch.zeros((ids.numel(), 1))

    return RowFile.create(folder / f"{name}.rows", layout, init)


def _state(cache: RowCache) -> list:
    tensors = (cache.values, cache.key, cache.used, cache.dirty, cache.home, cache.free, cache.index.table)
    return [*(t.clone() for t in tensors), cache.step, copy.copy(cache.stats)]


@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(8, 120),
    capacity=st.integers(1, 24),
    spare=st.booleans(),  # with spare records: write-backs through the file's log
    wide=st.booleans(),
    batches=st.lists(
        st.tuples(st.lists(st.integers(0, 10**6), max_size=30), st.integers(0, 3), st.booleans()), max_size=25
    ),
)
def test_a_cache_through_the_kernels_equals_one_through_torch(kernel, rows, capacity, spare, wide, batches):
    """Every step: the same slots, the same refusals (and nothing changed by one), the same state after."""
    with tempfile.TemporaryDirectory() as folder:
        files = [_file(Path(folder), name, rows, spare) for name in ("native", "torch")]
        with mock.patch.object(cache_module, "slot_index", DirectSlots):  # (a small cache would hash)
            caches = [RowCache(f, capacity) for f in files]
        if wide:
            for cache in caches:
                cache.index.table = cache.index.table.to(torch.int64)
        try:
            for ids, back, dirty in batches:
                ids = torch.tensor([i % rows for i in ids], dtype=torch.int64)
                since = max(1, caches[0].step + 1 - back)  # rows of the last ``back`` steps kept
                answers = []
                spy = mock.patch.object(kernel, "lookup", wraps=kernel.lookup)
                for cache, path in zip(caches, (spy, _torch_path()), strict=True):
                    before = _state(cache)
                    with path as called:
                        try:
                            slots = cache.resolve(ids, protect_since=since)
                        except ShardvarValueError as e:
                            answers.append(str(e))
                            assert _equal(before, _state(cache))  # a refused batch changes nothing
                            continue
                    answers.append(slots)
                    if called is not None:  # (the native cache: its kernel took the batch)
                        assert called.call_count == 1
                    if dirty and slots.numel():
                        cache.values[slots] += 1.0
                        cache.mark_dirty(slots)
                assert _equal(*answers)
                assert _equal(_state(caches[0]), _state(caches[1]))
            assert _equal(caches[0].peek(torch.arange(rows)), caches[1].peek(torch.arange(rows)))
        finally:
            for cache, f in zip(caches, files, strict=True):
                cache.close()
                f.close()


def test_a_failed_write_back_leaves_the_steps_as_they_were(kernel, tmp_path):
    """The native look-up marks the hits as it finds them: a write-back that failed (raised when the batch
    waits for it) puts them back, as the torch path never changed them."""
    with _file(tmp_path, "t", 64, 0) as f, mock.patch.object(cache_module, "slot_index", DirectSlots):
        cache = RowCache(f, 4)
        cache.resolve(torch.tensor([1, 2, 3]))
        before = _state(cache)
        with mock.patch.object(cache.behind, "wait", side_effect=OSError("the disk is gone")), \
                pytest.raises(OSError, match="the disk is gone"):  # fmt: skip
            cache.resolve(torch.tensor([1, 2, 9]))
        assert _equal(before, _state(cache))
        cache.close()


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def test_without_the_kernels_the_torch_path_is_taken(monkeypatch):
    monkeypatch.setattr(_slots_native, "_loaded", {})
    monkeypatch.setenv("SHARDVAR_NATIVE", "0")
    assert _slots_native.kernel() is None
    used = torch.tensor([3, 1, 2, 1, 0], dtype=torch.int32)
    assert smallest(used, 2, 3).tolist() == [1, 4]  # (1 and 3 tie: the lower)
    with tempfile.TemporaryDirectory() as folder, _file(Path(folder), "t", 16, 0) as f:
        cache = RowCache(f, 2)
        cache.resolve(torch.tensor([1, 2, 1]))
        assert cache.resolve(torch.tensor([2, 3])).tolist() == [1, 0]
        assert cache.stats.hits == 1 and cache.stats.evictions == 1 and cache.used.tolist() == [2, 2]
        cache.close()
