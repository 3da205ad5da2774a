"""The two autograd Functions every local lookup goes through.

* :class:`SlabView`: the whole table as one tensor over the shards' shared memory. Any torch op
  (``F.embedding``, ``F.embedding_bag``, with every option) runs on it as on an unsharded table;
  its gradient is split back into one gradient per shard: views of one dense gradient, or one
  sparse gradient per shard.
* :class:`GatherRows`: rows of chosen ids from shards that share no slab (several devices, or
  shards we may not move), grouped by slab or shard with one sort, flat in the shard count.

Both save tensors with ``save_for_backward`` and define ``setup_context``, so saved-tensor hooks,
``torch.func`` and double backward work; their backward passes are built of differentiable ops.
"""

from __future__ import annotations

from typing import Any

import torch

from .._pages import empty
from ..layout import group_positions
from ._store import Group, ShardStore

__all__ = ["SlabView", "GatherRows", "gather_local", "shard_grads"]


def _ordered(store: ShardStore, grads: dict[int, torch.Tensor]) -> tuple[torch.Tensor | None, ...]:
    return tuple(grads.get(s) for s in store.local_shards())


def reading(store: ShardStore) -> object:
    """A token that a backward holds until it runs: while it lives, the store's rows keep their order
    (``_relayout`` moves none), as the gradient rows it maps assume. (A compiled graph keeps none: its
    backward splits by the rows as they lay, see SlabSplit.)"""
    return store.reading()


class SlabView(torch.autograd.Function):
    """``SlabView.apply(store, *shards)``: the store's full slab, differentiable into the shards."""

    generate_vmap_rule = True  # the output does not depend on a batch dimension of any input

    @staticmethod
    def forward(store: ShardStore, *shards: torch.Tensor) -> torch.Tensor:
        return store.full_slab.detach()

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
        ctx.store = inputs[0]
        ctx.reading = reading(inputs[0])  # the slab's rows stay put until backward
        ctx.group = inputs[0].groups[0]  # and its gradient is split by them as they lie now (also compiled)
        # No gradient (an op whose rows all went to a fused update, or an unused output): none for
        # the shards either, as for an unsharded table; not a table-sized zero gradient per shard.
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor | None) -> tuple:
        store: ShardStore = ctx.store
        ctx.reading = None
        if grad is None:
            return (None,) * (1 + len(store.local_shards()))
        return (None, *shard_grads(store, grad, ctx.group))


def shard_grads(store: ShardStore, grad: torch.Tensor, group: Group | None = None) -> tuple[torch.Tensor | None, ...]:
    """Each local shard's part of the gradient of the store's full slab (dense or sparse), in shard order;
    ``group``: the slab's rows as they lay when the gradient's rows were read."""
    if grad.layout == torch.sparse_coo:
        grads = store.split_sparse_grad(0, grad._indices()[0], grad._values(), grad.is_coalesced(), group)
    else:
        grads = store.split_grad(0, grad, group)
    return _ordered(store, grads)


class SlabSplit:
    """``split(grad)``: :func:`shard_grads` of a gradient of the store's full slab, split by the slab's
    rows as they lay when the split was made (when the rows the gradient is of were read)."""

    def __init__(self, store: ShardStore) -> None:
        self.store, self.group = store, store.groups[0]

    def __call__(self, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return shard_grads(self.store, grad, self.group)


def gather_local(store: ShardStore, ids: torch.Tensor, out_device: torch.device) -> torch.Tensor:
    """Rows ``ids`` (1-D, valid, all held locally) as ``[len(ids), width]`` on ``out_device``."""
    group, row = store.route(ids)
    if len(store.groups) == 1:
        source = store.group_rows(0)
        return source.index_select(0, row.to(source.device)).to(out_device)
    out = empty((ids.numel(), store.width), dtype=store.dtype, device=out_device)
    for g, pos in group_positions(group, len(store.groups)):
        source = store.group_rows(g)
        rows = source.index_select(0, row.index_select(0, pos).to(source.device))
        out.index_copy_(0, pos.to(out_device), rows.to(out_device))
    return out


def scatter_grads(store: ShardStore, ids: torch.Tensor, grad: torch.Tensor, sparse: bool) -> dict[int, torch.Tensor]:
    """Each local shard's gradient from the gradient rows ``grad`` of ``ids`` (duplicates add up)."""
    group, row = store.route(ids)
    grads = {}
    parts = [(0, None)] if len(store.groups) == 1 else group_positions(group, len(store.groups))
    for g, pos in parts:
        info = store.groups[g]
        rows = row if pos is None else row.index_select(0, pos)
        part = grad if pos is None else grad.index_select(0, pos.to(grad.device))
        rows, part = rows.to(info.device), part.to(info.device, store.dtype)
        if sparse:
            grads.update(store.split_sparse_grad(g, rows, part))
        else:
            # The one table-sized buffer, accumulated in place: it becomes the shards' .grad.
            grads.update(store.dense_grad(g, rows, part))
    # A shard this lookup did not touch still gets a (zero) gradient, as its rows would in an
    # unsharded table: optimizers then step every shard exactly as they step the table.
    missing = store.zero_grads(sparse, skip=grads.keys())
    return {**grads, **missing}


class GatherRows(torch.autograd.Function):
    """``GatherRows.apply(store, ids, sparse, *shards)``: rows of valid 1-D ``ids`` held locally."""

    @staticmethod
    def forward(store: ShardStore, ids: torch.Tensor, sparse: bool, *shards: torch.Tensor) -> torch.Tensor:
        return gather_local(store, ids, ids.device)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
        store, ids, sparse = inputs[:3]
        ctx.save_for_backward(ids)
        ctx.store, ctx.sparse = store, sparse

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        (ids,) = ctx.saved_tensors
        grads = scatter_grads(ctx.store, ids, grad, ctx.sparse)
        return (None, None, None, *_ordered(ctx.store, grads))
