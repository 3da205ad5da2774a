"""Updates inside backward: each shard is updated as soon as its gradient is accumulated.

``fuse(optimizer)`` registers ``register_post_accumulate_grad_hook`` on every shard of every
table: the hook takes the shard's gradient and drops it from the shard at once. A dense gradient
is applied there and then, so no gradient of the table's size exists at any time (one lives for
one shard at a time). Sparse gradients (a few touched rows each) are applied when the backward
ends, those of all shards of a table's slab in one update: one read-modify-write of the touched
rows and their state per table, not one per shard (8 mod shards would be 8 passes of small ops).
The step count of each table advances once per backward, at its end. ``optimizer.step()`` then
has nothing left to do; ``handle.remove()`` restores the ordinary behaviour.

A table held in one slab also gets a sink (``ShardStore.attach(sink=...)``): a sparse collection's backward
sums its rows' gradient and hands it straight to the update, table by table and a slice of rows
at a time (``variables._bag_grad.SINK_BYTES``), each slice updated before the next is summed, so neither
the gradients of all tables nor a whole table's exist at once (FBGEMM's fused backward).
A collection called twice before one backward thus updates its tables once per call, as
FBGEMM's does; a table read twice by other lookups is updated once, with the summed gradient.

A fused optimizer owns its tables' updates, so it also lays each local mod table of equal shards
row by row in logical order (shard ``s`` the rows ``s, s + n, ...`` of the table's memory, its
state alike; :mod:`shardvar.variables._relayout`): a lookup's ids are then its rows, with no
arithmetic and no range check of its own. ``remove()`` lays them back to back again: torch's
sparse optimizers cannot update strided shards. A tensor that views a table's memory keeps it from
being laid row by row; at ``remove()`` it keeps the old memory (as after ``module.to()``, it no
longer sees the shards). A pending backward keeps the rows put (see ``variables._relayout``);
``remove()`` warns when one keeps a table row by row.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch

from .._errors import ShardvarValueError
from ..variables import deinterleave, interleave, storage_ids
from ._base import TableOptimizer, _summed
from ._tables import Table, TierTable

__all__ = ["fuse", "FusedHandle"]


class FusedHandle:
    """The hooks ``fuse`` registered; ``remove()`` takes them away."""

    def __init__(self, optimizer: TableOptimizer) -> None:
        self.optimizer = optimizer
        self._hooks: list[Any] = []
        self._pending: dict[int, Table] = {}  # tables updated in the running backward
        # (table, slab group) -> sparse gradients of its members by position, applied at the end
        self._sparse: dict[tuple[int, int], tuple[Table, dict[str, Any], dict[int, torch.Tensor]]] = {}
        self._interleaved: list[Table] = []  # mod tables laid row by row in logical order by attach

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        for t in self.optimizer.tables:
            if isinstance(t, TierTable):
                t.tier.sink = None
            else:
                t.store.attach(sink=None)
        for t in self._interleaved:  # back to contiguous shards, which torch's sparse optimizers can update
            if t.store.interleaved and not deinterleave(t.store, _row_state(t)):
                warnings.warn(
                    f"table {t.name!r} stays laid row by row (its shards strided): a backward that reads its rows "
                    "is still pending. torch's sparse optimizers cannot update strided shards; run or drop that "
                    "backward, then fuse and remove again to lay them back to back",
                    stacklevel=2,
                )
        self._interleaved.clear()
        self.optimizer._fused = None

    def attach(self, tables: list[Table], group: dict[str, Any]) -> None:
        """Update ``tables`` (of param group ``group``) inside backward from now on; a frozen table (no shard
        requires grad) is left alone, as ``step()`` leaves a parameter without a gradient."""
        for t in tables:
            if isinstance(t, TierTable):  # its update runs in its lookup's backward, on its cache's slots
                if t.anchor.requires_grad:
                    t.tier.sink = self._tier_sink(t, group)
                continue
            shards = t.store.local_shards()
            if not any(p.requires_grad for p in shards.values()):
                continue
            if t.store.full_slab is not None and len(t.store.groups) == 1:  # a collection updates it in backward
                # Ids are then its rows: lookups do no arithmetic. One left so by an earlier handle (a backward
                # was pending at its remove) is this one's to lay back.
                if interleave(t.store, _row_state(t)) or t.store.interleaved:
                    self._interleaved.append(t)
                t.store.attach(sink=self._sink(t, group))
            for g, store_group in enumerate(t.store.groups):
                for k, s in enumerate(store_group.members):
                    if shards[s].requires_grad:
                        hook = self._hook(t, group, g, k)
                        self._hooks.append(shards[s].register_post_accumulate_grad_hook(hook))

    def _finish(self) -> None:
        sparse, self._sparse = self._sparse, {}
        try:
            with torch.no_grad():
                for (_, g), (table, group, grads) in sparse.items():
                    self.optimizer._update_sparse(table, group, g, grads, int(table.step) + 1)
        finally:
            for t in self._pending.values():
                t.step += 1
            self._pending.clear()

    def _begin(self, table: Table) -> None:
        """Note ``table`` as updated in the running backward (its step count advances when it ends)."""
        if id(table) not in self._pending:
            if not self._pending:  # once per backward
                torch.autograd.Variable._execution_engine.queue_callback(self._finish)
            self._pending[id(table)] = table

    def _sink(self, table: Table, group: dict[str, Any]) -> Any:
        return _SlabSink(self, table, group)

    def _tier_sink(self, table: TierTable, group: dict[str, Any]) -> Any:
        return _TierSink(self, table, group)

    def _hook(self, table: Table, group: dict[str, Any], g: int, member: int) -> Any:
        def apply(p: torch.Tensor) -> None:
            self._begin(table)
            x = p.grad
            if x is not None and x.is_sparse:
                _, _, grads = self._sparse.setdefault((id(table), g), (table, group, {}))
                grads[member] = x if member not in grads else grads[member] + x  # read twice: summed
            else:
                with torch.no_grad():
                    self.optimizer._update_member(table, group, g, member, int(table.step) + 1)
            p.grad = None

        return apply


class _SlabSink:
    """A table's sink (``variables.Part``): distinct rows with their summed gradient, or a sum bag's
    gradient whole (:meth:`bags`), where the optimizer has a one-pass update of it."""

    def __init__(self, handle: FusedHandle, table: Table, group: dict[str, Any]) -> None:
        self.handle, self.table, self.group = handle, table, group
        self.logical = table.store.logical_slab  # how the rows lie for the lookups that hand theirs over

    def __call__(self, rows: torch.Tensor, values: torch.Tensor) -> None:  # distinct rows of the table's one slab
        table = self.table
        self.handle._begin(table)
        with torch.no_grad():
            rows = _as_they_lie(table.store, rows, self.logical)
            self.handle.optimizer._apply(table, self.group, 0, rows, values, int(table.step) + 1, True)

    def bags(self, ids: torch.Tensor, offsets: torch.Tensor, grad: torch.Tensor) -> Callable[[], None] | None:
        """The update of the rows the sum bags ``(ids, offsets)`` read from their bags' gradient ``grad``, in one
        pass: a job to run on any thread; None: the rows must be summed and handed over (``__call__``)."""
        if self.table.store.logical_slab != self.logical:  # the rows moved since the lookup read them
            return None
        return _bags_job(self.handle, self.table, self.group, ids, offsets, grad)


class _TierSink:
    """A tiered table's sink: gradient rows of cache slots (summed here), or a sum bag's gradient whole
    (:meth:`bags`), where the optimizer has a one-pass update of it."""

    def __init__(self, handle: FusedHandle, table: TierTable, group: dict[str, Any]) -> None:
        self.handle, self.table, self.group = handle, table, group

    def __call__(self, slots: torch.Tensor, values: torch.Tensor) -> None:  # one gradient row per looked-up id
        table = self.table
        self.handle._begin(table)
        with torch.no_grad():
            rows, grad = _summed(slots, values, slots)  # per row in the order of the ids, as in memory
            self.handle.optimizer._apply(table, self.group, 0, rows, grad, int(table.step) + 1, True)
            table.tier.mark_dirty(rows)

    def bags(self, slots: torch.Tensor, offsets: torch.Tensor, grad: torch.Tensor) -> Callable[[], None] | None:
        """The update of the cache slots the sum bags ``(slots, offsets)`` read, as :meth:`_SlabSink.bags`."""
        job = _bags_job(self.handle, self.table, self.group, slots, offsets, grad)
        if job is not None:
            self.table.tier.mark_dirty(slots)  # (the batch's slots stay put until its backward ended: its token)
        return job


def _bags_job(handle: FusedHandle, table: Table | TierTable, group: dict[str, Any], ids: torch.Tensor,
              offsets: torch.Tensor, grad: torch.Tensor) -> Callable[[], None] | None:  # fmt: skip
    """The optimizer's one-pass update of ``table``'s rows from its sum bags' gradient, the table noted as
    updated in this backward; None where the optimizer has none (no torch op runs in it: no grad mode)."""
    weight, state = table.group_tensors(0)
    job = handle.optimizer.update_bags(weight, state, ids, offsets, grad, group, int(table.step) + 1)
    if job is not None:
        handle._begin(table)
    return job


def _as_they_lie(store: Any, rows: torch.Tensor, logical: bool) -> torch.Tensor:
    """Slab ``rows`` read while the table lay in logical order (``logical``) or with its shards back to
    back, where they lie now: a compiled backward pending across ``remove`` (or ``fuse``), which no
    token keeps the rows put for, hands over rows read before they moved."""
    if store.logical_slab == logical:
        return rows
    if logical:
        return store.slab_rows(rows)
    return storage_ids(store.layout, rows)  # only equal mod shards move


def _row_state(table: Table) -> list[torch.Tensor]:
    """The table's state tensors of its one slab group, one row per table row: they move with its rows."""
    return [x[0] for x in table.state.values()]


def fuse(optimizer: TableOptimizer) -> FusedHandle:
    """Apply ``optimizer``'s updates inside backward, shard by shard (see the module's docstring)."""
    if not isinstance(optimizer, TableOptimizer):
        raise ShardvarValueError(f"fuse needs a shardvar.optim optimizer; got {type(optimizer).__name__}")
    if getattr(optimizer, "_fused", None) is not None:
        raise ShardvarValueError("this optimizer is already fused; call .remove() on its handle first")
    handle = FusedHandle(optimizer)
    for tables, group in zip(optimizer._groups_tables, optimizer.param_groups, strict=True):
        handle.attach(tables, group)
    optimizer._fused = handle
    return handle
