"""The kernels of every lookup: which torch op reads rows, and how it is called.

:mod:`._functional` re-exports these (``functional.embedding_rows`` and the rest): they are its
row-level half. The functional module's store lookups and every module above it (the
collections, the replicated and dynamic tables, the quantized twins) decide *what* to look up
(which rows of which weight, which offsets and per-sample weights) and call these for the *how*,
so the choice of kernel (huge-page outputs, the forward-only bag kernel, the packed kernels and
their mean, a max bag's fallback) is made here and nowhere else. Each is one call of the kernel:
nothing is checked that its caller already did.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from .._validate import BAG_MODES
from . import _gather

if TYPE_CHECKING:
    from ._packed import RowFormat

__all__ = [
    "bag_parts",
    "embedding_bag_rows",
    "embedding_rows",
    "packed_bag_rows",
    "packed_rows",
    "renorm_rows",
]


def embedding_rows(
    indices: torch.Tensor,
    weight: torch.Tensor,
    padding_idx: int | None = None,
    max_norm: float | None = None,
    norm_type: float = 2.0,
    scale_grad_by_freq: bool = False,
    sparse: bool = False,
) -> torch.Tensor:
    """``F.embedding(indices, weight, ...)`` (its parameters, in its order): rows ``indices`` of ``weight``,
    huge-page backed where that pays (:mod:`._gather`)."""
    return _gather.embedding(indices, weight, padding_idx, max_norm, norm_type, scale_grad_by_freq, sparse)


def embedding_bag_rows(
    indices: torch.Tensor,
    weight: torch.Tensor,
    offsets: torch.Tensor | None = None,
    max_norm: float | None = None,
    norm_type: float = 2.0,
    scale_grad_by_freq: bool = False,
    mode: str = "mean",
    sparse: bool = False,
    per_sample_weights: torch.Tensor | None = None,
    include_last_offset: bool = False,
    padding_idx: int | None = None,
) -> torch.Tensor:
    """``F.embedding_bag(indices, weight, offsets, ...)``: the bags of rows ``indices`` of ``weight``.

    The parameters are ``F.embedding_bag``'s, in its order (the functional module passes them by
    position: no keyword dictionary on its hot path; the modules name them)."""
    return F.embedding_bag(
        indices, weight, offsets, max_norm, norm_type, scale_grad_by_freq, mode, sparse, per_sample_weights,
        include_last_offset, padding_idx,
    )  # fmt: skip


def bag_parts(
    weight: torch.Tensor,
    parts: Sequence[Any],
    indices: Sequence[torch.Tensor],
    offsets: Sequence[torch.Tensor],
    per_sample_weights: Sequence[torch.Tensor | None],
    mode: str,
) -> tuple[torch.Tensor, ...]:
    """For each part ``i`` (with ``start`` and ``stop``), the bags (sum or mean) of rows ``indices[i]`` of
    ``weight[start:stop]``: the forward kernel alone, for a caller whose Function computes the gradient.

    ``F.embedding_bag`` would keep what its own backward needs (each id's bag: a per-id array and a
    pass) where the weight requires grad; its ``.out`` form computes into a fresh tensor and copies.
    The op's Python binding: ``torch.ops.aten``'s call costs a few microseconds more per part.
    """
    code, lookup, scale = BAG_MODES.index(mode), torch._embedding_bag_forward_only, per_sample_weights
    return tuple(
        lookup(weight[p.start : p.stop], indices[i], offsets[i], False, code, False, scale[i], False, -1)[0]
        for i, p in enumerate(parts)
    )


def renorm_rows(weight: torch.Tensor, rows: torch.Tensor, max_norm: float, norm_type: float) -> None:
    """Rescale rows ``rows`` of 2-D ``weight`` in place to norm <= ``max_norm`` (nn.Embedding's ``max_norm``);
    a weight that requires grad is written under ``torch.no_grad()`` by the caller."""
    torch.embedding_renorm_(weight, rows, max_norm, norm_type)


def _bag_sizes(offsets: torch.Tensor, n: int, include_last_offset: bool) -> torch.Tensor:
    """Ids per bag (at least 1: an empty bag's mean is zero, as nn.EmbeddingBag gives)."""
    ends = offsets if include_last_offset else torch.cat([offsets, offsets.new_tensor([n])])
    return ends.diff().clamp_(min=1).to(torch.float32)


def packed_bag_rows(
    fmt: RowFormat,
    packed: torch.Tensor,
    rows: torch.Tensor,
    offsets: torch.Tensor,
    *,
    mode: str,
    per_sample_weights: torch.Tensor | None,
    include_last_offset: bool,
) -> torch.Tensor:
    """The float32 bags of rows ``rows`` (1-D) of the ``fmt``-packed rows ``packed``: torch's packed bag
    kernel, or, for a format or mode it lacks (float16 rows, ``max``), ``F.embedding_bag`` over just
    the rows read, dequantized (what the kernel computes)."""
    if fmt.bag is not None and mode != "max":  # the packed kernels pool no max
        # Sums only: torch 2.13's kernels return the sum for mode=1 (mean) too; the mean divides here.
        out = fmt.bag(packed, rows, offsets, False, 0, False, per_sample_weights, None, include_last_offset)
        return out if mode == "sum" else out / _bag_sizes(offsets, rows.numel(), include_last_offset)[:, None]
    unique, inverse = torch.unique(rows, return_inverse=True)
    table = fmt.unpack(packed.index_select(0, unique))
    return embedding_bag_rows(
        inverse, table, offsets, mode=mode, per_sample_weights=per_sample_weights,
        include_last_offset=include_last_offset,
    )  # fmt: skip


def packed_rows(fmt: RowFormat, packed: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Rows ``rows`` (1-D) of the ``fmt``-packed rows ``packed``, dequantized to float32: ``[len(rows), dim]``."""
    if fmt.bag is None:
        return fmt.unpack(packed.index_select(0, rows))
    # One bag per row, straight from the packed rows: the kernel's sum of one row is that row, dequantized.
    bags = torch.arange(rows.numel(), device=rows.device)
    return fmt.bag(packed, rows, bags, False, 0, False, None, None, False)
