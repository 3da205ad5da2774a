"""``shardvar.quantize``: a trained table (module, distributed module or checkpoint) as packed rows.

A module's table is packed in one kernel call over its slab (this rank's shards, for a
distributed module: each rank packs its own), and the packed slab is split back into the same
shards, so the result keeps the layout, the placement and the one-slab lookup.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from .._errors import ShardvarTypeError
from ..checkpoint._quantize import quantize_checkpoint
from ..nn import EmbeddingBagCollection, ShardedEmbedding, ShardedEmbeddingBag
from ..variables import ShardStore
from ..variables._packed import RowFormat, row_format
from ._modules import QuantizedEmbedding, QuantizedEmbeddingBag, QuantizedEmbeddingBagCollection

__all__ = ["quantize"]

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
        torch.embedding_renorm_(slab, torch.arange(slab.shape[0]), table.max_norm, table.norm_type)
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


def _quantize_table(table: Table, fmt: RowFormat) -> QuantizedEmbedding | QuantizedEmbeddingBag:
    args = (table.num_embeddings, table.embedding_dim, table.layout, fmt, _pack(table, fmt))
    kwargs = {"padding_idx": table.padding_idx, "exchange": table.store.exchange}
    if isinstance(table, ShardedEmbeddingBag):
        return QuantizedEmbeddingBag(*args, mode=table.mode, include_last_offset=table.include_last_offset, **kwargs)
    return QuantizedEmbedding(*args, **kwargs)


def _check(table: Table, fmt: RowFormat, what: str) -> None:
    fmt.check(table.store.dtype, table.embedding_dim, what)


def quantize(source: Any, dtype: Any, *, dst: str | os.PathLike | None = None, tables: Any = None, **options: Any):
    """``source`` with its tables' rows quantized to ``dtype`` (torch.quint8, torch.quint4x2, torch.float16).

    ``source`` is a ``ShardedEmbedding`` / ``ShardedEmbeddingBag`` (a distributed one too: each
    rank packs its own shards), an ``EmbeddingBagCollection``, or a checkpoint path (then ``dst``
    names the checkpoint written, ``tables`` the variables to pack; see
    :func:`shardvar.checkpoint.quantize_checkpoint`). The result keeps every table's layout;
    its modules are inference-only drop-ins for their float twins' ``forward``.

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
    if isinstance(source, EmbeddingBagCollection):
        bags = dict(source.embedding_bags.items())
        for name, bag in bags.items():  # every table checked before any is packed
            _check(bag, fmt, f"table {name!r}")
        return QuantizedEmbeddingBagCollection({n: _quantize_table(b, fmt) for n, b in bags.items()}, source.served)
    if isinstance(source, (ShardedEmbedding, ShardedEmbeddingBag)):
        _check(source, fmt, type(source).__name__)
        return _quantize_table(source, fmt)
    raise ShardvarTypeError(
        "quantize takes a ShardedEmbedding, ShardedEmbeddingBag, EmbeddingBagCollection, their distributed "
        f"twins or a checkpoint path; got {type(source).__name__}"
    )
