"""The distributed twins of tiered tables: ``DistributedEmbedding(Bag)(..., storage=shardvar.Tiered(...))``.

Every rank builds the module with the same arguments and keeps the rows of the shards it owns,
and only those, in its own backing file (``Tiered.for_rank``: ``{rank}`` in the file's name, or
the rank before its suffix) with its own bounded cache (:class:`~shardvar.tiered.ShardRows`).
Its store holds no row in RAM, only the layout and the exchange, so a lookup is the distributed
module's own (``functional`` over the store: checks, agreement on bad input, distinct ids sent to
their owners in one all_to_all); the owners serve the rows from their tier (:class:`TierServer`):
the ids resolved to cache slots (kept there by a token until the backward ran), the rows read
there and sent back. In backward each owner hands the gradient rows that come back to its tier's
sink, the fused optimizer's update (``nn._tiered.to_sink``, as a local tiered table's backward).

What may fail between the collectives (a cache too small for the rows asked of it, no fused
optimizer in backward) is agreed (``_agree.agree``) before the next one, so every rank raises it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from .._errors import ShardvarError, ShardvarTypeError, ShardvarValueError
from ..nn import TieredTable, pieces, to_sink, unfused
from ..tiered import ShardRows
from ..variables import RowTier, ShardStore, TableStorage
from ._agree import agree, refuse
from ._exchange import Exchange, RowOptions, grads_to_owners, rows_back, send_ids
from ._module import TIERED_TWINS, DistributedEmbedding, DistributedEmbeddingBag, _Distributed

__all__ = ["DistributedTieredEmbedding", "DistributedTieredEmbeddingBag", "TierServer", "open_shards"]


def shard_blocks(layout: Any, owned: tuple[int, ...], dim: int, dtype: torch.dtype, init: Any, pad: int | None):
    """The owned shards' initial rows, shard by shard, a bounded piece at a time (an in-memory rank's values)."""
    for s in owned:
        ids = layout.shard_ids(s)
        for a, b in pieces(ids.numel(), dim, dtype):
            block = init.rows(ids[a:b], (dim,), dtype)
            if pad is not None:
                block[ids[a:b] == pad] = 0
            yield block


def open_shards(
    storage: TableStorage, store: ShardStore, dim: int, dtype: torch.dtype, blocks: Iterator[torch.Tensor]
) -> ShardRows:
    """This rank's tier of a distributed table (its owned shards' rows, from ``blocks``), its store's exchange
    then serving them. Collective: if any rank cannot open its file, every rank raises and removes its own."""
    ex = store.exchange
    comm, layout = ex.comm, store.layout
    owned = tuple(s for s, r in enumerate(ex.placement) if r == comm.rank)
    try:
        if not isinstance(storage, TableStorage) or not hasattr(storage, "for_rank"):
            raise ShardvarValueError(f"a distributed table's storage is a shardvar.Tiered; got {storage!r:.80}")
        mine = storage.for_rank(comm.rank)
        rows = mine.open(sum(layout.sizes[s] for s in owned), dim, dtype, blocks)
    except ShardvarError as e:
        refuse(comm, e, carries_counts=False)
    try:
        agree(comm, None)
    except ShardvarError:
        rows.close()
        rows.file.path.unlink(missing_ok=True)  # this rank's new file: nothing else was in it
        raise
    tier = ShardRows(rows, layout, owned)
    store.attach(exchange=ex.serving(TierServer(tier)))
    return tier


class TierServer:
    """An owner's rows served from its tier (``Exchange.server``)."""

    def __init__(self, tier: RowTier) -> None:
        self.tier = tier

    def rows(self, ex: Exchange, store: ShardStore, ids: torch.Tensor, options: RowOptions) -> torch.Tensor:
        grad = torch.is_grad_enabled() and ex.anchor.requires_grad
        return _TierExchangeRows.apply(ex, store, self.tier, ids, grad, ex.anchor)


class _TierExchangeRows(torch.autograd.Function):
    """Rows ``ids`` from their owners' tiers; backward sends each row's gradient to its owner's sink."""

    @staticmethod
    def forward(
        ctx: Any, ex: Exchange, store: ShardStore, tier: RowTier, ids: torch.Tensor, grad: bool, anchor: torch.Tensor
    ) -> torch.Tensor:
        order, recv_ids, send_list, recv_list = send_ids(ex, store, ids)
        error, slots, token = None, None, None
        try:
            slots, token = tier.resolve(recv_ids, grad=grad)  # may refuse: a cache too small for the rows asked
        except ShardvarError as e:
            error = e
        agree(ex.comm, error)  # every rank raises a refusal, before the rows' all_to_all
        local = tier.values.index_select(0, slots)
        ctx.save_for_backward(order, slots)
        ctx.ex, ctx.store, ctx.tier, ctx.token = ex, store, tier, token
        ctx.counts = (send_list, recv_list)
        return rows_back(ex, store, local, order, send_list, recv_list)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        order, slots = ctx.saved_tensors
        ex, tier = ctx.ex, ctx.tier
        agree(ex.comm, unfused(tier))  # no fused optimizer on some rank: every rank refuses, none updates
        received = grads_to_owners(ex, ctx.store, grad, order, *ctx.counts)
        ctx.token = None  # the rows may move once their update is done
        to_sink(tier, slots, received)
        return None, None, None, None, None, torch.zeros_like(ex.anchor)


class _TieredRanks:
    """What a distributed module's tiered twin adds (a mixin before ``TieredTable``): no rows in RAM, each
    rank's owned shards in its own file, served to the others through the exchange."""

    rows_in_ram = False

    def _open(self, storage: TableStorage, dtype: torch.dtype, weight: torch.Tensor | None) -> RowTier:
        if weight is not None:
            raise ShardvarValueError("a distributed table draws its rows from its initializer; _weight is not taken")
        store = self._store
        owned = tuple(s for s, r in enumerate(store.exchange.placement) if r == store.exchange.comm.rank)
        blocks = shard_blocks(self.layout, owned, self.embedding_dim, dtype, self.initializer, self.padding_idx)
        return open_shards(storage, store, self.embedding_dim, dtype, blocks)

    @property
    def store(self) -> ShardStore:
        """The layout and the exchange (no row here: each rank's are in its file; lookups are collective)."""
        return self._store

    @property
    def cache(self) -> Any:
        raise ShardvarTypeError(
            "a distributed tiered table reads no rows ahead (its owners learn which rows are asked only in the "
            "lookup): give a Prefetcher local tables only"
        )

    def cache_stats(self) -> dict[str, float]:
        """This rank's cache (of its own shards' rows): hit rate, hits, misses, evictions, rows written back,
        bytes read and written. Each rank has its own; gather them yourself for a total."""
        return self.tier.cache_stats()

    def extra_repr(self) -> str:
        comm = self._store.exchange.comm
        base = super(_Distributed, self).extra_repr()  # type: ignore[misc]  # the local module's
        return base + f", rank={comm.rank}/{comm.world}, owned={list(self.tier.owned)}, storage={self.tier.spec!r}"


class DistributedTieredEmbedding(_TieredRanks, TieredTable, DistributedEmbedding):
    """A DistributedEmbedding whose ranks keep their shards' rows in files (``storage=shardvar.Tiered``)."""


class DistributedTieredEmbeddingBag(_TieredRanks, TieredTable, DistributedEmbeddingBag):
    """A DistributedEmbeddingBag whose ranks keep their shards' rows in files (``storage=shardvar.Tiered``)."""


TIERED_TWINS.update(
    {DistributedEmbedding: DistributedTieredEmbedding, DistributedEmbeddingBag: DistributedTieredEmbeddingBag}
)
