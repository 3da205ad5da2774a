"""DistributedEmbedding(Bag): the sharded modules over a store whose shards live on several ranks."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..nn import ShardedEmbedding, ShardedEmbeddingBag
from ..variables import RowInitializer
from ._comm import DEFAULT_TIMEOUT
from ._variable import DistributedShardedVariable, distributed_store

__all__ = ["DistributedEmbedding", "DistributedEmbeddingBag", "TIERED_TWINS"]

TIERED_TWINS: dict[type, type] = {}  # a distributed module -> its tiered twin (``storage=``), filled by ``_tiered``


class _Distributed:
    """What a distributed module adds to its local one (a mixin, not a Module level): construction over
    a store whose shards are spread over ranks (the exchange attached to the store is what makes every
    lookup collective; ``forward`` is the local class's), the weight as a collective variable (which
    the logical state_dict and checkpoints gather through), and the repr's rank and owned shards.

    The public modules are ``_Distributed`` plus ``ShardedEmbedding(Bag)``; a distributed collection's
    group tables are the same pieces (``distributed._collection``), not subclasses of the public ones.
    """

    rows_in_ram: bool = True  # False: a tiered twin's, whose rank keeps its shards in a file (``_tiered``)

    def __new__(cls, *args: Any, storage: Any = None, **kwargs: Any) -> Any:
        if storage is not None and cls in TIERED_TWINS:  # its tiered twin (a subclass: isinstance still holds)
            cls = TIERED_TWINS[cls]
        return super().__new__(cls, *args, storage=storage, **kwargs)

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        partitioner: Any = None,
        partition_strategy: str = "div",
        *,
        initializer: RowInitializer | None = None,
        placement: Sequence[int] | None = None,
        group: Any = None,
        timeout: float = DEFAULT_TIMEOUT,
        dtype: torch.dtype = torch.float32,
        **options: Any,
    ) -> None:
        # The options passed on by name (alike in shape to other pass-throughs, not a shared rule).
        # ``_weight`` (from_pretrained): every rank keeps its owned shards' rows of it (a tiered twin refuses it).
        weight = options.pop("_weight", None) if self.rows_in_ram else options.get("_weight")
        store = distributed_store(
            (num_embeddings, embedding_dim),
            partitioner,
            partition_strategy=partition_strategy,
            dtype=dtype,
            initializer=initializer,
            placement=placement,
            group=group,
            timeout=timeout,
            name="weight",
            held=self.rows_in_ram,
            values=weight if self.rows_in_ram else None,
        )
        super().__init__(num_embeddings, embedding_dim, _store=store, **options)
        self.initializer = initializer or RowInitializer()  # the rows' values, drawn by id (a tiered twin's file)
        if self.padding_idx is not None and weight is None:  # as nn.Embedding initialises it; only its owner holds it
            shard, row = self.layout.locate([self.padding_idx])
            local = self.store.local_shards()
            if int(shard) in local:
                with torch.no_grad():
                    local[int(shard)][int(row)].zero_()

    @property
    def variable(self) -> DistributedShardedVariable:
        """The table as a DistributedShardedVariable (collective lookups, this rank's shards)."""
        return DistributedShardedVariable.from_store(self.store, name="weight")

    weight = variable

    def distributed_variables(self) -> dict[str, DistributedShardedVariable]:
        return {"weight": self.variable}

    def sharded_variables(self) -> dict[str, DistributedShardedVariable]:
        return {"weight": self.variable}

    def extra_repr(self) -> str:
        comm = self.store.exchange.comm
        return super().extra_repr() + f", rank={comm.rank}/{comm.world}, owned={sorted(self.store.local_shards())}"


class DistributedEmbedding(_Distributed, ShardedEmbedding):
    """``nn.Embedding`` with rows sharded over ranks; each rank holds and trains only its shards.

    Every rank constructs it with the same arguments and calls ``forward`` (and backward) on its
    own ids. Parameters are this rank's shards, ``shard_<index>``; keep them out of
    DistributedDataParallel (they are not replicated), e.g. by wrapping only the dense layers.
    Every option of ``ShardedEmbedding`` works (padding_idx, max_norm, scale_grad_by_freq, sparse).
    ``storage=shardvar.Tiered(path, ...)`` (the same on every rank) keeps each rank's shards in its own
    file: ``{rank}`` in the file's name becomes the rank, else the rank goes before the suffix
    (``Tiered.for_rank``); ``cache_stats()`` is then this rank's cache.
    """


class DistributedEmbeddingBag(_Distributed, ShardedEmbeddingBag):
    """``nn.EmbeddingBag`` (sum, mean, max; offsets, per_sample_weights, padding_idx) sharded over ranks
    (``storage=``: as :class:`DistributedEmbedding`'s)."""
