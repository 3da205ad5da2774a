"""Decomposition of a Python slice on the sharded axis into per-shard local slices.

Numpy semantics throughout: ``slice.indices`` clamps starts and stops beyond either end, so a
plan equals slicing the whole axis (the reference's ShardedVariable gets these cases wrong).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from .._errors import ShardvarTypeError, ShardvarValueError

__all__ = ["SlicePiece", "SlicePlan", "normalise_slice", "div_slice_pieces", "mod_slice_pieces"]


class SlicePiece(NamedTuple):
    """Rows ``start, start+step, ...`` (``count`` of them) of one shard.

    They land at output positions ``out_start, out_start + out_step, ...``.
    """

    shard: int
    start: int
    step: int
    count: int
    out_start: int
    out_step: int

    @property
    def local_slice(self) -> slice:
        """The slice of the shard's local rows, ready for ``shard[piece.local_slice]``."""
        stop = self.start + self.count * self.step
        return slice(self.start, None if stop < 0 else stop, self.step)


@dataclass(frozen=True)
class SlicePlan:
    """Per-shard pieces of one slice, ordered by shard position in the output where possible.

    For a ``div`` layout the pieces' results, concatenated in order, are the slice itself
    (``in_order`` is True). For ``mod`` the rows of different shards interleave: concatenate the
    pieces, then place element ``i`` at ``positions()[i]``.
    """

    pieces: tuple[SlicePiece, ...]
    length: int

    @property
    def in_order(self) -> bool:
        expected = 0
        for p in self.pieces:
            if p.out_start != expected or (p.count > 1 and p.out_step != 1):
                return False
            expected += p.count
        return True

    def positions(self, device: torch.device | str | None = None) -> torch.Tensor:
        """Output position of each element of the concatenated pieces (int64)."""
        if not self.pieces:
            return torch.empty(0, dtype=torch.int64, device=device)
        return torch.cat([p.out_start + p.out_step * torch.arange(p.count, device=device) for p in self.pieces])


def normalise_slice(key: slice, num_rows: int) -> tuple[int, int, int]:
    """``key.indices(num_rows)`` with shardvar's exceptions."""
    if not isinstance(key, slice):
        raise ShardvarTypeError(f"expected a slice; got {key!r}")
    try:
        return key.indices(num_rows)
    except ValueError:
        raise ShardvarValueError(f"slice step cannot be zero; got {key}") from None
    except TypeError:
        raise ShardvarTypeError(f"slice bounds must be integers or None; got {key}") from None


def div_slice_pieces(sizes: tuple[int, ...], start: int, stop: int, step: int) -> list[SlicePiece]:
    """Pieces of the normalised slice ``range(start, stop, step)`` over contiguous shards.

    >>> [(p.shard, p.local_slice) for p in div_slice_pieces((3, 3, 2, 2), 2, 8, 2)]
    [(0, slice(2, 4, 2)), (1, slice(1, 3, 2)), (2, slice(0, 2, 2))]
    """
    pieces = []
    offsets = [0]
    for s in sizes:
        offsets.append(offsets[-1] + s)
    if step > 0:
        for shard in range(len(sizes)):
            lo, hi = max(start, offsets[shard]), min(stop, offsets[shard + 1])
            if lo >= hi:
                continue
            first = start + -(-(lo - start) // step) * step
            if first >= hi:
                continue
            count = -(-(hi - first) // step)
            pieces.append(SlicePiece(shard, first - offsets[shard], step, count, (first - start) // step, 1))
    else:
        a = -step
        for shard in reversed(range(len(sizes))):
            hi, lo = min(start, offsets[shard + 1] - 1), max(stop + 1, offsets[shard])
            if hi < lo:
                continue
            first = start - -(-(start - hi) // a) * a
            if first < lo:
                continue
            count = (first - lo) // a + 1
            pieces.append(SlicePiece(shard, first - offsets[shard], step, count, (start - first) // a, 1))
    return pieces


def mod_slice_pieces(n: int, start: int, stop: int, step: int) -> list[SlicePiece]:
    """Pieces of the normalised slice ``range(start, stop, step)`` over ``n`` mod shards."""
    length = len(range(start, stop, step))
    # Element j of the slice is id start + j*step; its shard repeats with period n / gcd(step, n),
    # so each shard's ids form an arithmetic progression with local step step / gcd.
    g = math.gcd(abs(step), n)
    period = n // g
    first_j: dict[int, int] = {}
    for j in range(min(length, period)):
        first_j.setdefault((start + j * step) % n, j)
    pieces = []
    for shard in sorted(first_j):
        j0 = first_j[shard]
        count = -(-(length - j0) // period)
        pieces.append(SlicePiece(shard, (start + j0 * step) // n, step // g, count, j0, period))
    return pieces
