"""Lookups over a packed table's store: bags and rows, one kernel call per table.

A packed table keeps its local shards as views of one packed slab (``quantize`` builds it so),
so a local lookup maps the ids to slab rows (vectorised, for every strategy) and runs torch's
row-wise bag kernel once on the slab. A distributed one fetches the packed rows of its distinct
ids from their owners (the store's ``exchange``: bytes travel, not floats) and runs the same
kernel on them (``functional.packed_bag_rows`` and ``packed_rows`` choose the kernel: formats or
modes without one, float16 rows and ``max`` bags, dequantize just the rows a lookup reads and pool
them with ``F.embedding_bag``, which is what the kernel computes).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from .._validate import check_choice
from ..layout import as_ids, check_ids
from ..variables import (
    BAG_MODES,
    RowFormat,
    ShardStore,
    check_bag,
    check_weights,
    checked,
    gather_local,
    packed_bag_rows,
    packed_rows,
    spread,
)

__all__ = ["bag", "rows"]


def _ids(store: ShardStore, ids: Any) -> torch.Tensor:
    t = as_ids(ids)
    # A slab in logical row order is indexed by the ids themselves, and torch's kernels refuse an
    # index outside it (``_clear_errors`` names the bad id then): no extra pass over the ids. A
    # distributed lookup checks them before its exchange (its caller agrees on the verdict: checked).
    if spread(store) or not store.logical_slab:
        check_ids(t, store.layout.num_rows)
    return t


@contextmanager
def _clear_errors(store: ShardStore, ids: torch.Tensor) -> Iterator[None]:
    """A bad id that reached torch's kernel raises shardvar's IndexError naming it and its position."""
    try:
        yield
    except (RuntimeError, IndexError):
        if not spread(store):
            check_ids(ids, store.layout.num_rows)
        raise


def _source(store: ShardStore, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed rows, the row of each id among them): the whole slab, or the fetched distinct rows."""
    slab = store.full_slab
    if slab is not None and not spread(store):
        return slab, store.slab_rows(ids)
    unique, inverse = torch.unique(ids, return_inverse=True)
    with torch.no_grad():  # packed bytes carry no gradient
        if spread(store):
            fetched = store.exchange.rows(store, unique, sparse=False, max_norm=None, norm_type=2.0)
        else:
            fetched = gather_local(store, unique, unique.device)
    return fetched, inverse


def _without_padding(
    ids: torch.Tensor, offsets: torch.Tensor, weights: torch.Tensor | None, padding_idx: int | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Drop the padding ids from their bags, as nn.EmbeddingBag leaves them out (mean counts the rest)."""
    if padding_idx is None:
        return ids, offsets, weights
    keep = ids != padding_idx
    kept_before = torch.cat([keep.new_zeros(1, dtype=torch.int64), keep.cumsum(0)])
    return ids[keep], kept_before.index_select(0, offsets), None if weights is None else weights[keep]


# F.embedding_bag's keyword arguments, as variables.embedding_bag takes them (`duplicates` pairs the
# two signatures): the packed twin of that function, with its own kernel, not a repeated rule.
def bag(
    store: ShardStore,
    fmt: RowFormat,
    ids: Any,
    offsets: Any = None,
    *,
    mode: str = "mean",
    per_sample_weights: Any = None,
    padding_idx: int | None = None,
    include_last_offset: bool = False,
) -> torch.Tensor:
    """``F.embedding_bag`` over the dequantized table, computed from the packed rows; checked first
    (on every rank of a distributed table: a refusal is every rank's, see ``checked``)."""

    def check() -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        check_choice(mode, "mode", BAG_MODES)
        checked_ids = _ids(store, ids)
        bag_offsets = check_bag(checked_ids, offsets, include_last_offset)
        return checked_ids, bag_offsets, check_weights(per_sample_weights, checked_ids, mode, torch.float32)

    ids, offsets, weights = checked(store, check)
    if offsets is None:  # [bags, ids per bag]
        offsets = torch.arange(ids.shape[0], device=ids.device) * ids.shape[1]
        include_last_offset = False
    flat, offsets, weights = _without_padding(
        ids.reshape(-1), offsets, None if weights is None else weights.reshape(-1), padding_idx
    )
    with _clear_errors(store, ids):
        packed, rows = _source(store, flat)
        return packed_bag_rows(
            fmt, packed, rows, offsets, mode=mode, per_sample_weights=weights, include_last_offset=include_last_offset
        )


def rows(store: ShardStore, fmt: RowFormat, ids: Any, dim: int) -> torch.Tensor:
    """Rows ``ids`` (any shape) dequantized: shape ``ids.shape + [dim]``."""
    ids = checked(store, lambda: _ids(store, ids))
    flat = ids.reshape(-1)
    with _clear_errors(store, ids):
        packed, at = _source(store, flat)
        out = packed_rows(fmt, packed, at)
    return out.reshape(*ids.shape, dim)
