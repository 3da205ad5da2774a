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

import math
import weakref
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .._errors import ShardvarDTypeError, ShardvarValueError
from .._pages import zeros_like
from .._recycle import Recycler
from .._validate import check_devices
from ..layout import Layout
from ._distinct import coalesce, sparse_rows
from ._hooks import KEEP, Reading, RowSink, RowSource, check_attached, renamed
from ._memory import adopt, allocate_shards, as_slab, check_disjoint, where
from ._plan import GroupPlan, RowOrder, SlabPlan

__all__ = ["Group", "ShardStore", "rows_2d"]


def rows_2d(shard: torch.Tensor, axis: int) -> torch.Tensor:
    """The shard as ``[rows, width]``: a view when ``axis == 0`` and the shard is contiguous."""
    moved = shard if axis == 0 else shard.movedim(axis, 0)
    return moved.reshape(moved.shape[0], math.prod(moved.shape[1:]))


@dataclass(frozen=True)
class Group:
    """Local shards read together: where their rows lie (``plan``) and the memory holding them."""

    plan: GroupPlan
    slab: torch.Tensor | None  # [rows, width] over the members' memory; None: a lone shard read as is

    # The plan's numbers, read through (the callers' names for them).
    device = property(lambda self: self.plan.device)
    members = property(lambda self: self.plan.members)
    starts = property(lambda self: self.plan.starts)
    steps = property(lambda self: self.plan.steps)
    rows = property(lambda self: self.plan.rows)


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
        # What the layers above attach (see attach and _hooks): rows owned elsewhere, a fused update, and
        # the other stores over the same memory.
        self._exchange: RowSource | None = None
        self._sink: RowSink | None = None
        self._companions: tuple[ShardStore, ...] = ()
        # While a fused optimizer keeps this mod table's shards row by row in logical order (its state in
        # that order too): the shards are put so again wherever they are moved. See moved_rows.
        self._interleaved = False
        # Tokens of pending backwards that map gradient rows by the rows' current order: rows stay put meanwhile.
        self._readers: weakref.WeakSet = weakref.WeakSet()
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
        return cls(
            layout, shape, allocate_shards(layout, shape, dtype, devs, owned, values, requires_grad), dtype=dtype
        )

    def _build(self) -> None:
        """Group the local shards by device into slabs (adopting shards into one when safe), and plan their rows."""
        groups: list[Group] = []
        sizes = self.layout.sizes
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
                plan = GroupPlan(device, tuple(members), starts, steps, tuple(sizes[s] for s in members), True)
                groups.append(Group(plan, slab))
                continue
            for s in members:
                groups.append(Group(GroupPlan(device, (s,), (0,), (1,), (sizes[s],), False), None))
        self.groups = tuple(groups)
        self.plan = SlabPlan(self.layout, tuple(g.plan for g in groups))
        # Read on every lookup; they change only here (the shards and layout are fixed at __init__).
        # How a logical id finds its full-slab row: the plan's row order (None: no full slab).
        self._order = self.plan.order
        self._full_slab = groups[0].slab if self._order is not None else None
        self._logical_slab = self._order is RowOrder.LOGICAL
        self._signature = self._current_signature()
        self.recycler = Recycler()  # per-step buffers of lookups and their gradients

    def __getstate__(self) -> dict[str, Any]:
        # A pending backward's tokens and a fused optimizer's sink belong to this process's objects: a
        # copy (pickled, or deep-copied with its module) has neither (the sink would update this table).
        return {**self.__dict__, "_readers": None, "_sink": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(renamed(state), _readers=weakref.WeakSet())

    def _interleave(self, members: list[int]) -> bool:
        return self._interleaved and len(members) == self.layout.num_shards

    # -- what the layers above attach, and the store's own state about its rows ------------------
    def attach(self, *, exchange: Any = KEEP, sink: Any = KEEP, companions: Any = KEEP) -> ShardStore:
        """Attach a :class:`RowSource` (``exchange``), a :class:`RowSink` (``sink``) or the other stores over
        this one's memory (``companions``); None (or ``()``) detaches, an argument left out stays as it is.
        All are checked before any is attached."""
        found = check_attached(self, exchange, sink, companions)
        for name, value in found.items():
            setattr(self, "_" + name, value)
        return self

    @property
    def exchange(self) -> RowSource | None:
        """The attached RowSource: fetches the rows other processes hold (None: every row is here)."""
        return self._exchange

    @property
    def sink(self) -> RowSink | None:
        """The attached RowSink: a fused optimizer's update of the full slab's rows, in backward."""
        return self._sink

    @property
    def companions(self) -> tuple[ShardStore, ...]:
        """The other stores over this one's memory (a collection's group): rows move only if none reads."""
        return self._companions

    @property
    def interleaved(self) -> bool:
        """Whether a fused optimizer keeps this mod table's shards row by row in logical order."""
        return self._interleaved

    def with_shards(self, shards: Mapping[int, torch.Tensor], *, dtype: torch.dtype | None = None) -> ShardStore:
        """A store of this layout and shape over other ``shards`` (a module's replaced ones), with this
        one's exchange: the rows it does not hold are still found where they live."""
        store = ShardStore(self.layout, self.shape, shards, dtype=dtype)
        store._exchange = self._exchange  # checked when attached here
        return store

    def reading(self) -> object:
        """A token that a pending backward holds: while it lives, the rows stay where they lie (as the
        gradient rows it maps assume). A compiled graph gets one that holds nothing."""
        token = Reading()
        if not torch.compiler.is_compiling():
            self._readers.add(token)
        return token

    @property
    def rows_held(self) -> bool:
        """Whether a pending backward (a live :meth:`reading` token) keeps the rows where they lie."""
        return bool(self._readers)

    def moved_rows(self, interleaved: bool) -> None:
        """Note that the rows were moved in place to lie row by row in logical order (``interleaved``) or
        back to back (``_relayout``), and rebuild the slabs over them."""
        self._interleaved = interleaved
        self.refresh()

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
    def row_order(self) -> RowOrder | None:
        """How the full slab holds the logical rows (None: no full slab)."""
        return self._order

    @property
    def rows_as_kept(self) -> bool:
        """Whether the full slab's rows lie as this store's lookups read them, kept row by row
        (``interleaved``) or back to back: False when there is no full slab or its rows must move."""
        return self._order is not None and self._order.as_kept(self.interleaved)

    def slab_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The full slab's row of each valid logical id."""
        return ids if self._logical_slab else self._order.slab_rows(self.plan, ids)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._shards.values())

    def route(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(group index, row within the group) of each valid logical id held locally (-1: not local)."""
        return self.plan.route(ids)

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
        plan = (self.groups[g] if group is None else group).plan
        out, rest = {}, _rest(self.shape, self.layout.axis)
        for k, s in enumerate(plan.members):
            piece = grad[plan.member_slice(k)].view(plan.sizes[k], *rest)
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
        plan = (self.groups[g] if group is None else group).plan  # as in split_grad
        interleaved = plan.interleaved
        if values.is_floating_point() and rows.numel() and (interleaved or not coalesced):
            # Keyed member by member (each member's rows back to back), so each member is one run.
            key = plan.member_major(rows)
            rows, values = coalesce(key, values, plan.rows, (self.recycler, ("sparse grad", g)))
            coalesced, interleaved = True, False
        if len(plan.members) == 1:
            return {plan.members[0]: sparse_rows(rows, values, plan.sizes[0], coalesced)}
        if coalesced and not interleaved:
            return self._cut_runs(plan, rows, values)
        return self._split_unsorted(plan, rows, values)

    def _cut_runs(self, plan: GroupPlan, keys: torch.Tensor, values: torch.Tensor) -> dict[int, torch.Tensor]:
        """Coalesced gradients per member from distinct ascending member-major ``keys``: views."""
        counts, local = plan.cut(keys)
        return {
            s: sparse_rows(rows_s, values_s, size, True)
            for s, size, rows_s, values_s in zip(
                plan.members, plan.sizes, local.split(counts), values.split(counts), strict=True
            )
        }

    def _split_unsorted(self, group: GroupPlan, rows: torch.Tensor, values: torch.Tensor) -> dict[int, torch.Tensor]:
        """Uncoalesced gradients per member (a dtype ``coalesce`` does not sum): one reorder, then views."""
        member, local = group.locate(rows)
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


def _rest(shape: Sequence[int], axis: int) -> tuple[int, ...]:
    return (*shape[:axis], *shape[axis + 1 :])
