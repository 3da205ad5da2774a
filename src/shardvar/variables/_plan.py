"""Where a store's rows live: the row arithmetic of its slabs, computed once per rebuild.

A :class:`SlabPlan` is the one place that maps a logical id to its shard and row, to its slab
and row there (``route``, ``slab_rows``), and a slab row back to its member shard and local row
(``GroupPlan.locate``). It holds numbers only (members, starts, steps, sizes, the row order);
what holds the rows (slab memory today, see :mod:`._memory`) sits behind it, not in it.

A group's members lie in runs (see :func:`~shardvar.variables._memory.as_slab`): a shard whose
rows follow each other, or the ``m`` shards of a mod table laid row by row in logical order. Both
kinds may share one slab (a collection's tables, some of them interleaved by a fused optimizer).
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field

import torch

from ..layout import Layout

__all__ = ["GroupPlan", "RowOrder", "SlabPlan", "storage_ids"]


class RowOrder(enum.Enum):
    """How a complete store's one slab holds the logical rows; each order maps ids to slab rows itself."""

    LOGICAL = "logical"  # slab row i is logical row i (div shards in order, interleaved mod shards)
    STORAGE = "storage"  # the shards back to back in shard order: the layout's storage rows
    RUNS = "runs"  # anything else: each id found through its shard's run (SlabPlan.route)

    def slab_rows(self, plan: SlabPlan, ids: torch.Tensor) -> torch.Tensor:
        """The full slab's row of each valid logical id."""
        if self is RowOrder.LOGICAL:
            return ids
        if self is RowOrder.STORAGE:
            return plan.layout.strategy.storage_rows(plan.layout.sizes, ids)
        return plan.route(ids)[1]

    def as_kept(self, interleaved: bool) -> bool:
        """Whether rows in this order lie as a table kept row by row (``interleaved``, by a fused
        optimizer) or back to back reads them: else they must move (a collection moves them)."""
        return self is RowOrder.LOGICAL or (self is RowOrder.STORAGE and not interleaved)


@dataclass(frozen=True)
class GroupPlan:
    """The rows of local shards read together: one slab on one device, or a lone shard read as is."""

    device: torch.device
    members: tuple[int, ...]  # shard indices, in the order their rows lie in the group
    starts: tuple[int, ...]  # first row of each member within the group
    steps: tuple[int, ...]  # and the distance between its rows (1, or n for mod shards interleaved)
    sizes: tuple[int, ...]  # rows of each member
    slab: bool  # whether the members are read through one [rows, width] slab (False: a lone shard)
    rows: int = field(init=False)
    firsts: tuple[int, ...] = field(init=False, repr=False)  # each member's first row, members back to back

    def __post_init__(self) -> None:
        object.__setattr__(self, "rows", sum(self.sizes))
        object.__setattr__(self, "firsts", (0, *itertools.accumulate(self.sizes[:-1])))

    @property
    def interleaved(self) -> bool:
        """Whether a member's rows lie apart (mod shards laid row by row)."""
        return any(step > 1 for step in self.steps)

    def runs(self) -> list[tuple[int, int, int]]:
        """(first group row, step, first member position) of each run of the members."""
        out, k = [], 0
        while k < len(self.starts):
            out.append((self.starts[k], self.steps[k], k))
            k += self.steps[k]
        return out

    def member_slice(self, k: int) -> slice:
        """Member ``k``'s rows of the group, in local order, as a slice."""
        first, step, size = self.starts[k], self.steps[k], self.sizes[k]
        return slice(first, first + step * (size - 1) + 1, step) if size else slice(first, first)

    def to_group(self, k: int, local: torch.Tensor) -> torch.Tensor:
        """The group rows of member ``k``'s local rows ``local``."""
        return self.starts[k] + self.steps[k] * local

    def member_rows(self, k: int, device: torch.device) -> torch.Tensor:
        """Every group row of member ``k``, in local order."""
        return self.to_group(k, torch.arange(self.sizes[k], device=device))

    def to_member_major(self, k: int, local: torch.Tensor) -> torch.Tensor:
        """Member ``k``'s local rows as positions in the members laid back to back in member order."""
        return self.firsts[k] + local

    def locate(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(member position, local row) of each group row in ``rows``."""
        starts, steps, n = self.starts, self.steps, len(self.starts)
        if all(st == 1 for st in steps):
            first = torch.tensor(starts, dtype=rows.dtype, device=rows.device)
            member = _member(rows, list(self.sizes), first)
            return member, rows - first.index_select(0, member)
        if steps == (n,) * n and starts == tuple(range(n)):  # one mod table in logical order
            return rows.remainder(n), rows.div(n, rounding_mode="floor")
        spans = self.runs()
        first, step, lead = (torch.tensor(x, dtype=rows.dtype, device=rows.device) for x in zip(*spans, strict=True))
        run = torch.bucketize(rows, first[1:], right=True)
        offset, every = rows - first.index_select(0, run), step.index_select(0, run)
        return lead.index_select(0, run) + offset.remainder(every), offset.div(every, rounding_mode="floor")

    def member_major(self, rows: torch.Tensor) -> torch.Tensor:
        """Group rows as positions in the members laid back to back in member order (each member's rows
        one run, ascending as its local rows): the rows themselves when no member is interleaved."""
        if all(st == 1 for st in self.steps):
            return rows
        member, local = self.locate(rows)
        firsts = torch.tensor(self.firsts, dtype=rows.dtype, device=rows.device)
        return firsts.index_select(0, member).add_(local)

    def cut(self, keys: torch.Tensor) -> tuple[list[int], torch.Tensor]:
        """(count per member, local rows) of distinct ascending member-major ``keys``."""
        firsts = torch.tensor(self.firsts, dtype=keys.dtype, device=keys.device)
        cuts = torch.searchsorted(keys, firsts)
        counts = torch.diff(cuts, append=cuts.new_tensor([keys.numel()]))
        local = keys - firsts.repeat_interleave(counts, output_size=keys.numel())
        return counts.tolist(), local


@dataclass(frozen=True, eq=False)
class SlabPlan:
    """Where each local row of a store lives: its groups, and how its one slab (if any) holds the rows.

    >>> plan = SlabPlan(Layout.mod(6, 2), (GroupPlan(torch.device("cpu"), (0, 1), (0, 3), (1, 1), (3, 3), True),))
    >>> plan.order, plan.slab_rows(torch.tensor([0, 1, 2])).tolist()
    (<RowOrder.STORAGE: 'storage'>, [0, 3, 1])
    """

    layout: Layout
    groups: tuple[GroupPlan, ...]
    order: RowOrder | None = field(init=False)  # None: no slab holds every shard
    _routes: dict = field(init=False, repr=False, default_factory=dict)  # per device: see route

    def __post_init__(self) -> None:
        one = self.groups[0] if len(self.groups) == 1 else None
        full = one is not None and one.slab and len(one.members) == self.layout.num_shards
        object.__setattr__(self, "order", _order(one, self.layout) if full else None)

    def slab_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The full slab's row of each valid logical id (a plan with a full slab only)."""
        return self.order.slab_rows(self, ids)

    def route(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(group index, row within the group) of each valid logical id held locally (-1: not local)."""
        device = ids.device
        if device not in self._routes:
            n = self.layout.num_shards
            group_of = torch.full((n,), -1, dtype=torch.int64)
            start, step = torch.zeros(n, dtype=torch.int64), torch.ones(n, dtype=torch.int64)
            for g, group in enumerate(self.groups):
                for s, first, k in zip(group.members, group.starts, group.steps, strict=True):
                    group_of[s], start[s], step[s] = g, first, k
            self._routes[device] = (group_of.to(device), start.to(device), step.to(device))
        group_of, start, step = self._routes[device]
        shard, row = self.layout.strategy.locate(self.layout.sizes, ids)
        # index_select: several times faster than tensor indexing for a gather along one dimension.
        return group_of.index_select(0, shard), start.index_select(0, shard).addcmul_(step.index_select(0, shard), row)


def storage_ids(layout: Layout, rows: torch.Tensor) -> torch.Tensor:
    """The logical ids of ``rows`` of a layout of equal shards laid back to back in shard order (its
    storage rows): row ``r`` is shard ``r // q``'s row ``r % q``."""
    q = layout.num_rows // layout.num_shards
    return layout.strategy.global_ids(layout.sizes, rows.div(q, rounding_mode="floor"), rows.remainder(q))


def _order(group: GroupPlan, layout: Layout) -> RowOrder:
    """How the logical rows lie in a complete store's one group."""
    sizes, back_to_back = layout.sizes, all(step == 1 for step in group.steps)
    if back_to_back and list(group.members) == sorted(group.members):  # the common case, decided cheaply
        one = layout.contiguous or layout.num_shards == 1 or all(sizes[s] <= 1 for s in group.members)
        return RowOrder.LOGICAL if one else RowOrder.STORAGE
    spans = [layout.strategy.progression(sizes, s) for s in group.members]
    if all(
        sizes[s] == 0 or (a, b if sizes[s] > 1 else 1) == (start, step if sizes[s] > 1 else 1)
        for s, (a, b), start, step in zip(group.members, spans, group.starts, group.steps, strict=True)
    ):
        return RowOrder.LOGICAL
    return RowOrder.RUNS


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
