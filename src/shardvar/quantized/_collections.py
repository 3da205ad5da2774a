"""Quantized twins of the collections: the float collection's own lookup over packed tables.

A twin keeps its float collection's feature mapping (``served``: ``nn._collection_build.feature_map``
of the tables' ``TableConfig.feature_names``) and calls the same :func:`lookup_tables`, so every rule of the
float collection (feature names and order, several features per table, pooling, per-sample
weights, KeyedJagged inputs, the output's keys, the errors on bad input) holds for the twin
because it is the same code; only each table's lookup is its packed module's.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from ..nn import (
    EmbeddingBagCollection,
    FeatureMap,
    Features,
    JaggedRows,
    KeyedJagged,
    PerFeature,
    Pooled,
    lookup_tables,
)
from ._modules import QuantizedEmbedding, QuantizedEmbeddingBag

__all__ = ["QuantizedEmbeddingBagCollection", "QuantizedEmbeddingCollection"]


class _QuantizedCollection(nn.Module):
    """Packed tables looked up table by table (each table's kernel over its own slab)."""

    def _setup(self, tables: dict[str, nn.Module], served: FeatureMap | None) -> None:
        # The float collection's output keys (None: each table serves the one feature named as it).
        self.served = served if served is not None else FeatureMap({n: n for n in tables}, {n: (n,) for n in tables})
        self.feature_tables = self.served.tables  # each output key's table, as the float collection has it
        self._groups = [([name], None) for name in tables]  # each table its own kernel call
        self.eval()

    @property
    def nbytes(self) -> int:
        """Bytes of this process's packed rows, scale and bias included."""
        return sum(t.nbytes for t in self._tables().values())

    def _tables(self) -> nn.ModuleDict:
        raise NotImplementedError


class QuantizedEmbeddingBagCollection(_QuantizedCollection):
    """``EmbeddingBagCollection``'s forward over packed tables: ``{feature: [bags, dim]}``, one kernel per table."""

    def __init__(self, bags: dict[str, QuantizedEmbeddingBag], served: FeatureMap | None = None) -> None:
        super().__init__()
        self.embedding_bags = nn.ModuleDict(bags)
        self._setup(bags, served)

    def _tables(self) -> nn.ModuleDict:
        return self.embedding_bags

    # EmbeddingBagCollection.forward's signature (`duplicates` pairs the two): a drop-in, and the
    # lookup itself is the float collection's one `lookup_tables`.
    def forward(self, features: Features, offsets: PerFeature = None, per_sample_weights: PerFeature = None) -> Pooled:
        return lookup_tables(self.embedding_bags, self._groups, features, offsets, per_sample_weights, self.served)

    concat = staticmethod(EmbeddingBagCollection.concat)


class QuantizedEmbeddingCollection(_QuantizedCollection):
    """``EmbeddingCollection``'s forward over packed tables: ``{feature: JaggedRows}`` of dequantized rows."""

    def __init__(self, tables: dict[str, QuantizedEmbedding], served: FeatureMap | None = None) -> None:
        super().__init__()
        self.embeddings = nn.ModuleDict(tables)
        self._setup(tables, served)

    def _tables(self) -> nn.ModuleDict:
        return self.embeddings

    def forward(
        self, features: dict[str, Any] | KeyedJagged, offsets: dict[str, Any] | None = None
    ) -> dict[str, JaggedRows]:
        return lookup_tables(self.embeddings, self._groups, features, offsets, None, self.served)
