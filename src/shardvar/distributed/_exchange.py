"""Rows owned by other ranks: the store's ``exchange`` for a distributed variable.

A lookup asks for the rows of distinct ids, checked by the lookup (``functional.checked``: a
rank that refused its input calls ``refuse`` instead). Each id goes to the rank that owns its
shard with one all_to_all (split sizes first, each rank's verdict on its input beside them:
``_agree.agree``, so bad input on any rank stops every rank before anything else), the owners
gather their rows from their local store and send them back. Backward sends each requested
row's gradient to its owner, which turns it into its shards' gradients (dense, or sparse COO)
exactly as a local lookup does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NoReturn

import torch

from .._errors import ShardvarError
from .._pages import empty_like
from ..variables import ShardStore, functional
from ._agree import agree, refuse
from ._comm import Comm

__all__ = ["Exchange", "RowOptions", "grads_to_owners", "rows_back", "send_ids"]


@dataclass(frozen=True)
class RowOptions:
    """How the owners serve rows: sparse shard gradients, and nn.Embedding's max_norm renormalising."""

    sparse: bool = False
    max_norm: float | None = None
    norm_type: float = 2.0


class Exchange:
    """Fetches rows of a store's variable from the ranks that own them (shard s on ``placement[s]``)."""

    def __init__(self, comm: Comm, placement: tuple[int, ...], requires_grad: bool, server: Any = None) -> None:
        self.comm = comm
        self.placement = placement
        # What the owners read rows from: None, their store's shards; else an object whose ``rows(exchange,
        # store, ids, options)`` is this method's (a tiered table's rank serves them from its file's cache)
        self.server = server
        self.owner = torch.tensor(placement, dtype=torch.int64, device=comm.device)
        # Every rank must take part in the backward all_to_all, also one that owns no shard (or
        # whose shards are frozen): this empty tensor puts the lookup in every rank's graph.
        self.anchor = torch.zeros(0, device=comm.device, requires_grad=requires_grad)

    @property
    def world(self) -> int:
        return self.comm.world

    def grouping_key(self, store: ShardStore, ids: torch.Tensor) -> tuple[torch.Tensor, int] | None:
        """A sort key of ``ids`` (valid: checked by the lookup) that groups them by owning rank
        (ascending ids within each) and the bound of its values; None if the key would overflow."""
        n = store.layout.num_rows
        if ids.numel() == 0 or n * self.world >= 1 << 62:
            return None
        owner = self.owner.index_select(0, store.layout.strategy.locate(store.layout.sizes, ids)[0])
        return owner.mul_(n).add_(ids), n * self.world

    def rows(
        self, store: ShardStore, ids: torch.Tensor, *, sparse: bool, max_norm: float | None, norm_type: float
    ) -> torch.Tensor:
        """Rows ``ids`` (1-D, any order, duplicates allowed) as ``[len(ids), width]``. Collective."""
        options = RowOptions(sparse, max_norm, norm_type)
        if self.server is not None:
            return self.server.rows(self, store, ids.to(self.comm.device), options)
        shards = store.local_shards().values()
        return _ExchangeRows.apply(self, store, ids.to(self.comm.device), options, self.anchor, *shards)[0]

    def serving(self, server: Any) -> Exchange:
        """This exchange, its owners reading rows from ``server`` (see ``server`` above)."""
        served = Exchange(self.comm, self.placement, False, server)
        served.anchor = self.anchor
        return served

    def refuse(self, error: ShardvarError) -> NoReturn:
        """Collective, in place of a lookup whose input this rank refused: every rank raises the agreed
        error (in the lookup's first collective, the split sizes, which it takes the place of)."""
        refuse(self.comm, error)


def send_ids(ex: Exchange, store: ShardStore, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, list, list]:
    """All_to_all the ids (valid: checked by the lookup) to their owners: (order sent, ids received,
    counts sent, counts received). The split sizes carry this rank's verdict: good, since it got here.

    The order is empty when ``ids`` are already grouped by owner (see ``Exchange.grouping_key``).
    """
    comm, layout, world = ex.comm, store.layout, ex.comm.world
    owner = ex.owner.index_select(0, layout.strategy.locate(layout.sizes, ids)[0])
    grouped = owner.numel() < 2 or bool((owner[1:] >= owner[:-1]).all())
    order = owner.new_empty(0) if grouped else torch.argsort(owner, stable=True)
    send_counts = torch.bincount(owner, minlength=world)
    recv_list = agree(comm, None, send_counts)  # raises here if another rank refused its input
    send_list = send_counts.tolist()
    recv_ids = torch.empty(sum(recv_list), dtype=torch.int64, device=ids.device)
    comm.all_to_all(recv_ids, ids if grouped else ids.index_select(0, order), recv_list, send_list, "ids")
    return order, recv_ids, send_list, recv_list


class _ExchangeRows(torch.autograd.Function):
    @staticmethod
    def forward(
        ex: Exchange,
        store: ShardStore,
        ids: torch.Tensor,
        options: RowOptions,
        anchor: torch.Tensor,
        *shards: torch.Tensor,
    ) -> tuple[torch.Tensor, ...]:
        order, recv_ids, send_list, recv_list = send_ids(ex, store, ids)
        if options.max_norm is not None and recv_ids.numel():
            functional.renorm(store, torch.unique(recv_ids), options.max_norm, options.norm_type)
        local = functional.gather_local(store, recv_ids, ids.device) if recv_ids.numel() else None
        if local is None:
            local = torch.empty(0, store.width, dtype=store.dtype, device=ids.device)
        rows = rows_back(ex, store, local, order, send_list, recv_list)
        return rows, order, recv_ids, torch.tensor(send_list), torch.tensor(recv_list)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
        ex, store, _, options = inputs[:4]
        _, order, recv_ids, send_list, recv_list = output
        ctx.save_for_backward(order, recv_ids)
        ctx.ex, ctx.store, ctx.sparse = ex, store, options.sparse
        ctx.counts = (send_list.tolist(), recv_list.tolist())
        ctx.mark_non_differentiable(order, recv_ids, send_list, recv_list)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: torch.Tensor, *_: Any) -> tuple:
        order, recv_ids = ctx.saved_tensors
        send_list, recv_list = ctx.counts
        ex, store = ctx.ex, ctx.store
        received = grads_to_owners(ex, store, grad, order, send_list, recv_list)
        grads = functional.scatter_grads(store, recv_ids, received, ctx.sparse) if store.local_shards() else {}
        shards = tuple(grads.get(s) for s in store.local_shards())
        return (None, None, None, None, torch.zeros_like(ex.anchor), *shards)


def rows_back(
    ex: Exchange, store: ShardStore, local: torch.Tensor, order: torch.Tensor, send_list: list, recv_list: list
) -> torch.Tensor:
    """All_to_all the rows an owner read (``local``, for the ids it received) back to the ranks that asked,
    each rank's in the order of its ids (``order``, from :func:`send_ids`)."""
    back = store.recycler.take("exchange rows", (sum(send_list), local.shape[1]), local.dtype, local.device)
    ex.comm.all_to_all(back, local.contiguous(), send_list, recv_list, "rows")
    return empty_like(back).index_copy_(0, order, back) if order.numel() else back  # empty: in owner order


def grads_to_owners(
    ex: Exchange, store: ShardStore, grad: torch.Tensor, order: torch.Tensor, send_list: list, recv_list: list
) -> torch.Tensor:
    """All_to_all each requested row's gradient to its owner: the gradient rows of the ids it received."""
    received = store.recycler.take("exchange grads", (sum(recv_list), grad.shape[1]), grad.dtype, grad.device)
    send = grad.index_select(0, order) if order.numel() else grad
    ex.comm.all_to_all(received, send.contiguous(), recv_list, send_list, "gradients")
    return received
