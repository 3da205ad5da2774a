"""DistributedShardedVariable: a logical variable whose shards are owned by the ranks of a group.

Every rank creates it with the same shape, layout and placement (checked collectively); each
allocates only its own shards, as consecutive pieces of one local slab, filled with the values
the same initializer gives a single process.

A lookup: each rank deduplicates its ids, sends each unique id to its owner (all_to_all, split
sizes first), owners gather their rows with one kernel over the local slab and send them back;
the caller gets them in its own order and shape. Backward sums the gradient per unique id and
sends it to the owner, which adds it into its shards: an optimizer step on each rank then
updates only that rank's shards.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from .._errors import ShardvarDistributedError, ShardvarIndexError, ShardvarValueError
from ..layout import Layout, as_ids
from ..variables import RowInitializer, to_layout
from ._comm import DEFAULT_TIMEOUT, Comm

__all__ = ["DistributedShardedVariable", "round_robin"]


def round_robin(num_shards: int, world: int) -> tuple[int, ...]:
    """Shard s on rank s % world."""
    return tuple(s % world for s in range(num_shards))


class DistributedShardedVariable:
    """Shards of one logical ``[rows, ...]`` variable spread over the ranks of a process group.

    Create it on every rank with the same arguments (a collective call).
    """

    def __init__(
        self,
        shape: Sequence[int],
        partitioner: Any = None,
        *,
        partition_strategy: str = "div",
        dtype: torch.dtype = torch.float32,
        initializer: RowInitializer | None = None,
        placement: Sequence[int] | None = None,
        group: Any = None,
        timeout: float = DEFAULT_TIMEOUT,
        requires_grad: bool = True,
        name: str | None = None,
    ) -> None:
        self.comm = Comm(group, timeout)
        self.shape = torch.Size(shape)
        self.dtype = dtype
        self.name = name
        self.layout: Layout = to_layout(
            self.comm.world if partitioner is None else partitioner, self.shape, dtype, partition_strategy
        )
        if self.layout.axis != 0:
            raise ShardvarValueError(f"distributed variables are split by rows (axis 0); got {self.layout}")
        n = self.layout.num_shards
        self.placement = tuple(round_robin(n, self.comm.world) if placement is None else placement)
        if len(self.placement) != n or any(not 0 <= r < self.comm.world for r in self.placement):
            raise ShardvarValueError(
                f"placement must give a rank in [0, {self.comm.world}) for each of the {n} shards; "
                f"got {list(self.placement)}"
            )
        self._check_agreement()
        self.initializer = initializer or RowInitializer()
        self.owned = [s for s in range(n) if self.placement[s] == self.comm.rank]
        row_shape = tuple(self.shape[1:])
        device = self.comm.device
        ids = (
            torch.cat([self.layout.shard_ids(s) for s in self.owned])
            if self.owned
            else torch.empty(0, dtype=torch.int64)
        )
        slab = self.initializer.rows(ids, row_shape, dtype).to(device)
        shards, start = {}, 0
        for s in self.owned:
            piece = slab.narrow(0, start, self.layout.sizes[s])
            shards[s] = torch.nn.Parameter(piece, requires_grad=requires_grad) if requires_grad else piece
            start += self.layout.sizes[s]
        self._shards: dict[int, torch.Tensor] = shards
        # Where each shard's rows start in this rank's slab (-1: owned elsewhere).
        offsets = torch.full((n,), -1, dtype=torch.int64)
        start = 0
        for s in self.owned:
            offsets[s] = start
            start += self.layout.sizes[s]
        self._slab_offsets = offsets.to(device)
        self._owner = torch.tensor(self.placement, dtype=torch.int64, device=device)
        # Every rank must take part in the backward all_to_all, also one that owns no shard (or
        # whose shards are frozen): this empty tensor puts the lookup in every rank's graph.
        self._anchor = torch.zeros(0, device=device, requires_grad=requires_grad)

    def _check_agreement(self) -> None:
        mine = (tuple(self.shape), str(self.dtype), self.layout, self.placement)
        everyone = self.comm.all_gather_object(mine, "the variable's shape, dtype, layout and placement")
        if any(other != mine for other in everyone):
            described = "; ".join(
                f"rank {r}: shape {list(o[0])} {o[1]} {o[2]} placement {list(o[3])}" for r, o in enumerate(everyone)
            )
            raise ShardvarDistributedError(
                f"ranks disagree about distributed variable {self.name or ''!s}: {described}"
            )

    # -- what it is -------------------------------------------------------------------------
    def local_shards(self) -> dict[int, torch.Tensor]:
        """This rank's shards by shard index (nn.Parameters when trainable)."""
        return dict(self._shards)

    @property
    def local_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._shards.values())

    def __repr__(self) -> str:
        return (
            f"DistributedShardedVariable(shape={list(self.shape)}, dtype={self.dtype}, layout={self.layout}, "
            f"rank={self.comm.rank}/{self.comm.world}, owned={self.owned})"
        )

    # -- lookups ----------------------------------------------------------------------------
    def lookup(self, ids: Any) -> torch.Tensor:
        """Rows ``ids`` (any shape): shape ``ids.shape + row_shape``. Collective: every rank calls it."""
        ids = as_ids(ids, device=None if isinstance(ids, torch.Tensor) else self.comm.device)
        out = _DistributedLookup.apply(ids.reshape(-1).to(self.comm.device), self, self._anchor, *self._shards.values())
        return out.reshape(*ids.shape, *self.shape[1:])

    def to_tensor(self) -> torch.Tensor:
        """The whole logical value on every rank (collective; for inspection and tests)."""
        with torch.no_grad():
            return self.lookup(torch.arange(self.shape[0], device=self.comm.device)).detach()

    def _local_rows(self, ids: torch.Tensor) -> torch.Tensor:
        shard, row = self.layout.locate(ids, check=False)
        return self._slab_offsets[shard] + row

    def _slab(self) -> torch.Tensor:
        width = self.shape[1:].numel()
        rows = sum(self.layout.sizes[s] for s in self.owned)
        if not self.owned:
            return torch.empty(0, width, dtype=self.dtype, device=self.comm.device)
        first = self._shards[self.owned[0]]
        return torch.empty(0, dtype=self.dtype, device=first.device).set_(
            first.untyped_storage(), first.storage_offset(), (rows, width), (width, 1)
        )


class _DistributedLookup(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, ids: torch.Tensor, var: DistributedShardedVariable, anchor: torch.Tensor, *shards: torch.Tensor
    ) -> torch.Tensor:
        comm, layout, world = var.comm, var.layout, var.comm.world
        device = ids.device
        unique, inverse = torch.unique(ids, return_inverse=True)
        bad = (unique < 0) | (unique >= layout.num_rows)
        first_bad = int(unique[bad][0]) if bool(bad.any()) else None
        owner = var._owner[layout.locate(unique.clamp(0, max(layout.num_rows - 1, 0)), check=False)[0]]
        order = torch.argsort(owner, stable=True)
        send_ids = unique.index_select(0, order)
        send_counts = torch.bincount(owner, minlength=world)
        # Split sizes first, with each rank's verdict on its ids riding along: a bad id on any
        # rank then stops every rank here, before any other collective.
        header = torch.cat([send_counts, torch.tensor([0 if first_bad is None else 1], device=device).expand(world)])
        header = header.reshape(2, world).T.contiguous().reshape(-1)
        received = torch.empty_like(header)
        comm.all_to_all(received, header, [2] * world, [2] * world, "split sizes")
        received = received.reshape(world, 2)
        if bool(received[:, 1].any()):
            culprits = torch.nonzero(received[:, 1]).squeeze(1).tolist()
            detail = f"; this rank's first bad id is {first_bad}" if first_bad is not None else ""
            raise ShardvarIndexError(
                f"lookup ids must be in [0, {layout.num_rows}); rank(s) {culprits} passed ids outside it{detail}"
            )
        recv_counts = received[:, 0].tolist()
        send_list = send_counts.tolist()
        recv_ids = torch.empty(sum(recv_counts), dtype=torch.int64, device=device)
        comm.all_to_all(recv_ids, send_ids, recv_counts, send_list, "ids")
        local_rows = var._local_rows(recv_ids)
        rows = F.embedding(local_rows, var._slab()) if recv_ids.numel() else var._slab()[:0]
        width = rows.shape[1]
        back = torch.empty(sum(send_list), width, dtype=var.dtype, device=device)
        comm.all_to_all(back, rows.contiguous(), send_list, recv_counts, "rows")
        unique_rows = torch.empty_like(back).index_copy_(0, order, back)
        ctx.var, ctx.inverse, ctx.order, ctx.local_rows = var, inverse, order, local_rows
        ctx.counts = (send_list, recv_counts)
        ctx.num_unique = unique.numel()
        return unique_rows.index_select(0, inverse)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor):
        var = ctx.var
        send_list, recv_counts = ctx.counts
        width = grad.shape[1]
        per_unique = torch.zeros(ctx.num_unique, width, dtype=grad.dtype, device=grad.device)
        per_unique.index_add_(0, ctx.inverse, grad)
        to_owners = per_unique.index_select(0, ctx.order)
        received = torch.empty(sum(recv_counts), width, dtype=grad.dtype, device=grad.device)
        var.comm.all_to_all(received, to_owners.contiguous(), recv_counts, send_list, "gradients")
        slab_rows = sum(var.layout.sizes[s] for s in var.owned)
        full = torch.zeros(slab_rows, width, dtype=var.dtype, device=grad.device).index_add_(
            0, ctx.local_rows, received
        )
        grads, start = [], 0
        for s in var.owned:
            size = var.layout.sizes[s]
            grads.append(full.narrow(0, start, size).view(size, *var.shape[1:]))
            start += size
        return (None, None, torch.zeros_like(var._anchor), *grads)
