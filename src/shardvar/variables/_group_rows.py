"""Where a slab group's rows belong: the member (shard) and its local row of each slab row.

A group's members lie in runs (see :func:`~shardvar.variables._memory.as_slab`): a shard whose rows
follow each other, or the ``m`` shards of a mod table laid row by row in logical order. Both kinds
may share one slab (a collection's tables, some of them interleaved by a fused optimizer).
"""

from __future__ import annotations

import torch

__all__ = ["locate", "member_major", "runs"]


def runs(starts: tuple[int, ...], steps: tuple[int, ...]) -> list[tuple[int, int, int]]:
    """(first slab row, step, first member position) of each run of a group's members."""
    out, k = [], 0
    while k < len(starts):
        out.append((starts[k], steps[k], k))
        k += steps[k]
    return out


def locate(
    starts: tuple[int, ...], steps: tuple[int, ...], sizes: list[int], rows: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(member position, local row) of each group row in ``rows`` (members with ``starts``, ``steps``
    and ``sizes``, in order)."""
    n = len(starts)
    if all(st == 1 for st in steps):
        first = torch.tensor(starts, dtype=rows.dtype, device=rows.device)
        member = _member(rows, sizes, first)
        return member, rows - first.index_select(0, member)
    if steps == (n,) * n and starts == tuple(range(n)):  # one mod table in logical order
        return rows.remainder(n), rows.div(n, rounding_mode="floor")
    spans = runs(starts, steps)
    first, step, lead = (torch.tensor(x, dtype=rows.dtype, device=rows.device) for x in zip(*spans, strict=True))
    run = torch.bucketize(rows, first[1:], right=True)
    offset, every = rows - first.index_select(0, run), step.index_select(0, run)
    return lead.index_select(0, run) + offset.remainder(every), offset.div(every, rounding_mode="floor")


def member_major(starts: tuple[int, ...], steps: tuple[int, ...], sizes: list[int], rows: torch.Tensor) -> torch.Tensor:
    """Group rows as positions in the members laid back to back in member order (each member's rows
    one run, ascending as its local rows): the rows themselves when no member is interleaved."""
    if all(st == 1 for st in steps):
        return rows
    member, local = locate(starts, steps, sizes, rows)
    firsts = torch.tensor([0, *sizes[:-1]], dtype=rows.dtype, device=rows.device).cumsum(0)
    return firsts.index_select(0, member).add_(local)


def _member(rows: torch.Tensor, sizes: list[int], starts: torch.Tensor) -> torch.Tensor:
    """Which of consecutive members (``sizes`` rows each) holds each row. Balanced sizes (q + 1 rows
    for the first members, q for the rest: every div layout shardvar makes) need only a division,
    several times faster than a binary search per row."""
    q = sizes[-1]
    big = sum(1 for x in sizes if x == q + 1)
    if q == 0 or sizes != [q + 1] * big + [q] * (len(sizes) - big):
        return torch.bucketize(rows, starts[1:], right=True)
    if big == 0:
        return torch.div(rows, q, rounding_mode="floor")
    cut = big * (q + 1)
    head = torch.div(rows, q + 1, rounding_mode="floor")
    return (
        head
        if big == len(sizes)
        else torch.where(rows < cut, head, big + torch.div(rows - cut, q, rounding_mode="floor"))
    )
