"""HashIndex: which slot holds which key, for many shards at once, in one int64 tensor.

Open addressing with linear probing: shard ``s`` owns buckets ``[s * B, (s + 1) * B)`` (``B`` a
power of two, at least twice the shard's capacity, so probes stay short), and a bucket holds a
slot number, ``EMPTY`` or ``DELETED``. The keys themselves live in the slot metadata, so every
int64 value is a valid key (no sentinel key). Lookups and inserts run in vectorised rounds:
round ``r`` reads the ``r``-th bucket of every key still probing; there is no loop over keys.
Inserts of keys claiming the same free bucket are settled by ``scatter_reduce(amin)``.
"""

from __future__ import annotations

import torch

from .._errors import ShardvarError
from ._hash import mix64

__all__ = ["HashIndex", "EMPTY", "DELETED"]

EMPTY, DELETED = -1, -2


def buckets_for(capacity: int) -> int:
    return 1 << max(3, (2 * max(capacity, 1) - 1).bit_length())


class HashIndex:
    """Slots by key, per shard; ``table`` is the only state (rebuilt from the slot metadata)."""

    def __init__(self, table: torch.Tensor, num_shards: int) -> None:
        self.table = table  # [num_shards * buckets] int64, owned by the SlotTable (a buffer: moves with .to())
        self.num_shards = num_shards
        self.buckets = table.numel() // max(num_shards, 1)
        self.mask = self.buckets - 1
        self.deleted = int((table == DELETED).sum())

    @staticmethod
    def allocate(num_shards: int, capacity: int, device: torch.device | None = None) -> torch.Tensor:
        return torch.full((num_shards * buckets_for(capacity),), EMPTY, dtype=torch.int64, device=device)

    def _start(self, keys: torch.Tensor, shards: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return shards * self.buckets, mix64(keys) & self.mask

    def find(
        self, keys: torch.Tensor, shards: torch.Tensor, slot_keys: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The slot of each key (-1 if absent) and the bucket it sits in (for removal)."""
        base, home = self._start(keys, shards)
        slot = torch.full_like(keys, -1)
        where = torch.full_like(keys, -1)
        active = torch.arange(keys.numel(), device=keys.device)
        for r in range(self.buckets + 1):
            pos = base[active] + ((home[active] + r) & self.mask)
            held = self.table[pos]
            hit = (held >= 0) & (slot_keys[held.clamp(min=0)] == keys[active])
            found = active[hit]
            slot[found], where[found] = held[hit], pos[hit]
            active = active[~hit & (held != EMPTY)]
            if active.numel() == 0:
                return slot, where
        raise ShardvarError("hash index has no empty bucket left; it was not rebuilt after deletions")

    def insert(self, keys: torch.Tensor, shards: torch.Tensor, slots: torch.Tensor) -> None:
        """Add keys known to be absent; keys racing for one free bucket: the first in order wins it."""
        base, home = self._start(keys, shards)
        n = keys.numel()
        active = torch.arange(n, device=keys.device)
        probe = torch.zeros_like(keys)
        for _ in range(self.buckets + 1):
            if active.numel() == 0:
                return
            pos = base[active] + ((home[active] + probe[active]) & self.mask)
            free = self.table[pos] < 0
            cand, cpos = active[free], pos[free]
            placed = torch.zeros_like(free)
            if cand.numel():
                where, inverse = torch.unique(cpos, return_inverse=True)
                first = torch.full_like(where, n).scatter_reduce_(0, inverse, cand, "amin")
                won = first[inverse] == cand
                self.deleted -= int((self.table[cpos[won]] == DELETED).sum())
                self.table[cpos[won]] = slots[cand[won]]
                placed[free.nonzero().squeeze(1)[won]] = True
            active = active[~placed]
            probe[active] += 1
        raise ShardvarError("hash index is full; capacity and bucket count disagree")

    def remove(self, where: torch.Tensor) -> None:
        """Mark buckets deleted (a probe goes on past them); the caller rebuilds when they pile up."""
        self.table[where] = DELETED
        self.deleted += where.numel()

    def needs_rebuild(self) -> bool:
        return self.deleted * 4 > self.table.numel()

    def rebuild(self, keys: torch.Tensor, shards: torch.Tensor, slots: torch.Tensor) -> None:
        self.table.fill_(EMPTY)
        self.deleted = 0
        self.insert(keys, shards, slots)
