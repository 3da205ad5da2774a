"""ShardStore: the local shards of one logical variable, and the slabs that back them.

Every sharded thing (ShardedVariable, ShardedEmbedding(Bag), the distributed variable, the
checkpoint's view of them) keeps its shards in a store. Shards that lie back to back in one
allocation on one device form a *slab*: a ``[rows, width]`` tensor over their memory, so a
lookup or scatter update over all of them is one kernel. A store holds all shards of a local
variable, or a rank's own shards of a distributed one (``exchange`` then fetches the others).

Shards that the user allocated one by one are moved into one slab per device when that is safe
(no other tensor shares their memory, they are leaves): the tensor objects keep their identity
and values, only their memory moves (``Tensor.set_``), so the fast path is the only path.
"""

from __future__ import annotations

import itertools
import math
import weakref
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .._errors import ShardvarDTypeError, ShardvarValueError
from .._pages import empty, zeros_like
from .._recycle import Recycler
from .._validate import check_devices
from ..layout import Layout
from ._distinct import coalesce, sparse_rows
from ._group_rows import locate, member_major
from ._memory import adopt, as_slab, check_disjoint, where

__all__ = ["Group", "ShardStore", "rows_2d"]


def rows_2d(shard: torch.Tensor, axis: int) -> torch.Tensor:
    """The shard as ``[rows, width]``: a view when ``axis == 0`` and the shard is contiguous."""
    moved = shard if axis == 0 else shard.movedim(axis, 0)
    return moved.reshape(moved.shape[0], math.prod(moved.shape[1:]))


@dataclass(frozen=True)
class Group:
    """Local shards read together: one slab on one device, or a single shard on its own."""

    device: torch.device
    members: tuple[int, ...]  # shard indices, in the order their rows lie in the group
    starts: tuple[int, ...]  # first row of each member within the group
    steps: tuple[int, ...]  # and the distance between its rows (1, or n for mod shards interleaved)
    rows: int
    slab: torch.Tensor | None  # [rows, width] over the members' memory; None: a lone shard read as is


def _check_shards(shards: Mapping[int, torch.Tensor], layout: Layout, shape: torch.Size) -> torch.dtype:
    dtypes = {t.dtype for t in shards.values()}
    if len(dtypes) > 1:
        raise ShardvarDTypeError(f"all shards must have the same dtype; got {sorted(str(d) for d in dtypes)}")
    for s, t in shards.items():
        expected = layout.shard_shape(shape, s)
        if tuple(t.shape) != expected:
            raise ShardvarValueError(f"shard {s} has shape {list(t.shape)}; layout {layout} expects {list(expected)}")
    check_disjoint(shards)
    return dtypes.pop() if dtypes else torch.float32


class ShardStore:
    """The local shards of a logical variable of ``shape`` laid out by ``layout``, with their slabs.

    >>> store = ShardStore.allocate(Layout.mod(6, 2), (6, 3), torch.float32)
    >>> store.full_slab.shape, sorted(store.local_shards())
    (torch.Size([6, 3]), [0, 1])
    """

    def __init__(
        self,
        layout: Layout,
        shape: Sequence[int],
        shards: Mapping[int, torch.Tensor],
        *,
        dtype: torch.dtype | None = None,
        adopt: bool = True,
    ) -> None:
        self.layout = layout
        self.shape = torch.Size(layout.check_shape(shape))
        self._shards = dict(sorted(shards.items()))
        # Plain tensors' data_ptr() says where their data lives (every lookup asks: see refresh).
        self._plain = all(type(t) in (torch.Tensor, torch.nn.Parameter) for t in self._shards.values())
        self.dtype = _check_shards(self._shards, layout, self.shape) if self._shards else (dtype or torch.float32)
        self.adopt = adopt
        self.exchange: Any = None  # set by the distributed layer: fetches rows owned elsewhere
        # Set by a fused optimizer: ``sink(full slab rows, their summed gradient)`` updates those rows
        # in backward; a collection's sparse backward hands a table's rows to it, not to .grad.
        self.sink: Any = None
        # Set while a fused optimizer keeps this mod table's shards row by row in logical order (its
        # state in that order too): the shards are put so again wherever they are moved.
        self.interleaved = False
        self.companions: tuple[ShardStore, ...] = ()  # other stores over the same memory (a collection's)
        # Tokens of pending backwards that map gradient rows by the rows' current order: rows stay put meanwhile.
        self.readers: weakref.WeakSet = weakref.WeakSet()
        self._build()

    # -- construction ---------------------------------------------------------------------------
    @classmethod
    def allocate(
        cls,
        layout: Layout,
        shape: Sequence[int],
        dtype: torch.dtype,
        *,
        devices: Sequence[torch.device | str] | None = None,
        owned: Sequence[int] | None = None,
        values: torch.Tensor | Callable[[int], torch.Tensor] | None = None,
        requires_grad: bool = False,
    ) -> ShardStore:
        """New shards (``owned``, default all), one slab per device when split along axis 0.

        ``values`` is the logical tensor to copy in, or ``shard -> tensor`` giving each owned
        shard's value; without it the shards are uninitialised.
        """
        shape = torch.Size(layout.check_shape(shape))
        owned = list(range(layout.num_shards)) if owned is None else sorted(owned)
        devs = check_devices(devices, layout.num_shards) if devices is not None else None
        default = values.device if isinstance(values, torch.Tensor) else torch.device("cpu")
        where = {s: devs[s] if devs else default for s in owned}
        parts = layout.split(values) if isinstance(values, torch.Tensor) else None
        shards: dict[int, torch.Tensor] = {}
        for device in dict.fromkeys(where.values()):
            members = [s for s in owned if where[s] == device]
            for s, piece in zip(members, _empty_shards(layout, shape, dtype, device, members), strict=True):
                if parts is not None or callable(values):
                    with torch.no_grad():
                        piece.copy_(parts[s] if parts is not None else values(s))
                shards[s] = torch.nn.Parameter(piece, requires_grad=True) if requires_grad else piece
        return cls(layout, shape, shards, dtype=dtype)

    def _build(self) -> None:
        """Group the local shards by device into slabs (adopting shards into one when safe)."""
        groups: list[Group] = []
        by_device: dict[torch.device, list[int]] = {}
        for s, t in self._shards.items():
            by_device.setdefault(t.device, []).append(s)
        for device, members in by_device.items():
            tensors = [self._shards[s] for s in members]
            # Shards shardvar allocates or adopts are contiguous: torch's sparse ``add_`` (every torch
            # sparse optimizer's update) refuses strided leaf parameters (its slow path checks them in
            # worker threads, with grad mode on). A mod table's shards laid row by row in logical order
            # (a user's ``t[s::n]``, or a fused optimizer's table: see ``interleave``) are used in place.
            found = as_slab(tensors) if self.layout.axis == 0 else None
            if found is None and self.layout.axis == 0 and self.adopt and adopt(tensors, self._interleave(members)):
                found = as_slab(tensors)
            if found is not None:
                slab, starts, steps = found
                groups.append(Group(device, tuple(members), starts, steps, slab.shape[0], slab))
                continue
            for s in members:
                groups.append(Group(device, (s,), (0,), (1,), self.layout.sizes[s], None))
        self.groups = tuple(groups)
        # Read on every lookup; they change only here (the shards and layout are fixed at __init__).
        one = self.groups[0] if len(self.groups) == 1 and self.is_complete else None
        self._full_slab = one.slab if one is not None else None
        # How a logical id finds its full-slab row: it is the row, the layout's storage row (shards back
        # to back in order), or else found by its shard's run in the slab (``route``).
        self._order = _order(one, self.layout) if self._full_slab is not None else None
        self._logical_slab = self._order == "logical"
        # Each member's first row with the members back to back in member order (member-major keys).
        self._firsts = tuple(
            (0, *itertools.accumulate(self.layout.sizes[s] for s in g.members[:-1])) for g in self.groups
        )
        self._signature = self._current_signature()
        self._routes: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
        self.recycler = Recycler()  # per-step buffers of lookups and their gradients

    def __getstate__(self) -> dict[str, Any]:
        # A pending backward's tokens and a fused optimizer's sink belong to this process's objects: a
        # copy (pickled, or deep-copied with its module) has neither (the sink would update this table).
        return {**self.__dict__, "readers": None, "sink": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, readers=weakref.WeakSet())

    def _interleave(self, members: list[int]) -> bool:
        return self.interleaved and len(members) == self.layout.num_shards

    def _current_signature(self) -> list:
        # Where each shard's data lives: it moves with param.data = ..., module.to(...), set_(...).
        # data_ptr() is one cheap call for plain tensors; subclasses (which may intercept it) and
        # tensors without storage are identified by their storage instead.
        if self._plain:
            try:
                return list(map(torch.Tensor.data_ptr, self._shards.values()))  # no Python frame per shard
            except RuntimeError:
                pass  # a shard without storage (a torch.func wrapper): ``where`` names it
        return [where(t) for t in self._shards.values()]

    def refresh(self) -> ShardStore:
        """Rebuild the slabs if a shard's memory changed (``param.data = ...``, ``module.to(...)``)."""
        if self._current_signature() != self._signature:
            self.dtype = _check_shards(self._shards, self.layout, self.shape)
            self._build()
        return self

    # -- what it holds --------------------------------------------------------------------------
    def local_shards(self) -> dict[int, torch.Tensor]:
        """This process's shards by shard index (the same objects, not copies)."""
        return dict(self._shards)

    @property
    def is_complete(self) -> bool:
        """Whether every shard is local (a local variable, or a distributed one on one rank)."""
        return len(self._shards) == self.layout.num_shards

    @property
    def row_shape(self) -> tuple[int, ...]:
        return _rest(self.shape, self.layout.axis)

    @property
    def width(self) -> int:
        return math.prod(self.row_shape)

    @property
    def full_slab(self) -> torch.Tensor | None:
        """The whole table as one ``[rows, width]`` tensor in storage order, when one slab holds it."""
        return self._full_slab

    @property
    def logical_slab(self) -> bool:
        """Whether the full slab's rows are the logical rows (div shards in order, interleaved mod shards)."""
        return self._logical_slab

    @property
    def row_order(self) -> str | None:
        """How the full slab holds the logical rows: "logical", "storage" or "runs" (None: no full slab)."""
        return self._order

    def slab_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The full slab's row of each valid logical id."""
        if self._logical_slab:
            return ids
        if self._order == "storage":
            return self.layout.strategy.storage_rows(self.layout.sizes, ids)
        return self.route(ids)[1]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._shards.values())

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

    def group_rows(self, g: int) -> torch.Tensor:
        """Group ``g``'s rows as ``[rows, width]`` (its slab, or its lone shard reshaped)."""
        group = self.groups[g]
        if group.slab is not None:
            return group.slab
        return rows_2d(self._shards[group.members[0]], self.layout.axis)

    # -- gradients --------------------------------------------------------------------------------
    def split_grad(self, g: int, grad: torch.Tensor, group: Group | None = None) -> dict[int, torch.Tensor]:
        """Group ``g``'s dense ``[rows, width]`` gradient as one gradient per member shard (views); ``group``:
        its rows as they lay when the gradient's rows were read, if they have moved since."""
        group = self.groups[g] if group is None else group
        out = {}
        for s, first, step in zip(group.members, group.starts, group.steps, strict=True):
            size = self.layout.sizes[s]
            moved = (size, *_rest(self.shape, self.layout.axis))
            piece = grad[first : first + step * (size - 1) + 1 : step] if size else grad[first:first]
            piece = piece.view(moved)
            out[s] = piece if self.layout.axis == 0 else piece.movedim(0, self.layout.axis)
        return out

    def dense_grad(self, g: int, rows: torch.Tensor, values: torch.Tensor) -> dict[int, torch.Tensor]:
        """Group ``g``'s dense gradient, ``values`` added at group rows ``rows``, as one per member shard.

        Its memory is the last one's once nothing holds that (``zero_grad()`` dropped it): see
        :mod:`shardvar._recycle`.
        """
        info = self.groups[g]
        grad = self.recycler.take(("grad", g), (info.rows, self.width), self.dtype, info.device, zero=True)
        return self.split_grad(g, grad.index_add_(0, rows, values))

    def split_sparse_grad(
        self, g: int, rows: torch.Tensor, values: torch.Tensor, coalesced: bool = False, group: Group | None = None
    ) -> dict[int, torch.Tensor]:
        """Sparse COO gradients per member shard from group rows ``rows`` and their ``values``.

        ``coalesced``: the rows are distinct and ascending (a collection's summed gradient). Floating
        point gradients come out coalesced, whatever came in: one radix sort and a segment sum here
        (:func:`coalesce`) leave each member's rows one run, cut out as views, and spare sparse
        optimizers most of their own ``coalesce()`` (torch's AccumulateGrad drops the coalesced
        flag, but re-sorting distinct sorted rows is cheap: SparseAdam's step 0.7-0.95x torch's).
        """
        group = self.groups[g] if group is None else group  # as in split_grad
        sizes = [self.layout.sizes[s] for s in group.members]
        interleaved = any(st > 1 for st in group.steps)
        if values.is_floating_point() and rows.numel() and (interleaved or not coalesced):
            # Keyed member by member (each member's rows back to back), so each member is one run.
            key = member_major(group.starts, group.steps, sizes, rows)
            rows, values = coalesce(key, values, group.rows, (self.recycler, ("sparse grad", g)))
            coalesced, interleaved = True, False
        if len(group.members) == 1:
            s = group.members[0]
            return {s: sparse_rows(rows, values, self.layout.sizes[s], coalesced)}
        if coalesced and not interleaved:
            return self._cut_runs(g, rows, values)
        return self._split_unsorted(group, rows, values)

    def _cut_runs(self, g: int, keys: torch.Tensor, values: torch.Tensor) -> dict[int, torch.Tensor]:
        """Coalesced gradients per member from distinct ascending member-major ``keys``: views."""
        group = self.groups[g]
        firsts = torch.tensor(self._firsts[g], dtype=keys.dtype, device=keys.device)
        cuts = torch.searchsorted(keys, firsts)
        counts = torch.diff(cuts, append=cuts.new_tensor([keys.numel()]))
        local = keys - firsts.repeat_interleave(counts, output_size=keys.numel())
        sizes = counts.tolist()
        return {
            s: sparse_rows(rows_s, values_s, self.layout.sizes[s], True)
            for s, rows_s, values_s in zip(group.members, local.split(sizes), values.split(sizes), strict=True)
        }

    def _split_unsorted(self, group: Group, rows: torch.Tensor, values: torch.Tensor) -> dict[int, torch.Tensor]:
        """Uncoalesced gradients per member (a dtype ``coalesce`` does not sum): one reorder, then views."""
        member, local = locate(group.starts, group.steps, [self.layout.sizes[s] for s in group.members], rows)
        # A stable sort of the member index, in the narrowest dtype that holds it: torch sorts
        # small integer keys by radix, several times faster than sorting the rows themselves.
        narrow = torch.uint8 if len(group.members) <= 256 else torch.int32
        order = torch.argsort(member.to(narrow), stable=True)
        counts = torch.bincount(member, minlength=len(group.members)).tolist()
        local, values = local.index_select(0, order), values.index_select(0, order)
        return {
            s: sparse_rows(rows_s, values_s, self.layout.sizes[s])
            for s, rows_s, values_s in zip(group.members, local.split(counts), values.split(counts), strict=True)
        }

    def zero_grads(self, sparse: bool, skip: Collection[int] = ()) -> dict[int, torch.Tensor]:
        """A zero gradient for every local shard not in ``skip`` (sparse COO, or dense)."""
        shards = {s: t for s, t in self._shards.items() if s not in skip}
        if sparse:
            return {
                s: sparse_rows(
                    torch.empty(0, dtype=torch.int64, device=t.device), t.new_empty(0, self.width), t.shape[0]
                )
                for s, t in shards.items()
            }
        return {s: zeros_like(t) for s, t in shards.items()}

    def __repr__(self) -> str:
        slabs = sum(g.slab is not None for g in self.groups)
        return (
            f"ShardStore(shape={list(self.shape)}, dtype={self.dtype}, layout={self.layout}, "
            f"local={list(self._shards)}, groups={len(self.groups)}, slabs={slabs})"
        )


def _order(group: Group, layout: Layout) -> str:
    """How the logical rows lie in a complete store's one group: "logical" (its rows), "storage"
    (the shards back to back in shard order: the layout's storage rows) or "runs" (anything else)."""
    sizes, back_to_back = layout.sizes, all(step == 1 for step in group.steps)
    if back_to_back and list(group.members) == sorted(group.members):  # the common case, decided cheaply
        one = layout.contiguous or layout.num_shards == 1 or all(sizes[s] <= 1 for s in group.members)
        return "logical" if one else "storage"
    spans = [layout.strategy.progression(sizes, s) for s in group.members]
    if all(
        sizes[s] == 0 or (a, b if sizes[s] > 1 else 1) == (start, step if sizes[s] > 1 else 1)
        for s, (a, b), start, step in zip(group.members, spans, group.starts, group.steps, strict=True)
    ):
        return "logical"
    return "runs"


def _rest(shape: Sequence[int], axis: int) -> tuple[int, ...]:
    return (*shape[:axis], *shape[axis + 1 :])


def _empty_shards(
    layout: Layout, shape: torch.Size, dtype: torch.dtype, device: torch.device, members: list[int]
) -> list[torch.Tensor]:
    # Along axis 0 the shards are consecutive pieces of one slab, each contiguous (torch's sparse
    # ``add_`` fails on strided leaf parameters: see _relayout). Along another axis a slab would buy
    # nothing (rows are not contiguous), so each shard is its own tensor.
    if layout.axis != 0:
        return [empty(layout.shard_shape(shape, s), dtype=dtype, device=device) for s in members]
    rows = [layout.sizes[s] for s in members]
    slab = empty((sum(rows), *shape[1:]), dtype=dtype, device=device)
    return list(slab.split(rows)) if members else []
