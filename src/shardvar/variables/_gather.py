"""Gathering logical rows from shards: the hot path of every lookup and sparse read.

Two ways, chosen per call:

* slab: when the shards are contiguous pieces of one allocation, in shard order, on one device
  (shardvar's own constructors allocate them so), the whole variable is one ``[rows, width]``
  table and a lookup is one ``F.embedding`` call; a ``div`` layout needs no id arithmetic at all.
* per shard: otherwise ids are located (vectorised), grouped by shard, gathered with one
  ``F.embedding`` per touched shard and written into the output at their positions.

Both run inside one autograd Function whose backward sends each shard exactly the gradient
rows it served (dense, or sparse COO for ``sparse=True``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .._errors import ShardvarValueError
from ..layout import Layout, check_ids, get_strategy

__all__ = ["gather_rows", "rows_2d", "slab_of", "slab_rows", "positions_by_shard"]

_MASK_SHARDS = 16  # up to this many shards one boolean mask per shard beats a sort


def rows_2d(shard: torch.Tensor, axis: int) -> torch.Tensor:
    """The shard as ``[rows, width]``: a view when ``axis == 0`` and the shard is contiguous."""
    moved = shard if axis == 0 else shard.movedim(axis, 0)
    return moved.reshape(moved.shape[0], math.prod(moved.shape[1:]))


def slab_of(shards: list[torch.Tensor], layout: Layout) -> torch.Tensor | None:
    """A ``[rows, width]`` tensor over the shards' shared storage, or None when they do not share one."""
    if layout.axis != 0 or len(shards) == 1:
        return None
    first = shards[0]
    storage = first.untyped_storage()
    ptr, offset = storage.data_ptr(), first.storage_offset()
    for s in shards:
        if (
            s.device != first.device
            or s.dtype != first.dtype
            or not s.is_contiguous()
            or s.untyped_storage().data_ptr() != ptr
            or s.storage_offset() != offset
        ):
            return None
        offset += s.numel()
    width = math.prod(first.shape[1:])
    shape = (layout.num_rows, *first.shape[1:])
    slab = torch.empty(0, dtype=first.dtype, device=first.device).set_(
        storage, first.storage_offset(), shape, torch.empty(shape, device="meta").stride()
    )
    return slab.reshape(layout.num_rows, width)


def positions_by_shard(shard_of: torch.Tensor, num_shards: int) -> list[torch.Tensor]:
    """For each shard, the positions (int64) of the ids it holds, in ascending order."""
    if num_shards == 1:
        return [torch.arange(shard_of.numel(), device=shard_of.device)]
    if num_shards <= _MASK_SHARDS:
        return [torch.nonzero(shard_of == s).squeeze(1) for s in range(num_shards)]
    order = torch.argsort(shard_of, stable=True)
    counts = torch.bincount(shard_of, minlength=num_shards).tolist()
    return list(order.split(counts))


def slab_rows(layout: Layout, ids: torch.Tensor) -> torch.Tensor:
    """Row of the slab (shards back to back, in shard order) that holds each logical id."""
    return get_strategy(layout.strategy).storage_rows(layout.sizes, ids)


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids: torch.Tensor, layout: Layout, options: tuple, *shards: torch.Tensor) -> torch.Tensor:
        out_device = options[3]
        ctx.layout, ctx.options = layout, options
        ctx.shard_meta = [(s.shape, s.device, s.dtype) for s in shards]
        ctx.ids = ids
        slab = slab_of(list(shards), layout)
        if slab is not None:
            rows = slab_rows(layout, ids.to(slab.device))
            ctx.slab_rows = rows
            return F.embedding(rows, slab).to(out_device)
        ctx.slab_rows = None
        shard_of, row = get_strategy(layout.strategy).locate(layout.sizes, ids)
        positions = positions_by_shard(shard_of, layout.num_shards)
        width = rows_2d(shards[0], layout.axis).shape[1]
        out = torch.empty(ids.numel(), width, dtype=shards[0].dtype, device=out_device)
        ctx.pieces = []
        for s, pos in enumerate(positions):
            if pos.numel() == 0:
                continue
            local = row.index_select(0, pos).to(shards[s].device)
            out.index_copy_(0, pos.to(out_device), F.embedding(local, rows_2d(shards[s], layout.axis)).to(out_device))
            ctx.pieces.append((s, pos, local))
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor):
        padding_idx, sparse, scale_grad_by_freq, _ = ctx.options
        layout, ids = ctx.layout, ctx.ids
        if padding_idx is not None:
            grad = grad.masked_fill((ids == padding_idx).to(grad.device).unsqueeze(1), 0)
        if scale_grad_by_freq:
            _, inverse, counts = torch.unique(ids, return_inverse=True, return_counts=True)
            grad = grad / counts.index_select(0, inverse).to(grad.device, grad.dtype).unsqueeze(1)
        grads: list[torch.Tensor | None] = [None] * len(ctx.shard_meta)
        if ctx.slab_rows is not None and not sparse:
            # One dense gradient for the whole slab; each shard's gradient is a view of it.
            shape, device, dtype = ctx.shard_meta[0]
            full = torch.zeros(layout.num_rows, grad.shape[1], dtype=dtype, device=device)
            full.index_add_(0, ctx.slab_rows, grad.to(device, dtype))
            start = 0
            for s, (shape, _, _) in enumerate(ctx.shard_meta):
                grads[s] = full[start : start + shape[0]].view(shape)
                start += shape[0]
            return (None, None, None, *grads)
        if ctx.slab_rows is not None:
            shard_of, row = get_strategy(layout.strategy).locate(layout.sizes, ids)
            pieces = [
                (s, pos, row.index_select(0, pos))
                for s, pos in enumerate(positions_by_shard(shard_of, layout.num_shards))
                if pos.numel()
            ]
        else:
            pieces = ctx.pieces
        for s, pos, local in pieces:
            shape, device, dtype = ctx.shard_meta[s]
            part = grad.index_select(0, pos.to(grad.device)).to(device, dtype)
            rows = shape[layout.axis]
            if sparse:
                grads[s] = torch.sparse_coo_tensor(
                    local.unsqueeze(0), part, (rows, part.shape[1]), check_invariants=False
                )
            else:
                dense = torch.zeros(rows, part.shape[1], dtype=dtype, device=device).index_add_(0, local, part)
                moved = (*shape[: layout.axis], *shape[layout.axis + 1 :])
                grads[s] = dense.view(rows, *moved).movedim(0, layout.axis)
        for s, (shape, device, dtype) in enumerate(ctx.shard_meta):
            # A shard this lookup did not touch still gets a (zero) gradient, as its rows would in
            # an unsharded table: optimizers then step every shard exactly as they step the table.
            if grads[s] is None and sparse:
                index = torch.empty(1, 0, dtype=torch.int64, device=device)
                values = torch.empty(0, grad.shape[1], dtype=dtype, device=device)
                grads[s] = torch.sparse_coo_tensor(index, values, (shape[0], grad.shape[1]), check_invariants=False)
            elif grads[s] is None:
                grads[s] = torch.zeros(shape, dtype=dtype, device=device)
        return (None, None, None, *grads)


def gather_rows(
    shards: list[torch.Tensor],
    layout: Layout,
    ids: torch.Tensor,
    *,
    padding_idx: int | None = None,
    sparse: bool = False,
    scale_grad_by_freq: bool = False,
    check: bool = True,
) -> torch.Tensor:
    """Rows ``ids`` (any shape, int64) of the logical variable: shape ``ids.shape + row_shape``.

    A row is the slice at one index along ``layout.axis``. The result lives on ``ids.device``.
    """
    if check:
        check_ids(ids, layout.num_rows)
    if sparse and (shards[0].dim() != 2 or layout.axis != 0):
        raise ShardvarValueError(
            f"sparse gradients need 2-D shards split along axis 0; got shard shape {list(shards[0].shape)} "
            f"split along axis {layout.axis}"
        )
    row_shape = (*shards[0].shape[: layout.axis], *shards[0].shape[layout.axis + 1 :])
    flat = ids.reshape(-1)
    options = (padding_idx, sparse, scale_grad_by_freq, ids.device)
    out = _Gather.apply(flat, layout, options, *shards)
    return out.reshape(*ids.shape, *row_shape)
