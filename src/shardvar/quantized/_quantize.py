"""``shardvar.quantize``: a trained table (module, distributed module or checkpoint) as packed rows.

A module's table is packed in one kernel call over its slab (this rank's shards, for a
distributed module: each rank packs its own), and the packed slab is split back into the same
shards, so the result keeps the layout, the placement and the one-slab lookup.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .._errors import ShardvarTypeError
from ..checkpoint import quantize_checkpoint
from ..nn import EmbeddingBagCollection, EmbeddingCollection, ShardedEmbedding, ShardedEmbeddingBag
from ..variables import RowFormat, ShardStore, functional, row_format
from ._collections import QuantizedEmbeddingBagCollection, QuantizedEmbeddingCollection
from ._modules import QuantizedEmbedding, QuantizedEmbeddingBag

__all__ = ["accepted", "quantize", "quantize_table", "quantize_tables", "register"]

Quantizer = Callable[[Any, RowFormat], nn.Module]
# type -> how ``quantize`` packs it: the one list of what it accepts (its error message names them).
# Higher layers register their own modules (shardvar.distributed: its collections), as this layer
# cannot import them.
_QUANTIZERS: dict[type, Quantizer] = {}


def register(cls: type, quantizer: Quantizer) -> None:
    """``quantize(x, dtype)`` of an instance ``x`` of ``cls`` (or of a subclass) returns ``quantizer(x, fmt)``."""
    _QUANTIZERS[cls] = quantizer


def accepted() -> list[str]:
    """The names of the types ``quantize`` accepts (their subclasses too), as registered."""
    return [cls.__name__ for cls in _QUANTIZERS]


Table = ShardedEmbedding | ShardedEmbeddingBag


def _slab(store: ShardStore) -> torch.Tensor:
    """The local shards' rows back to back in shard order: the slab itself when they already lie so."""
    shards = store.local_shards()
    if len(store.groups) == 1 and store.groups[0].slab is not None:
        group = store.groups[0]
        if group.members == tuple(shards) and all(k == 1 for k in group.steps):
            return group.slab
    return torch.cat([t.reshape(t.shape[0], -1) for t in shards.values()]) if shards else torch.empty(0)


def _pack(table: Table, fmt: RowFormat) -> dict[int, torch.Tensor]:
    store = table.store
    shards = store.local_shards()
    slab = _slab(store).detach()
    if table.max_norm is not None:  # every row as the float table's lookup leaves it
        slab = slab.clone()
        functional.renorm_rows(slab, torch.arange(slab.shape[0]), table.max_norm, table.norm_type)
    if slab.shape[0] == 0:
        packed = torch.empty(0, fmt.width(table.embedding_dim), dtype=fmt.storage)
    else:
        packed = fmt.pack(slab)
    layout = table.layout
    n, rows = layout.num_shards, layout.num_rows
    if (
        store.is_complete
        and not layout.contiguous
        and all(len(range(s, rows, n)) == k for s, k in enumerate(layout.sizes))
    ):
        # Mod shards as strided views (rows s, s + n, ...) of one slab in logical row order: a
        # lookup then indexes the slab with the ids themselves, as for one shard (no id mapping).
        logical = packed.index_select(0, layout.strategy.storage_rows(layout.sizes, torch.arange(rows)))
        return {s: logical[s::n] for s in range(n)}
    return dict(zip(shards, packed.split([t.shape[0] for t in shards.values()]), strict=True))


def quantize_table(table: Table, fmt: RowFormat) -> QuantizedEmbedding | QuantizedEmbeddingBag:
    """``table`` packed as ``fmt`` rows, in its layout and placement (this rank's shards), lookups alike."""
    _check(table, fmt, type(table).__name__)
    args = (table.num_embeddings, table.embedding_dim, table.layout, fmt, _pack(table, fmt))
    kwargs = {"padding_idx": table.padding_idx, "exchange": table.store.exchange}
    if isinstance(table, ShardedEmbeddingBag):
        return QuantizedEmbeddingBag(*args, mode=table.mode, include_last_offset=table.include_last_offset, **kwargs)
    return QuantizedEmbedding(*args, **kwargs)


def _check(table: Table, fmt: RowFormat, what: str) -> None:
    fmt.check(table.store.dtype, table.embedding_dim, what)


def quantize_tables(tables: dict[str, Table], fmt: RowFormat) -> dict[str, nn.Module]:
    """Each table packed; every table checked before any is packed."""
    for name, table in tables.items():
        _check(table, fmt, f"table {name!r}")
    return {n: quantize_table(t, fmt) for n, t in tables.items()}


def _bag_collection(source: EmbeddingBagCollection, fmt: RowFormat) -> QuantizedEmbeddingBagCollection:
    return QuantizedEmbeddingBagCollection(quantize_tables(dict(source.embedding_bags), fmt), source.served)


def _sequence_collection(source: EmbeddingCollection, fmt: RowFormat) -> QuantizedEmbeddingCollection:
    return QuantizedEmbeddingCollection(quantize_tables(dict(source.embeddings), fmt), source.served)


register(ShardedEmbedding, quantize_table)
register(ShardedEmbeddingBag, quantize_table)
register(EmbeddingBagCollection, _bag_collection)
register(EmbeddingCollection, _sequence_collection)


def quantize(source: Any, dtype: Any, *, dst: str | os.PathLike | None = None, tables: Any = None, **options: Any):
    """``source`` with its tables' rows quantized to ``dtype`` (torch.quint8, torch.quint4x2, torch.float16).

    ``source`` is a ``ShardedEmbedding`` / ``ShardedEmbeddingBag`` (a distributed one too: each
    rank packs its own shards), an ``EmbeddingBagCollection`` / ``EmbeddingCollection`` or a
    distributed one (each rank its shards; the same exchange), any type :func:`accepted` lists, or a
    checkpoint path (then ``dst`` names the checkpoint written, ``tables`` the variables to pack
    when the manifest does not say; see :func:`shardvar.checkpoint.quantize_checkpoint`). The
    result keeps every table's layout; its modules are inference-only drop-ins for their float
    twins' ``forward`` (a collection runs the float collection's own lookup code).

    >>> from shardvar import ShardedEmbeddingBag
    >>> bag = ShardedEmbeddingBag(100, 8, partitioner=4, partition_strategy="mod", mode="sum")
    >>> q = quantize(bag, torch.quint8)
    >>> q(torch.tensor([[1, 2, 3]])).shape, q.nbytes, q.layout == bag.layout
    (torch.Size([1, 8]), 1600, True)
    """
    fmt = row_format(dtype)
    if isinstance(source, (str, os.PathLike)):
        return quantize_checkpoint(source, dst, fmt.dtype, tables=tables, **options)
    if dst is not None or tables is not None or options:
        given = sorted(["dst"] * (dst is not None) + ["tables"] * (tables is not None) + list(options))
        raise ShardvarTypeError(f"{given} apply to quantizing a checkpoint path; got a {type(source).__name__}")
    quantizer = next((_QUANTIZERS[c] for c in type(source).__mro__ if c in _QUANTIZERS), None)
    if quantizer is None:
        raise ShardvarTypeError(
            f"quantize takes a {', '.join(accepted())} (or a subclass) or a checkpoint path; "
            f"got {type(source).__name__}"
        )
    return quantizer(source, fmt)
