"""Admission and eviction against a plain-Python model of the rules, step by step (hypothesis)."""

from __future__ import annotations

from collections import Counter

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardvar.dynamic import LFU, LRU, TTL, DynamicEmbedding, IdInitializer, shard_of
from shardvar.layout import Layout


class Model:
    """The documented rules, one id at a time: slots per shard, policy order, ties to the lower slot."""

    def __init__(self, capacity: int, shards: int, policy: object) -> None:
        layout = Layout.div(capacity, shards)
        self.free = {s: list(range(layout.offsets[s], layout.offsets[s] + layout.sizes[s])) for s in range(shards)}
        self.shards, self.policy, self.step = shards, policy, 0
        self.held: dict[int, list[int]] = {}  # id -> [slot, last seen, count]

    def shard(self, key: int) -> int:
        return int(shard_of(torch.tensor([key]), self.shards))

    def evict(self, key: int) -> None:
        slot = self.held.pop(key)[0]
        self.free[self.shard(key)].append(slot)
        self.free[self.shard(key)].sort()

    def order(self, key: int) -> tuple:
        slot, seen, count = self.held[key]
        return (count, seen, slot) if isinstance(self.policy, LFU) else (seen, slot)

    def run(self, batch: list[int]) -> None:
        self.step += 1
        ttl = getattr(self.policy, "ttl", None)
        for key in [k for k, v in self.held.items() if ttl is not None and self.step - v[1] > ttl]:
            self.evict(key)
        occ = Counter(batch)
        for key in set(batch) & set(self.held):
            self.held[key][1] = self.step
            self.held[key][2] += occ[key]
        new = sorted(set(batch) - set(self.held), key=lambda k: (-occ[k], k))
        for s in range(self.shards):
            mine = [k for k in new if self.shard(k) == s]
            short = len(mine) - len(self.free[s])
            if short > 0:
                old = [k for k in self.held if self.shard(k) == s and self.held[k][1] < self.step]
                for key in sorted(old, key=self.order)[:short]:
                    self.evict(key)
            for key, slot in zip(mine, list(self.free[s]), strict=False):
                self.held[key] = [slot, self.step, occ[key]]
                self.free[s].remove(slot)


POLICIES = st.sampled_from([LRU(), LFU(), TTL(0), TTL(2)])


@settings(max_examples=40, deadline=None)
@given(
    policy=POLICIES,
    shards=st.integers(1, 3),
    extra=st.integers(0, 4),
    batches=st.lists(st.lists(st.integers(-6, 12), min_size=1, max_size=9), min_size=1, max_size=8),
)
def test_held_ids_follow_the_rules(policy: object, shards: int, extra: int, batches: list[list[int]]) -> None:
    capacity = shards + extra
    emb = DynamicEmbedding(2, capacity, shards, eviction=policy)
    model = Model(capacity, shards, policy)
    layout = Layout.div(capacity, shards)
    for batch in batches:
        ids = torch.tensor(batch)
        out = emb(ids)
        model.run(batch)
        meta = emb.slots.meta
        got = {int(meta[s, 0]): [s, int(meta[s, 1]), int(meta[s, 2])] for s in emb.slots.held().tolist()}
        assert got == model.held
        for s in range(shards):  # never more ids than a shard's capacity
            assert int(meta[layout.offsets[s] : layout.offsets[s] + layout.sizes[s], 3].sum()) <= layout.sizes[s]
        held = emb.contains(ids)
        fresh = IdInitializer()(ids, 2, torch.float32)
        assert torch.equal(out[held], fresh[held])  # no optimizer: a held id reads its initial row
        assert torch.equal(out[~held], torch.zeros_like(out[~held]))


def test_an_evicted_id_that_returns_starts_from_its_initial_row() -> None:
    emb = DynamicEmbedding(3, 2, eviction=LRU())
    opt = torch.optim.SGD(emb.parameters(), lr=1.0)
    for ids in ([1], [2], [3], [1]):  # 3 evicts 1, then 1 evicts 2
        opt.zero_grad()
        out = emb(torch.tensor(ids))
        out.sum().backward()
        opt.step()
    assert torch.equal(out, IdInitializer()(torch.tensor([1]), 3, torch.float32))
    assert emb.held_ids().tolist() == [1, 3]


def test_on_demand_eviction() -> None:
    emb = DynamicEmbedding(2, 16, 2, eviction=LFU())
    for ids in ([1, 2, 3, 4], [1, 2, 3], [1, 2], [1]):
        emb(torch.tensor(ids))
    assert sorted(emb.evict(count=2).tolist()) == [3, 4]
    assert emb.evict(older_than=0).tolist() == [2]  # 2 was last seen a step ago, 1 now
    assert emb.evict(torch.tensor([1, 99])).tolist() == [1]
    assert emb.num_ids == 0


def test_many_deletions_rebuild_the_index() -> None:
    emb = DynamicEmbedding(2, 64, 1, eviction=TTL(0))
    for start in range(0, 2000, 50):  # every step expires the previous batch: tombstones pile up
        ids = torch.arange(start, start + 50)
        emb(ids)
        assert emb.contains(ids).all() and emb.num_ids == 50
    assert emb.slots.hash_index.deleted * 4 <= emb.slots.index.numel()
