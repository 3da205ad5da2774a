"""Which ids get a row (admission) and which rows are given up when a shard is full (eviction).

Policies are small configuration objects; the state they read (last seen step, count) lives in
the slot metadata, and a count-min sketch's counters in a tensor of the SlotTable, so all of it
is saved with the table. Every choice is vectorised and deterministic: ties go to the lower slot.
"""

from __future__ import annotations

from typing import Any

import torch

from .._errors import ShardvarTypeError, ShardvarValueError
from .._validate import check_int, check_number
from ._hash import mix64, uniform01

__all__ = ["LRU", "LFU", "TTL", "CountAdmission", "ProbabilityAdmission", "as_eviction", "lowest_per_group"]

KEY, SEEN, COUNT, USED = range(4)  # columns of the slot metadata


def stable_order(*columns: torch.Tensor) -> torch.Tensor:
    """Positions sorted by the columns, first column most significant, ties in position order."""
    order = torch.arange(columns[0].numel(), device=columns[0].device)
    for col in reversed(columns):
        order = order[torch.sort(col[order], stable=True).indices]
    return order


def group_rank(groups: torch.Tensor, num_groups: int) -> torch.Tensor:
    """Each entry's position within its group, for entries already sorted by group."""
    counts = torch.bincount(groups, minlength=num_groups)
    starts = torch.cumsum(counts, 0) - counts
    return torch.arange(groups.numel(), device=groups.device) - starts[groups]


def lowest_per_group(groups: torch.Tensor, want: torch.Tensor, *scores: torch.Tensor) -> torch.Tensor:
    """Positions of the ``want[g]`` lowest-scoring entries of each group ``g`` (scores as sort keys)."""
    order = stable_order(groups, *scores)
    g = groups[order]
    return order[group_rank(g, want.numel()) < want[g]]


class LRU:
    """Evict the rows seen least recently."""

    ttl: int | None = None

    def scores(self, meta: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (meta[:, SEEN],)

    def __repr__(self) -> str:
        return "LRU()"


class LFU:
    """Evict the rows seen least often (ties: least recently)."""

    ttl: int | None = None

    def scores(self, meta: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return meta[:, COUNT], meta[:, SEEN]

    def __repr__(self) -> str:
        return "LFU()"


class TTL(LRU):
    """Evict rows not seen for more than ``steps`` steps, at the start of every step; when full, as LRU."""

    def __init__(self, steps: int) -> None:
        self.ttl = check_int(steps, "steps", minimum=0)

    def __repr__(self) -> str:
        return f"TTL({self.ttl})"


def as_eviction(value: Any) -> LRU | LFU:
    if isinstance(value, (LRU, LFU)):
        return value
    if value in ("lru", "lfu"):
        return LRU() if value == "lru" else LFU()
    raise ShardvarTypeError(f"eviction must be 'lru', 'lfu', LRU(), LFU() or TTL(steps); got {value!r}")


class CountAdmission:
    """Admit an id once it has been seen ``k`` times, counted in a count-min sketch of ``depth x width``."""

    def __init__(self, k: int, *, depth: int = 4, width: int = 1 << 20, seed: int = 0) -> None:
        self.k = check_int(k, "k", minimum=1)
        self.depth = check_int(depth, "depth", minimum=1)
        self.width = 1 << (check_int(width, "width", minimum=1) - 1).bit_length()  # a power of two
        self.seed = check_int(seed, "seed")

    def sketch(self, device: torch.device | None = None) -> torch.Tensor:
        return torch.zeros((self.depth, self.width), dtype=torch.int64, device=device)

    def admit(self, sketch: torch.Tensor, keys: torch.Tensor, counts: torch.Tensor, step: int) -> torch.Tensor:
        """Count the sightings, then admit the keys whose estimate reached ``k``."""
        rows = torch.arange(self.depth, device=keys.device).unsqueeze(1)
        cells = mix64(keys.unsqueeze(0) ^ mix64(rows * 7919 + self.seed)) & (self.width - 1)
        flat = (cells + rows * self.width).reshape(-1)
        sketch.view(-1).index_add_(0, flat, counts.repeat(self.depth))
        return sketch.view(-1)[flat].view(self.depth, -1).amin(0) >= self.k

    def __repr__(self) -> str:
        return f"CountAdmission({self.k}, depth={self.depth}, width={self.width})"


class ProbabilityAdmission:
    """Admit an id with probability ``p`` at each step it is seen (a hash of id and step: any shard count agrees)."""

    def __init__(self, p: float, *, seed: int = 0) -> None:
        self.p = check_number(p, "p", minimum=0.0)
        if self.p > 1:
            raise ShardvarValueError(f"p must be a probability in [0, 1]; got {p!r}")
        self.seed = check_int(seed, "seed")

    def sketch(self, device: torch.device | None = None) -> torch.Tensor:
        return torch.zeros((0, 0), dtype=torch.int64, device=device)

    def admit(self, sketch: torch.Tensor, keys: torch.Tensor, counts: torch.Tensor, step: int) -> torch.Tensor:
        salt = mix64(torch.tensor(step * 1_000_003 + self.seed, device=keys.device))
        return uniform01(mix64(keys ^ salt)) <= self.p

    def __repr__(self) -> str:
        return f"ProbabilityAdmission({self.p})"
