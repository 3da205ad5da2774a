"""EmbeddingCollection: sequence features, every id's row (not pooled), looked up as the pooled collection does.

The tables are ``ShardedEmbedding``s grouped into shared allocations by the same
:func:`batch_tables`, and a call runs the same :func:`lookup_tables` (one kernel per group,
features keyed as in ``TableConfig.feature_names``): only the kernel differs, ``F.embedding``
instead of ``F.embedding_bag``, and each feature's rows come back as :class:`JaggedRows`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ._collection import TableConfig, batch_tables, check_tables, feature_map, lookup_tables
from ._collection_build import build_tables
from ._embedding import ShardedEmbedding
from ._jagged import JaggedRows, KeyedJagged

__all__ = ["EmbeddingCollection"]


class EmbeddingCollection(nn.Module):
    """Named ``ShardedEmbedding`` tables looked up together: ``ec(features) -> {feature: JaggedRows}``.

    Features are given as to ``EmbeddingBagCollection`` (a dict of 2-D ids or 1-D ids with
    offsets, or a ``KeyedJagged`` without weights); feature ``f``'s result holds the row of each
    of its ids, in order (``values`` ``[ids, dim]``), and the ids per bag (``lengths``).

    >>> ec = EmbeddingCollection({"history": TableConfig(10, 4, 2, "mod", feature_names=["clicks", "views"])})
    >>> out = ec(KeyedJagged(("clicks", "views"), torch.tensor([1, 2, 3, 9]), torch.tensor([[2, 1], [0, 1]])))
    >>> tuple(out["clicks"].values.shape), out["clicks"].lengths.tolist(), list(ec.state_dict())
    ((3, 4), [2, 1], ['embeddings.history.weight'])
    """

    def __init__(
        self, tables: dict[str, TableConfig], *, sparse: bool = False, dtype: torch.dtype | None = None
    ) -> None:
        super().__init__()
        check_tables(tables, sparse, pooled=False)
        self.served = feature_map(tables)
        self.feature_tables = self.served.tables  # each output key's table

        def make(cfg: TableConfig, store: Any) -> ShardedEmbedding:
            return ShardedEmbedding(
                cfg.num_embeddings, cfg.embedding_dim, cfg.partitioner, cfg.partition_strategy, sparse=sparse,
                dtype=dtype, _store=store, storage=cfg.storage,
            )  # fmt: skip

        self.embeddings = nn.ModuleDict(build_tables(tables, make, dtype))
        self._groups = batch_tables(self.embeddings)

    def _apply(self, fn: Any, recurse: bool = True) -> EmbeddingCollection:
        super()._apply(fn, recurse)
        self._groups = batch_tables(self.embeddings)  # a move gives each shard its own memory: one per group again
        return self

    def forward(
        self, features: dict[str, Any] | KeyedJagged, offsets: dict[str, Any] | None = None
    ) -> dict[str, JaggedRows]:
        """Each feature's rows, bag by bag; a table's features are looked up with its group in one kernel."""
        return lookup_tables(self.embeddings, self._groups, features, offsets, None, self.served)
