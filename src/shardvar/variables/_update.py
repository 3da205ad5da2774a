"""Writes to a ShardedVariable: assign, assign_add/sub, scatter updates, and sparse reads.

Every operation validates ids, shapes and dtypes before touching any shard, so a failing call
changes nothing. Scatter updates work on any layout: ids are located and grouped by shard
(vectorised), then each touched shard gets one in-place torch op.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from .._errors import ShardvarTypeError, ShardvarValueError
from ..layout import Layout, as_ids, check_ids, get_strategy
from ._gather import gather_rows, positions_by_shard, slab_of, slab_rows

__all__ = ["assign", "scatter", "sparse_read", "split_by_shard", "last_occurrence", "SCATTER_OPS"]


def split_by_shard(layout: Layout, ids: torch.Tensor) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """For each touched shard: (shard, positions in ``ids``, local rows), ids already validated."""
    shard_of, row = get_strategy(layout.strategy).locate(layout.sizes, ids)
    for s, pos in enumerate(positions_by_shard(shard_of, layout.num_shards)):
        if pos.numel():
            yield s, pos, row.index_select(0, pos)


def last_occurrence(ids: torch.Tensor) -> torch.Tensor:
    """Positions of the last occurrence of each distinct id, so a duplicated write is 'last wins'."""
    if ids.numel() <= 1:
        return torch.arange(ids.numel(), device=ids.device)
    unique, inverse = torch.unique(ids, return_inverse=True)
    last = torch.full((unique.numel(),), -1, dtype=torch.int64, device=ids.device)
    return last.scatter_reduce_(0, inverse, torch.arange(ids.numel(), device=ids.device), "amax")


def _as_value(value: Any, dtype: torch.dtype, shape: tuple[int, ...], what: str) -> torch.Tensor:
    from ._sharded_variable import ShardedVariable

    if isinstance(value, ShardedVariable):
        value = value.to_tensor()
    t = value if isinstance(value, torch.Tensor) else torch.as_tensor(value)
    if not torch.can_cast(t.dtype, dtype):
        raise ShardvarTypeError(f"{what} of dtype {t.dtype} cannot be cast to the variable's dtype {dtype}")
    try:
        return t.to(dtype).broadcast_to(shape)
    except RuntimeError:
        raise ShardvarValueError(f"{what} of shape {list(t.shape)} does not fit shape {list(shape)}") from None


def _shard_part(layout: Layout, value: torch.Tensor, s: int) -> torch.Tensor:
    if get_strategy(layout.strategy).contiguous:
        return value.narrow(layout.axis, layout.offsets[s], layout.sizes[s])
    return value.index_select(layout.axis, layout.shard_ids(s, value.device))


_ASSIGN = {
    "assign": lambda shard, part: shard.copy_(part),
    "assign_add": lambda shard, part: shard.add_(part),
    "assign_sub": lambda shard, part: shard.sub_(part),
}


def assign(v, value: Any, op: str = "assign") -> None:
    """Write the whole logical value (broadcast to ``v.shape``) into the shards."""
    value = _as_value(value, v.dtype, tuple(v.shape), "value")
    apply = _ASSIGN[op]
    with torch.no_grad():
        for s, shard in enumerate(v.variables):
            apply(shard, _shard_part(v.layout, value, s).to(shard.device))


def sparse_read(v, indices: Any) -> torch.Tensor:
    """Rows ``indices`` in the order asked (the reference groups them by shard: a defect)."""
    ids = as_ids(indices, device=None if isinstance(indices, torch.Tensor) else v.device)
    return gather_rows(v.variables, v.layout, ids)


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


def scatter(v, op: str, indices: Any, updates: Any) -> None:
    """Apply ``op`` at logical rows ``indices`` with ``updates`` of shape ``indices.shape + row_shape``."""
    layout = v.layout
    ids = as_ids(indices, device=None if isinstance(indices, torch.Tensor) else v.device)
    check_ids(ids, layout.num_rows)
    row_shape = (*v.shape[: layout.axis], *v.shape[layout.axis + 1 :])
    updates = _as_value(updates, v.dtype, (*ids.shape, *row_shape), "updates")
    ids, updates = ids.reshape(-1), updates.reshape(-1, *row_shape)
    if op == "scatter_update":
        keep = last_occurrence(ids)
        ids, updates = ids.index_select(0, keep), updates.index_select(0, keep.to(updates.device))
    apply = SCATTER_OPS[op]
    shards = v.variables
    with torch.no_grad():
        slab = slab_of(shards, layout)
        if slab is not None:
            # Shards that are consecutive pieces of one allocation: one op on the whole table.
            rows = slab_rows(layout, ids.to(slab.device))
            apply(slab.view(layout.num_rows, *row_shape), rows, updates.to(slab.device))
            return
        for s, pos, rows in split_by_shard(layout, ids):
            target = shards[s] if layout.axis == 0 else shards[s].movedim(layout.axis, 0)
            part = updates.index_select(0, pos.to(updates.device)).to(target.device)
            apply(target, rows.to(target.device), part)


def batch_scatter_update(v, indices: Any, updates: Any) -> None:
    """``v[b..., indices[b..., j], ...] = updates[b..., j, ...]`` for batch dims before the sharded axis.

    With 1-D indices this is :func:`scatter` with ``scatter_update``.
    """
    ids = as_ids(indices, device=None if isinstance(indices, torch.Tensor) else v.device)
    axis = v.layout.axis
    if ids.dim() <= 1:
        scatter(v, "scatter_update", ids, updates)
        return
    batch = tuple(ids.shape[:-1])
    if tuple(v.shape[: len(batch)]) != batch or axis != len(batch):
        raise ShardvarValueError(
            f"batched indices of shape {list(ids.shape)} need a variable of shape {list(batch)} + [rows, ...] "
            f"split along axis {len(batch)}; got shape {list(v.shape)} split along axis {axis}"
        )
    check_ids(ids, v.layout.num_rows)
    row_shape = tuple(v.shape[axis + 1 :])
    updates = _as_value(updates, v.dtype, (*ids.shape, *row_shape), "updates")
    k = ids.shape[-1]
    flat_batch = torch.arange(ids.numel(), device=ids.device) // k
    flat_ids = ids.reshape(-1)
    keep = last_occurrence(flat_batch * v.layout.num_rows + flat_ids)
    flat_batch, flat_ids = flat_batch[keep], flat_ids[keep]
    flat_updates = updates.reshape(-1, *row_shape).index_select(0, keep.to(updates.device))
    batch_index = torch.unravel_index(flat_batch, batch)
    with torch.no_grad():
        for s, pos, rows in split_by_shard(v.layout, flat_ids):
            shard = v.variables[s]
            index = (*(b.index_select(0, pos).to(shard.device) for b in batch_index), rows.to(shard.device))
            shard.index_put_(index, flat_updates.index_select(0, pos.to(flat_updates.device)).to(shard.device))
