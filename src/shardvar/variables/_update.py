"""Writes to a ShardedVariable: assign, assign_add/sub, scatter updates, and sparse reads.

Every operation validates ids, shapes, dtypes, ranges and the shards themselves before touching
any shard, so a failing call changes nothing. Scatter updates over a slab are one in-place torch
op on the whole table; otherwise ids are grouped by slab or shard with one sort.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .._errors import ShardvarTypeError, ShardvarValueError
from ..layout import as_ids, check_ids, group_positions, last_occurrence
from ._functional import gather
from ._store import ShardStore
from ._values import check_local, coerce, ids_device

__all__ = ["assign", "scatter", "sparse_read", "batch_scatter_update", "check_writable", "SCATTER_OPS"]


def check_writable(shards: list[torch.Tensor]) -> None:
    """Raise before any write if some shard cannot be written in place (so none is)."""
    for s, t in enumerate(shards):
        if t.is_inference() and not torch.is_inference_mode_enabled():
            raise ShardvarTypeError(f"shard {s} is an inference tensor; it can only be written inside inference_mode")
        if torch._debug_has_internal_overlap(t) == 1:
            raise ShardvarValueError(
                f"shard {s} has elements sharing memory (an expanded tensor); it cannot be written"
            )


_ASSIGN = {
    "assign": lambda shard, part: shard.copy_(part),
    "assign_add": lambda shard, part: shard.add_(part),
    "assign_sub": lambda shard, part: shard.sub_(part),
}


def assign(store: ShardStore, value: Any, op: str = "assign") -> None:
    """Write the whole logical value (broadcast to the variable's shape) into the shards."""
    shards = check_local(store, op)
    value = coerce(value, store.dtype, tuple(store.shape))
    check_writable(shards)
    apply = _ASSIGN[op]
    with torch.no_grad():
        for shard, part in zip(shards, store.layout.split(value), strict=True):
            apply(shard, part.to(shard.device))


def sparse_read(store: ShardStore, indices: Any) -> torch.Tensor:
    """Rows ``indices`` in the order asked (the reference groups them by shard: a defect)."""
    return gather(store, indices)


def _divide(target: torch.Tensor, rows: torch.Tensor, updates: torch.Tensor) -> None:
    # Duplicated ids divide once per occurrence: by the product of their updates.
    unique, inverse = torch.unique(rows, return_inverse=True)
    denom = torch.ones((unique.numel(), *updates.shape[1:]), dtype=updates.dtype, device=updates.device)
    _reduce("prod")(denom, inverse, updates)
    current = target.index_select(0, unique)
    if target.is_floating_point() or target.is_complex():
        target.index_copy_(0, unique, current / denom)
    else:
        target.index_copy_(0, unique, torch.div(current, denom, rounding_mode="trunc"))


def _reduce(mode: str) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    # scatter_reduce_ with the row index broadcast over each row (index_reduce_ is still beta).
    def apply(target: torch.Tensor, rows: torch.Tensor, updates: torch.Tensor) -> torch.Tensor:
        index = rows.reshape(-1, *[1] * (updates.dim() - 1)).expand_as(updates)
        return target.scatter_reduce_(0, index, updates, mode)

    return apply


SCATTER_OPS: dict[str, Callable[[torch.Tensor, torch.Tensor, torch.Tensor], Any]] = {
    "scatter_add": lambda t, r, u: t.index_add_(0, r, u),
    "scatter_sub": lambda t, r, u: t.index_add_(0, r, u, alpha=-1),
    "scatter_mul": _reduce("prod"),
    "scatter_div": _divide,
    "scatter_min": _reduce("amin"),
    "scatter_max": _reduce("amax"),
    "scatter_update": lambda t, r, u: t.index_copy_(0, r, u),
}


def _target(store: ShardStore, g: int) -> torch.Tensor:
    """Group ``g``'s rows as ``[rows, *row_shape]``, a view that writes through to the shards."""
    group = store.groups[g]
    if group.slab is not None:
        return group.slab.view(group.rows, *store.row_shape)
    shard = store.local_shards()[group.members[0]]
    return shard if store.layout.axis == 0 else shard.movedim(store.layout.axis, 0)


def scatter(store: ShardStore, op: str, indices: Any, updates: Any) -> None:
    """Apply ``op`` at logical rows ``indices`` with ``updates`` of shape ``indices.shape + row_shape``."""
    shards = check_local(store, op)
    ids = as_ids(indices, device=None if isinstance(indices, torch.Tensor) else ids_device(store))
    check_ids(ids, store.layout.num_rows)
    row_shape = store.row_shape
    updates = coerce(updates, store.dtype, (*ids.shape, *row_shape), "updates")
    if (
        op == "scatter_div"
        and not (store.dtype.is_floating_point or store.dtype.is_complex)
        and bool((updates == 0).any())
    ):
        raise ShardvarValueError(f"scatter_div of a {store.dtype} variable by zero; got a zero in updates")
    ids, updates = ids.reshape(-1), updates.reshape(-1, *row_shape)
    if op == "scatter_update":
        keep = last_occurrence(ids)
        ids, updates = ids.index_select(0, keep), updates.index_select(0, keep.to(updates.device))
    apply = SCATTER_OPS[op]
    slab = store.full_slab
    if slab is not None:  # one op over the whole table
        check_writable(shards)
        with torch.no_grad():
            rows = store.slab_rows(ids.to(slab.device))
            apply(slab.view(slab.shape[0], *row_shape), rows, updates.to(slab.device))
        return
    group, row = store.route(ids)
    touched = group_positions(group, len(store.groups))
    check_writable([store.local_shards()[s] for g, _ in touched for s in store.groups[g].members])
    with torch.no_grad():
        for g, pos in touched:
            target = _target(store, g)
            part = updates if len(store.groups) == 1 else updates.index_select(0, pos.to(updates.device))
            rows = row if len(store.groups) == 1 else row.index_select(0, pos)
            apply(target, rows.to(target.device), part.to(target.device))


def batch_scatter_update(store: ShardStore, indices: Any, updates: Any) -> None:
    """``v[b..., indices[b..., j], ...] = updates[b..., j, ...]`` for batch dims before the sharded axis.

    With 1-D indices this is :func:`scatter` with ``scatter_update``.
    """
    shards = check_local(store, "batch_scatter_update")
    ids = as_ids(indices, device=None if isinstance(indices, torch.Tensor) else ids_device(store))
    axis = store.layout.axis
    if ids.dim() <= 1:
        scatter(store, "scatter_update", ids, updates)
        return
    batch = tuple(ids.shape[:-1])
    if tuple(store.shape[: len(batch)]) != batch or axis != len(batch):
        raise ShardvarValueError(
            f"batched indices of shape {list(ids.shape)} need a variable of shape {list(batch)} + [rows, ...] "
            f"split along axis {len(batch)}; got shape {list(store.shape)} split along axis {axis}"
        )
    check_ids(ids, store.layout.num_rows)
    row_shape = tuple(store.shape[axis + 1 :])
    updates = coerce(updates, store.dtype, (*ids.shape, *row_shape), "updates")
    k = ids.shape[-1]
    flat_batch = torch.arange(ids.numel(), device=ids.device) // k
    flat_ids = ids.reshape(-1)
    keep = last_occurrence(flat_batch * store.layout.num_rows + flat_ids)
    flat_batch, flat_ids = flat_batch[keep], flat_ids[keep]
    flat_updates = updates.reshape(-1, *row_shape).index_select(0, keep.to(updates.device))
    batch_index = torch.unravel_index(flat_batch, batch)
    pieces = store.layout.split_ids(flat_ids)
    check_writable([shards[s] for s, _, _ in pieces])
    with torch.no_grad():
        for s, pos, rows in pieces:
            shard = shards[s]
            index = (*(b.index_select(0, pos).to(shard.device) for b in batch_index), rows.to(shard.device))
            shard.index_put_(index, flat_updates.index_select(0, pos.to(flat_updates.device)).to(shard.device))
