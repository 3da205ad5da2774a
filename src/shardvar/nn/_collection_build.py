"""A collection's tables built in place: each group's one allocation first, each table drawn into its rows.

Tables built one by one and then copied into their group's allocation (the tables of one width
and pooling, which :func:`batch_tables` looks up in one kernel) would all be held twice at the
peak. Here the allocation comes first; each table's shards are Parameters over its rows, and
its values are drawn into them in logical order, a bounded piece at a time: torch's ``normal_``
draws the same numbers in pieces of whole 16-value blocks as in one call, so every table equals
the one its own constructor draws, at the tables' memory plus one piece.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from .._pages import empty
from ..layout import Layout
from ..variables import ShardStore, to_layout

__all__ = ["build_tables"]

PIECE_BYTES = 1 << 20  # the most drawn outside the tables at once (mod shards: logical rows are scattered)


def _store_over(slab: torch.Tensor, first: int, layout: Layout, shape: tuple[int, int]) -> ShardStore:
    """A store of ``layout``'s shards as Parameters over ``slab``'s rows from ``first`` on, back to back."""
    shards, start, width = {}, first, shape[1]
    with torch.no_grad():
        for s, size in enumerate(layout.sizes):
            p = nn.Parameter(torch.empty(0, dtype=slab.dtype, device=slab.device))
            p.set_(slab.untyped_storage(), slab.storage_offset() + start * width, (size, width), (width, 1))
            shards[s] = p
            start += size
    return ShardStore(layout, shape, shards)


@torch.no_grad()
def _draw(store: ShardStore) -> None:
    """``nn.init.normal_`` of the logical table, written into the store's rows piece by piece."""
    rows, width = store.shape[0], store.width
    step = max(16, PIECE_BYTES // max(width * store.dtype.itemsize, 1) // 16 * 16)  # whole 16-value blocks
    cuts = [*list(range(0, rows, step))[: max(rows // step, 1)], rows]  # the last piece takes the rest
    slab = store.full_slab
    for a, b in itertools.pairwise(cuts):
        if store.logical_slab:
            nn.init.normal_(slab[a:b])
            continue
        piece = nn.init.normal_(torch.empty((b - a, width), dtype=store.dtype, device=slab.device))
        slab.index_copy_(0, store.slab_rows(torch.arange(a, b, device=slab.device)), piece)


def build_tables(
    tables: Mapping[str, Any], make: Callable[[Any, ShardStore | None], nn.Module], dtype: torch.dtype | None
) -> dict[str, nn.Module]:
    """``make(config, store)`` for each TableConfig, the stores of one (width, mode) sharing one allocation.

    A table whose layout is not split by rows gets ``store=None``: ``make`` builds (and checks) it
    its own way.
    """
    dtype = dtype or torch.get_default_dtype()
    layouts = {
        name: to_layout(c.partitioner, (c.num_embeddings, c.embedding_dim), dtype, c.partition_strategy)
        for name, c in tables.items()
    }
    groups: dict[tuple[int, str], list[str]] = {}
    for name, c in tables.items():
        if layouts[name].axis == 0:
            groups.setdefault((c.embedding_dim, c.mode), []).append(name)
    stores: dict[str, ShardStore] = {}
    for (dim, _), names in groups.items():
        slab = empty((sum(tables[n].num_embeddings for n in names), dim), dtype=dtype)
        first = 0
        for n in names:
            stores[n] = _store_over(slab, first, layouts[n], (tables[n].num_embeddings, dim))
            first += tables[n].num_embeddings
    out = {}
    for name, c in tables.items():  # in the given order: each table draws what it would draw alone
        if name in stores:
            _draw(stores[name])
        out[name] = make(c, stores.get(name))
    return out
