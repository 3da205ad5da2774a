"""Quantized twins of the distributed collections: each rank packs its own shards, lookups go through
the same exchange (the packed rows travel as bytes) and the float collection's own lookup code.

``shardvar.quantize`` learns these types here (this layer is above the quantized one, which cannot
import it): :func:`~shardvar.quantized.register` adds them to the one list of what it accepts.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .._errors import ShardvarTypeError
from ..layout import Layout
from ..nn import KeyedJagged, jagged_split, pack, row_dtype
from ..quantized import QuantizedEmbedding, QuantizedEmbeddingBag, quantize_table, register
from ..variables import RowFormat
from ._collection import DistributedEmbeddingBagCollection, DistributedEmbeddingCollection, lookup_collection

__all__ = ["QuantizedDistributedEmbeddingBagCollection", "QuantizedDistributedEmbeddingCollection"]


class _PackedReplicas(nn.Module):
    """The replicated tables packed, whole on every rank: looked up locally, each table its own kernel, with
    the inputs packed by the local collection's ``pack`` (so checked before any collective, as the float
    twin's replicas)."""

    def __init__(self, tables: dict[str, nn.Module], pooled: bool) -> None:
        super().__init__()
        self.tables = nn.ModuleDict(tables)
        self.pooled = pooled

    def pack(self, features: dict, offsets: dict, weights: dict, table_of: dict[str, str]) -> list[tuple]:
        packed = []
        for name, table in self.tables.items():
            layouts, present = {name: Layout.div(table.num_embeddings, 1)}, [f for f in features if table_of[f] == name]
            packed.append(
                (present, pack(present, table_of, layouts, {name: 0}, row_dtype(table), features, offsets, weights))
            )
        return packed

    def forward(self, packed: list[tuple]) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for table, (present, (rows, offs, psw, counts)) in zip(self.tables.values(), packed, strict=True):
            if not present:
                continue
            if not self.pooled:
                out.update(jagged_split(table(rows), offs, counts, present))
                continue
            out.update(zip(present, table(rows, offs, per_sample_weights=psw).split(counts), strict=True))
        return out


def _replica(weight: torch.Tensor, mode: str | None, fmt: RowFormat) -> nn.Module:
    rows, dim = weight.shape
    args = (rows, dim, Layout.div(rows, 1), fmt, {0: fmt.pack(weight.detach())})
    return QuantizedEmbedding(*args) if mode is None else QuantizedEmbeddingBag(*args, mode=mode)


class QuantizedDistributedEmbeddingBagCollection(nn.Module):
    """A ``DistributedEmbeddingBagCollection``'s forward over packed tables (inference only; collective)."""

    def __init__(self, source: DistributedEmbeddingBagCollection, fmt: RowFormat) -> None:
        super().__init__()
        for attr in ("comm", "configs", "served", "feature_tables", "layouts", "groups", "starts", "pooled"):
            setattr(self, attr, getattr(source, attr))
        for name, table in source.replicas.embedding_bags.items():  # every table checked before any is packed
            fmt.check(table.weight.dtype, table.weight.shape[1], f"table {name!r}")
        for bag, names in zip(source.bags, source.groups, strict=True):
            fmt.check(bag.store.dtype, bag.embedding_dim, f"tables {names}")
        mode = lambda n: self.configs[n].mode if self.pooled else None  # noqa: E731
        replicas = {n: _replica(t.weight, mode(n), fmt) for n, t in source.replicas.embedding_bags.items()}
        self.replicas = _PackedReplicas(replicas, self.pooled)
        self.bags = nn.ModuleList([quantize_table(bag, fmt) for bag in source.bags])
        self.eval()

    # DistributedEmbeddingBagCollection.forward's signature (`duplicates` pairs them): a drop-in, and
    # the lookup is that collection's own `lookup_collection`.
    def forward(
        self,
        features: dict[str, Any] | KeyedJagged,
        offsets: dict[str, Any] | None = None,
        per_sample_weights: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        return lookup_collection(self, self.bags, self.replicas, features, offsets, per_sample_weights)

    @property
    def nbytes(self) -> int:
        """Bytes of this rank's packed rows (its shards and the replicated tables), scale and bias included."""
        return sum(t.nbytes for t in [*self.bags, *self.replicas.tables.values()])

    def sharded_variables(self) -> dict[str, Any]:
        raise ShardvarTypeError(
            f"a {type(self).__name__} is not checkpointed: save the float collection and quantize the "
            "checkpoint (shardvar.quantize(path, dtype, dst=...)), or quantize the loaded float collection"
        )


class QuantizedDistributedEmbeddingCollection(QuantizedDistributedEmbeddingBagCollection):
    """A ``DistributedEmbeddingCollection``'s forward (each feature's rows) over packed tables."""

    def forward(self, features: dict[str, Any] | KeyedJagged, offsets: dict[str, Any] | None = None) -> dict[str, Any]:
        return lookup_collection(self, self.bags, self.replicas, features, offsets, None)


register(DistributedEmbeddingBagCollection, QuantizedDistributedEmbeddingBagCollection)
register(DistributedEmbeddingCollection, QuantizedDistributedEmbeddingCollection)
