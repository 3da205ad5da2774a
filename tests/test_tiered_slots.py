"""The cache's bookkeeping (``tiered._slots``): which slot holds a row, and which slots a policy gives up.

Both index kinds answer as a dictionary would after any sequence of inserts and removals; the radix
select gives exactly what sorting by (priority, slot) gives; and a cache run over either index
trains exactly as the same table in memory, evicting the rows its policy names.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import shardvar.tiered._cache as cache_module
import shardvar.tiered._slots as slots_module
from shardvar.tiered import RecordLayout, RowCache, RowFile
from shardvar.tiered._slots import DirectSlots, HashedSlots, slot_index, smallest, victims


@settings(max_examples=60, deadline=None)
@given(
    used=st.lists(st.integers(0, (1 << 40)), min_size=1, max_size=80),
    counts=st.data(),
    since=st.integers(0, (1 << 40) + 1),
    k=st.integers(1, 80),
    narrow=st.booleans(),
)
def test_victims_are_what_sorting_by_the_policy_gives(used, counts, since, k, narrow):
    if narrow:  # steps as a cache has them: a few thousand apart, 32-bit
        used, since = [u % 3000 for u in used], since % 3001
    dtype = torch.int32 if narrow else torch.int64
    count = counts.draw(st.lists(st.integers(1, 6), min_size=len(used), max_size=len(used)))
    held = [i for i, u in enumerate(used) if u < since]
    k = min(k, len(held))
    u, c = torch.tensor(used, dtype=dtype), torch.tensor(count, dtype=torch.int32)
    lru = sorted(sorted(held, key=lambda i: (used[i], i))[:k])
    lfu = sorted(sorted(held, key=lambda i: (count[i], used[i], i))[:k])
    assert smallest(u.clone(), k, since).tolist() == lru  # (each takes its own copy: it is changed in place)
    assert victims("lru", u.clone(), c, k, since).tolist() == lru
    assert victims("lfu", u.clone(), c, k, since).tolist() == lfu


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.lists(st.integers(0, 299), max_size=20, unique=True)), max_size=30))
def test_both_indexes_answer_as_a_dictionary(operations):
    rows, capacity = 300, 40
    indexes, held = [DirectSlots(rows, capacity), HashedSlots(capacity)], {}
    free = list(range(capacity))
    for add, ids in operations:
        if add:
            ids = [i for i in ids if i not in held][: len(free)]
            slots, free = free[: len(ids)], free[len(ids) :]
            held.update(zip(ids, slots, strict=True))
            for index in indexes:
                index.insert(torch.tensor(ids, dtype=torch.int64), torch.tensor(slots, dtype=torch.int64))
        else:
            ids = [i for i in ids if i in held]
            free += [held.pop(i) for i in ids]
            for index in indexes:
                index.remove(torch.tensor(ids, dtype=torch.int64), torch.tensor(ids, dtype=torch.int64))
                if index.needs_rebuild():
                    index.rebuild(torch.tensor(list(held), dtype=torch.int64), torch.tensor(list(held.values())))
        probe = torch.arange(rows)
        expected = torch.tensor([held.get(i, -1) for i in range(rows)])
        for index in indexes:
            assert torch.equal(index.find(probe).clamp(min=-1), expected)
            out = probe[expected < 0]
            assert torch.equal(index.places(out), out)  # a row given back at its own place is there


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_the_direct_index_keeps_the_place_of_every_row_it_does_not_hold(data):
    """Rows given up at any place are found there (a cache writes a row back through the file's log); a reset
    puts every row not held back at its own place and leaves the held ones in their slots."""
    rows = data.draw(st.integers(1, 200))
    index, places = DirectSlots(rows, 16), list(range(rows))
    held = data.draw(st.lists(st.integers(0, rows - 1), unique=True, max_size=min(rows, 16)))
    index.insert(torch.tensor(held, dtype=torch.int64), torch.arange(len(held)))
    leaving = held[: data.draw(st.integers(0, len(held)))]
    moved = data.draw(st.permutations(range(rows)))[: len(leaving)]
    for i, p in zip(leaving, moved, strict=True):
        places[i] = p
    index.remove(torch.tensor(leaving, dtype=torch.int64), torch.tensor(moved, dtype=torch.int64))
    out = [i for i in range(rows) if i not in held[len(leaving) :]]
    assert index.places(torch.tensor(out, dtype=torch.int64)).tolist() == [places[i] for i in out]
    index.reset_places()
    assert index.places(torch.tensor(out, dtype=torch.int64)).tolist() == out
    still = held[len(leaving) :]
    assert index.find(torch.tensor(still, dtype=torch.int64)).tolist() == list(range(len(leaving), len(held)))


@pytest.mark.parametrize(
    ("rows", "capacity", "kind"),
    [(1000, 100, DirectSlots), (1 << 20, 1 << 16, DirectSlots), (1 << 22, 1 << 15, HashedSlots),
     (1 << 24, 1 << 10, HashedSlots), (10, 1, DirectSlots)],
)  # fmt: skip
def test_the_direct_map_is_chosen_unless_it_takes_over_twice_the_memory(rows, capacity, kind):
    assert isinstance(slot_index(rows, capacity), kind)
    direct, hashed = DirectSlots.bytes_for(rows, capacity), HashedSlots.bytes_for(capacity)
    assert (direct <= 2 * hashed) == (kind is DirectSlots)


def _cache_file(tmp_path, rows=64):
    layout = RecordLayout(rows, 3, "float32", 1)

    def init(ids):
        return ids.to(torch.float32)[:, None].expand(-1, 3).clone(), torch.zeros((ids.numel(), 1))

    return RowFile.create(tmp_path / "t.rows", layout, init)


@pytest.mark.parametrize(("policy", "gone"), [("lru", 1), ("lfu", 3)])
@pytest.mark.parametrize("kind", ["direct", "hashed"])
def test_the_policy_gives_up_the_row_it_names(tmp_path, monkeypatch, policy, gone, kind):
    if kind == "hashed":
        monkeypatch.setattr(cache_module, "slot_index", lambda rows, capacity: HashedSlots(capacity))
    with _cache_file(tmp_path) as f:
        cache = RowCache(f, 3, policy)
        for ids in ([1], [1], [2], [3], [2]):  # row 1: 2 uses, last at step 2; row 2: 2 uses, step 5; row 3: 1, step 4
            cache.resolve(torch.tensor(ids))
        cache.resolve(torch.tensor([4]))
        held = cache.lookup(torch.tensor([1, 2, 3, 4])) >= 0
        assert held.tolist() == [i != gone for i in (1, 2, 3, 4)]
        assert torch.equal(cache.values[cache.lookup(torch.tensor([4]))], torch.full((1, 3), 4.0))


@pytest.mark.parametrize("kind", ["direct", "hashed"])
@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_training_through_either_index_equals_training_in_memory(tmp_path, monkeypatch, kind, policy):
    if kind == "hashed":
        monkeypatch.setattr(cache_module, "slot_index", lambda rows, capacity: HashedSlots(capacity))
    g = torch.Generator().manual_seed(3)
    batches = [torch.randint(0, 64, (10,), generator=g) for _ in range(80)]
    memory = torch.arange(64, dtype=torch.float32)[:, None].expand(-1, 3).clone()
    with _cache_file(tmp_path) as f:
        cache = RowCache(f, 12, policy)
        for step, ids in enumerate(batches):
            distinct = torch.unique(ids)
            slots = cache.resolve(distinct)
            cache.values[slots] += step + 1.0
            memory[distinct] += step + 1.0
            cache.mark_dirty(slots)
        assert isinstance(cache.index, DirectSlots if kind == "direct" else HashedSlots)
        assert cache.stats.evictions > 0 and cache.stats.written_back > 0
        assert torch.equal(cache.peek(torch.arange(64))[0], memory)


@pytest.mark.parametrize("path", ["native", "torch"])
@pytest.mark.parametrize("seed", range(20))
def test_victims_among_many_ties_are_the_first_slots(monkeypatch, seed, path):
    """Ties beyond a slice (``_SLICE``, made small here) are found a slice at a time, with the same answer
    (and by the native select, which has no slices)."""
    monkeypatch.setattr(slots_module, "_SLICE", 4)
    if path == "torch":
        monkeypatch.setattr(slots_module._slots_native, "kernel", lambda: None)
    g = torch.Generator().manual_seed(seed)
    used = torch.randint(0, 3, (60,), generator=g, dtype=torch.int32)
    since = int(torch.randint(1, 4, (1,), generator=g))
    held = [i for i, u in enumerate(used.tolist()) if u < since]
    k = max(1, len(held) // 2)
    expected = sorted(sorted(held, key=lambda i: (int(used[i]), i))[:k])
    assert smallest(used.clone(), k, since).tolist() == expected
    assert victims("lru", used.clone(), torch.ones(60, dtype=torch.int32), k, since).tolist() == expected
