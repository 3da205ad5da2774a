"""HashIndex: which slot holds which key, for many shards at once, in one int64 tensor.

Open addressing with linear probing: shard ``s`` owns buckets ``[s * B, (s + 1) * B)`` (``B`` a
power of two, at least twice the shard's capacity, so probes stay short). A bucket is a pair
(key, slot), the slot ``EMPTY`` or ``DELETED`` when it holds no key, so every int64 value is a
valid key (no sentinel key). A probe reads both halves of a bucket in one gather (the pair
viewed as one complex128: a 16-byte copy, bit patterns untouched). Lookups and inserts run in
vectorised rounds, round ``r`` reading the ``r``-th bucket of every key still probing; there is
no loop over keys. Keys racing for one free bucket are settled by ``scatter_reduce(amin)``.
"""

from __future__ import annotations

import torch

from .._errors import ShardvarError

__all__ = ["HashIndex", "EMPTY", "DELETED"]

EMPTY, DELETED = -1, -2


def buckets_for(capacity: int) -> int:
    return 1 << max(3, (2 * max(capacity, 1) - 1).bit_length())


class HashIndex:
    """Slots by key, per shard; ``table`` is the only state (rebuilt from the slot metadata)."""

    def __init__(self, table: torch.Tensor, num_shards: int) -> None:
        self.table = table  # [num_shards * buckets, 2] int64 (key, slot): a buffer of the SlotTable
        self.num_shards = num_shards
        self.buckets = table.shape[0] // max(num_shards, 1)
        self.mask = self.buckets - 1
        self.deleted = int((table[:, 1] == DELETED).sum())

    @staticmethod
    def bytes_for(capacity: int) -> int:
        """The bytes of one shard's table for ``capacity`` keys (a pair of int64 per bucket)."""
        return 16 * buckets_for(capacity)

    @staticmethod
    def allocate(num_shards: int, capacity: int, device: torch.device | None = None) -> torch.Tensor:
        table = torch.zeros((num_shards * buckets_for(capacity), 2), dtype=torch.int64, device=device)
        table[:, 1] = EMPTY
        return table

    def _read(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pairs = self.table.view(torch.complex128).view(-1)[pos].view(torch.int64).view(-1, 2)
        return pairs[:, 0], pairs[:, 1]

    def start(self, hashes: torch.Tensor, shards: torch.Tensor) -> torch.Tensor:
        """Each key's home bucket: its shard's block, at the low bits of its hash."""
        return shards * self.buckets + (hashes & self.mask)

    def _next(self, pos: torch.Tensor) -> torch.Tensor:
        return pos - (pos & self.mask) + ((pos + 1) & self.mask)

    def find(self, keys: torch.Tensor, home: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The slot of each key (-1 if absent) and the bucket it sits in (for removal)."""
        held_key, held = self._read(home)  # round 0 over every key: no indexing by the probing set
        hit = (held >= 0) & (held_key == keys)
        slot, where = torch.where(hit, held, -1), torch.where(hit, home, -1)
        active = (~hit & (held != EMPTY)).nonzero().squeeze(1)
        pos = home[active]
        for _ in range(self.buckets):
            if active.numel() == 0:
                return slot, where
            pos = self._next(pos)
            held_key, held = self._read(pos)
            found = (held >= 0) & (held_key == keys[active])
            slot[active[found]], where[active[found]] = held[found], pos[found]
            going = ~found & (held != EMPTY)
            active, pos = active[going], pos[going]
        raise ShardvarError("hash index has no empty bucket left; it was not rebuilt after deletions")

    def insert(self, keys: torch.Tensor, home: torch.Tensor, slots: torch.Tensor) -> None:
        """Add keys known to be absent; keys racing for one free bucket: the first in order wins it."""
        n = keys.numel()
        active = torch.arange(n, device=keys.device)
        pos = home.clone()
        for _ in range(self.buckets + 1):
            if active.numel() == 0:
                return
            free = self.table[pos, 1] < 0
            cand, cpos = active[free], pos[free]
            placed = torch.zeros_like(free)
            if cand.numel():
                where, inverse = torch.unique(cpos, return_inverse=True)
                first = torch.full_like(where, n).scatter_reduce_(0, inverse, cand, "amin")
                won = first[inverse] == cand
                self.deleted -= int((self.table[cpos[won], 1] == DELETED).sum())
                self.table[cpos[won]] = torch.stack((keys[cand[won]], slots[cand[won]]), 1)
                placed[free.nonzero().squeeze(1)[won]] = True
            active, pos = active[~placed], self._next(pos[~placed])
        raise ShardvarError("hash index is full; capacity and bucket count disagree")

    def remove(self, where: torch.Tensor) -> None:
        """Mark buckets deleted (a probe goes on past them); the caller rebuilds when they pile up."""
        self.table[where, 1] = DELETED
        self.deleted += where.numel()

    def needs_rebuild(self) -> bool:
        return self.deleted * 4 > self.table.shape[0]

    def rebuild(self, keys: torch.Tensor, home: torch.Tensor, slots: torch.Tensor) -> None:
        self.table[:, 1] = EMPTY
        self.deleted = 0
        self.insert(keys, home, slots)
