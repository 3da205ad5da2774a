"""SlotTable: which id holds which row of one or more shards, and the rules that change it.

Rows are slots ``[0, capacity)``, shard ``s`` holding ``offsets[s]`` to ``offsets[s + 1]`` (the
div layout of the rows). Per slot the metadata holds the id, the step it was last seen, how often
it was seen and whether it is in use; with the admission counters and the step counter it is all
in buffers, so it is saved, loaded and moved (``.to()``) with the module. The hash index is
derived state, rebuilt from the metadata after a load.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .._errors import ShardvarValueError
from ..layout import Layout
from ..variables import ShardsView
from ._hash import mix64, shard_of
from ._index import HashIndex
from ._policy import COUNT, KEY, LFU, LRU, SEEN, USED, group_rank, lowest_per_group, stable_order

__all__ = ["SlotTable"]


class SlotTable(nn.Module):
    """Slots of the shards ``first .. first + len(sizes)`` of a table split by id hash into ``num_shards``."""

    def __init__(
        self, layout: Layout, first: int, count: int, eviction: LRU | LFU, admission: Any, device: Any
    ) -> None:
        super().__init__()
        self.layout, self.first = layout, first
        self.sizes = sizes = layout.sizes[first : first + count]
        self.num_shards = layout.num_shards
        self.eviction, self.admission = eviction, admission
        capacity = sum(sizes)
        shard_ids = torch.arange(len(sizes), device=device)
        self.register_buffer("meta", torch.zeros((capacity, 4), dtype=torch.int64, device=device))
        self.register_buffer("step", torch.zeros((), dtype=torch.int64, device=device))
        sketch = admission.sketch(device) if admission is not None else torch.zeros((0, 0), dtype=torch.int64)
        self.register_buffer("sketch", sketch.to(device))
        self.register_buffer("index", HashIndex.allocate(len(sizes), max(sizes, default=0), device), persistent=False)
        self.register_buffer("slot_shard", shard_ids.repeat_interleave(torch.tensor(sizes, device=device)), False)
        self._hash_index: HashIndex | None = None

    def sharded_variables(self) -> dict[str, ShardsView]:
        """The metadata split like the rows (a delta checkpoint then writes only the slots that changed)."""
        blocks = self.meta.split(list(self.sizes))
        shards = {self.first + i: block for i, block in enumerate(blocks)}
        return {"meta": ShardsView(self.layout, (self.layout.num_rows, 4), torch.int64, shards)}

    @property
    def hash_index(self) -> HashIndex:
        if self._hash_index is None or self._hash_index.table is not self.index:  # new after .to()
            self._hash_index = HashIndex(self.index, len(self.sizes))
        return self._hash_index

    def local_shard(self, keys: torch.Tensor, hashes: torch.Tensor | None = None) -> torch.Tensor:
        shards = shard_of(keys, self.num_shards, hashes) - self.first
        if len(self.sizes) != self.num_shards and bool(((shards < 0) | (shards >= len(self.sizes))).any()):
            raise ShardvarValueError(f"keys reached shards {self.first}.. they are not placed in")
        return shards

    def held(self) -> torch.Tensor:
        return self.meta[:, USED].nonzero().squeeze(1)

    def find(self, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Slot (-1 if absent) and bucket of each key."""
        return self.hash_index.find(keys, self.home(keys))

    def home(self, keys: torch.Tensor) -> torch.Tensor:
        hashes = mix64(keys)
        return self.hash_index.start(hashes, self.local_shard(keys, hashes))

    def remove(self, slots: torch.Tensor) -> torch.Tensor:
        """Give up these (held) slots; returns their ids."""
        keys = self.meta[slots, KEY].clone()
        _, where = self.find(keys)
        self.hash_index.remove(where)
        self.meta[slots] = 0
        if self.hash_index.needs_rebuild():
            self.rebuild_index()
        return keys

    def rebuild_index(self) -> None:
        slots = self.held()
        keys = self.meta[slots, KEY]
        self.hash_index.rebuild(keys, self.home(keys), slots)

    def expire(self) -> torch.Tensor:
        """TTL: give up the rows not seen for more than ``ttl`` steps; returns their ids."""
        if self.eviction.ttl is None:
            return self.meta.new_zeros(0)
        stale = (self.meta[:, USED] == 1) & (self.step - self.meta[:, SEEN] > self.eviction.ttl)
        return self.remove(stale.nonzero().squeeze(1))

    def lowest(self, want: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
        """The ``want[s]`` candidate slots of each shard ``s`` the eviction policy ranks lowest."""
        scores = [col[candidates] for col in self.eviction.scores(self.meta)]
        return candidates[lowest_per_group(self.slot_shard[candidates], want, *scores)]

    def resolve(self, keys: torch.Tensor, counts: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        """Training: the slot of each key, admitting and placing new ones; returns (slots, new slots, new ids).

        A key not admitted, or without room in its shard, gets slot -1. Rows seen in this call
        are never evicted by it.
        """
        step = int(self.step)
        counts = torch.ones_like(keys) if counts is None else counts
        slot, _ = self.find(keys)
        hit = slot >= 0
        seen = slot[hit]
        self.meta[seen, SEEN] = step
        self.meta[:, COUNT].index_add_(0, seen, counts[hit])
        miss = ~hit
        if not bool(miss.any()):
            return slot, slot.new_zeros(0), slot.new_zeros(0)
        new, inverse = torch.unique(keys[miss], return_inverse=True)
        occurrences = torch.zeros_like(new).index_add_(0, inverse, counts[miss])
        admitted = torch.ones_like(new, dtype=torch.bool)
        if self.admission is not None:
            admitted = self.admission.admit(self.sketch, new, occurrences, step)
        placed = torch.full_like(new, -1)
        placed[admitted] = self._place(new[admitted], occurrences[admitted], step)
        ok = placed >= 0
        new_slots, new_keys = placed[ok], new[ok]
        self.meta[new_slots] = torch.stack(
            (new_keys, torch.full_like(new_keys, step), occurrences[ok], torch.ones_like(new_keys)), 1
        )
        self.hash_index.insert(new_keys, self.home(new_keys), new_slots)
        slot[miss] = placed[inverse]
        return slot, new_slots, new_keys

    def _place(self, keys: torch.Tensor, occurrences: torch.Tensor, step: int) -> torch.Tensor:
        """Free slots for new keys, evicting by policy where a shard is short; -1 where none is left."""
        shards, groups = self.local_shard(keys), len(self.sizes)
        free = self.meta[:, USED] == 0
        short = torch.bincount(shards, minlength=groups) - torch.bincount(self.slot_shard[free], minlength=groups)
        if bool((short > 0).any()):
            candidates = ((self.meta[:, USED] == 1) & (self.meta[:, SEEN] < step)).nonzero().squeeze(1)
            self.remove(self.lowest(short.clamp(min=0), candidates))
            free = self.meta[:, USED] == 0
        free_slots = free.nonzero().squeeze(1)  # ascending: grouped by shard (each shard is a block)
        free_count = torch.bincount(self.slot_shard[free_slots], minlength=groups)
        free_start = torch.cumsum(free_count, 0) - free_count
        order = stable_order(shards, -occurrences, keys)  # per shard: the most seen first, then by id
        target = shards[order]
        rank = group_rank(target, groups)
        ok = rank < free_count[target]
        out = torch.full_like(keys, -1)
        out[order[ok]] = free_slots[free_start[target[ok]] + rank[ok]]
        return out

    def placement_moves(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """After a load into another shard count: (source, destination) slots putting every id in its shard.

        Each shard keeps the ids the eviction policy ranks highest, up to its capacity, in rank
        order. None when every id already sits in its shard.
        """
        held = self.held()
        target = self.local_shard(self.meta[held, KEY])
        if bool((target == self.slot_shard[held]).all()):
            return None
        scores = [-col[held] for col in self.eviction.scores(self.meta)]
        order = stable_order(target, *scores)
        rank = group_rank(target[order], len(self.sizes))
        sizes = torch.tensor(self.sizes, device=held.device)
        keep = rank < sizes[target[order]]
        offsets = torch.cumsum(sizes, 0) - sizes
        return held[order[keep]], offsets[target[order][keep]] + rank[keep]

    def move(self, source: torch.Tensor, destination: torch.Tensor) -> None:
        moved = self.meta[source].clone()
        self.meta.zero_()
        self.meta[destination] = moved
        self.rebuild_index()
