"""Sharded lookups: embedding_lookup, embedding_lookup_sparse, safe_embedding_lookup_sparse, embedding_bag.

Names and arguments follow TensorFlow's; every lookup gathers once per touched shard
(``_gather.gather_rows``) and combines bags with vectorised segment sums.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .._errors import ShardvarTypeError, ShardvarValueError
from ..layout import as_ids, balanced_sizes
from ._gather import gather_rows
from ._sharded_variable import ShardedVariable

__all__ = ["embedding_lookup", "embedding_lookup_sparse", "safe_embedding_lookup_sparse", "embedding_bag"]

COMBINERS = ("sum", "mean", "sqrtn")


def as_sharded(params: Any, partition_strategy: str | None, default: str = "mod") -> ShardedVariable:
    """``params`` as a ShardedVariable: its own layout, or a list read as the reference reads it."""
    if isinstance(params, ShardedVariable):
        if partition_strategy is not None and partition_strategy != params.layout.strategy:
            raise ShardvarValueError(
                f"partition_strategy={partition_strategy!r} conflicts with the ShardedVariable's own layout "
                f"{params.layout}; leave partition_strategy out"
            )
        if params.layout.axis != 0:
            raise ShardvarValueError(f"lookups need a variable sharded along axis 0; got {params.layout}")
        return params
    strategy = default if partition_strategy is None else partition_strategy
    if isinstance(params, torch.Tensor):
        params = [params]
    if isinstance(params, (str, bytes)) or not isinstance(params, Sequence):
        raise ShardvarTypeError(
            f"params must be a ShardedVariable, a tensor or a list of tensors; got {type(params).__name__}"
        )
    variable = ShardedVariable(list(params), strategy=strategy)
    sizes = variable.layout.sizes
    if variable.layout.strategy == "div" and sizes != balanced_sizes(sum(sizes), len(sizes)):
        raise ShardvarValueError(
            f"with partition_strategy='div' a list of shards must have the reference's sizes "
            f"{list(balanced_sizes(sum(sizes), len(sizes)))}; got {list(sizes)}. "
            "For other contiguous sizes pass ShardedVariable(shards)"
        )
    return variable


def _clip(rows: torch.Tensor, ids_ndim: int, max_norm: float | None) -> torch.Tensor:
    # The reference clips each looked-up row to max_norm (L2) without touching the params.
    if max_norm is None:
        return rows
    dims = tuple(range(ids_ndim, rows.dim()))
    norm = torch.linalg.vector_norm(rows, dim=dims, keepdim=True) if dims else rows.abs()
    return rows * (max_norm / torch.clamp(norm, min=max_norm))


def embedding_lookup(
    params: Any, ids: Any, partition_strategy: str | None = None, max_norm: float | None = None
) -> torch.Tensor:
    """Rows ``ids`` (any shape) of the sharded table: shape ``ids.shape + row_shape``.

    ``params`` is a ShardedVariable (its own layout) or a list of tensors read with
    ``partition_strategy`` ("mod" by default, as in the reference).

    >>> shards = [torch.tensor([[0.], [2.]]), torch.tensor([[1.], [3.]])]
    >>> embedding_lookup(shards, torch.tensor([3, 0]), partition_strategy="mod")
    tensor([[3.],
            [0.]])
    """
    variable = as_sharded(params, partition_strategy)
    ids = as_ids(ids, device=None if isinstance(ids, torch.Tensor) else variable.device)
    return _clip(gather_rows(variable.variables, variable.layout, ids), ids.dim(), max_norm)


def _sparse_parts(sp: Any, what: str) -> tuple[torch.Tensor, torch.Tensor, int]:
    if not isinstance(sp, torch.Tensor) or sp.layout != torch.sparse_coo or sp.dim() != 2:
        raise ShardvarTypeError(f"{what} must be a 2-D torch sparse COO tensor [batch, k]; got {sp!r:.100}")
    # Not coalesced on purpose: coalescing would add up repeated entries of a bag.
    indices = sp.indices() if sp.is_coalesced() else sp._indices()
    values = sp.values() if sp.is_coalesced() else sp._values()
    return indices, values, sp.shape[0]


def _combine(
    rows: torch.Tensor, segments: torch.Tensor, weights: torch.Tensor | None, batch: int, combiner: str
) -> torch.Tensor:
    if combiner not in COMBINERS:
        raise ShardvarValueError(f"combiner must be one of {list(COMBINERS)}; got {combiner!r}")
    shape = (batch, *rows.shape[1:])
    segments = segments.to(rows.device)
    if weights is None:
        w = torch.ones(rows.shape[0], dtype=rows.dtype, device=rows.device)
        weighted = rows
    else:
        w = weights.to(rows.device, rows.dtype)
        weighted = rows * w.reshape(-1, *[1] * (rows.dim() - 1))
    total = torch.zeros(shape, dtype=rows.dtype, device=rows.device).index_add(0, segments, weighted)
    if combiner == "sum":
        return total
    denom = w if combiner == "mean" else w * w
    denom = torch.zeros(batch, dtype=rows.dtype, device=rows.device).index_add(0, segments, denom)
    if combiner == "sqrtn":
        denom = denom.sqrt()
    denom = denom.reshape(-1, *[1] * (rows.dim() - 1))
    # Empty bags give zeros, as the reference's div_no_nan does.
    return torch.where(
        denom != 0, total / torch.where(denom != 0, denom, torch.ones_like(denom)), torch.zeros_like(total)
    )


def embedding_lookup_sparse(
    params: Any,
    sp_ids: torch.Tensor,
    sp_weights: torch.Tensor | None = None,
    partition_strategy: str | None = None,
    combiner: str = "mean",
    max_norm: float | None = None,
) -> torch.Tensor:
    """Combine the rows of each bag: entry (b, j) of ``sp_ids`` is an id of output row b.

    >>> ids = torch.sparse_coo_tensor([[0, 0, 1], [0, 1, 0]], [0, 1, 1], (2, 2), check_invariants=True)
    >>> embedding_lookup_sparse([torch.tensor([[1.], [3.]])], ids, combiner="sum")
    tensor([[4.],
            [3.]])
    """
    if combiner not in COMBINERS:
        raise ShardvarValueError(f"combiner must be one of {list(COMBINERS)}; got {combiner!r}")
    variable = as_sharded(params, partition_strategy)
    indices, ids, batch = _sparse_parts(sp_ids, "sp_ids")
    weights = None
    if sp_weights is not None:
        w_indices, weights, _ = _sparse_parts(sp_weights, "sp_weights")
        if w_indices.shape != indices.shape or not torch.equal(w_indices, indices.to(w_indices.device)):
            raise ShardvarValueError("sp_weights must have the same indices as sp_ids")
    ids = as_ids(ids, device=variable.device)
    rows = _clip(gather_rows(variable.variables, variable.layout, ids), 1, max_norm)
    return _combine(rows, indices[0], weights, batch, combiner)


def safe_embedding_lookup_sparse(
    params: Any,
    sp_ids: torch.Tensor,
    sp_weights: torch.Tensor | None = None,
    combiner: str = "mean",
    default_id: int | None = None,
    partition_strategy: str | None = None,
    max_norm: float | None = None,
) -> torch.Tensor:
    """Like :func:`embedding_lookup_sparse`, dropping ids < 0 and weights <= 0 first.

    Bags left empty give zeros, or the row of ``default_id`` when given. The partition strategy
    of a list of shards defaults to "div", as in the reference.
    """
    variable = as_sharded(params, partition_strategy, default="div")
    indices, ids, batch = _sparse_parts(sp_ids, "sp_ids")
    ids = as_ids(ids, device=variable.device)
    keep = ids >= 0
    weights = None
    if sp_weights is not None:
        w_indices, weights, _ = _sparse_parts(sp_weights, "sp_weights")
        if w_indices.shape != indices.shape or not torch.equal(w_indices, indices.to(w_indices.device)):
            raise ShardvarValueError("sp_weights must have the same indices as sp_ids")
        keep &= weights.to(keep.device) > 0
        weights = weights[keep.to(weights.device)]
    segments = indices[0][keep.to(indices.device)]
    out = embedding_lookup_sparse(
        variable,
        torch.sparse_coo_tensor(
            torch.stack([segments, torch.zeros_like(segments)]), ids[keep], (batch, 1), check_invariants=False
        ),
        None
        if weights is None
        else torch.sparse_coo_tensor(
            torch.stack([segments, torch.zeros_like(segments)]), weights, (batch, 1), check_invariants=False
        ),
        combiner=combiner,
        max_norm=max_norm,
    )
    if default_id is not None:
        empty = torch.bincount(segments.to(out.device), minlength=batch) == 0
        default_row = embedding_lookup(variable, torch.tensor([default_id], device=variable.device), max_norm=max_norm)
        out = torch.where(empty.reshape(-1, *[1] * (out.dim() - 1)), default_row.to(out.device), out)
    return out


def embedding_bag(
    params: Any,
    input: torch.Tensor,
    offsets: torch.Tensor | None = None,
    mode: str = "mean",
    per_sample_weights: torch.Tensor | None = None,
    padding_idx: int | None = None,
    include_last_offset: bool = False,
    max_norm: float | None = None,
    partition_strategy: str | None = None,
    *,
    sparse: bool = False,
    scale_grad_by_freq: bool = False,
) -> torch.Tensor:
    """``torch.nn.functional.embedding_bag`` over a sharded table (modes sum, mean, max).

    ``input`` is 2-D ``[bags, n]`` (fixed-size bags) or 1-D with ``offsets`` (bag starts).
    ``max_norm`` clips the looked-up rows (without writing to the table).
    """
    variable = as_sharded(params, partition_strategy)
    if mode not in ("sum", "mean", "max"):
        raise ShardvarValueError(f"mode must be 'sum', 'mean' or 'max'; got {mode!r}")
    ids = as_ids(input, device=None if isinstance(input, torch.Tensor) else variable.device)
    segments, batch = _bag_segments(ids, offsets, include_last_offset)
    ids = ids.reshape(-1)
    if per_sample_weights is not None:
        if mode != "sum":
            raise ShardvarValueError(f"per_sample_weights are only supported with mode='sum'; got mode={mode!r}")
        if per_sample_weights.shape != input.shape:
            raise ShardvarValueError(
                f"per_sample_weights of shape {list(per_sample_weights.shape)} must match "
                f"input of shape {list(input.shape)}"
            )
        per_sample_weights = per_sample_weights.reshape(-1)
    if padding_idx is not None:
        keep = ids != padding_idx
        ids, segments = ids[keep], segments[keep]
        if per_sample_weights is not None:
            per_sample_weights = per_sample_weights[keep]
    rows = gather_rows(variable.variables, variable.layout, ids, sparse=sparse, scale_grad_by_freq=scale_grad_by_freq)
    rows = _clip(rows, 1, max_norm)
    if mode == "max":
        out = torch.zeros((batch, *rows.shape[1:]), dtype=rows.dtype, device=rows.device)
        index = segments.to(rows.device).reshape(-1, *[1] * (rows.dim() - 1)).expand_as(rows)
        return out.scatter_reduce(0, index, rows, "amax", include_self=False)
    return _combine(rows, segments, per_sample_weights, batch, "sum" if mode == "sum" else "mean")


def _bag_segments(ids: torch.Tensor, offsets: Any, include_last_offset: bool) -> tuple[torch.Tensor, int]:
    if ids.dim() == 2:
        if offsets is not None:
            raise ShardvarValueError("offsets must be None when input is 2-D (each row is one bag)")
        return torch.arange(ids.shape[0], device=ids.device).repeat_interleave(ids.shape[1]), ids.shape[0]
    if ids.dim() != 1 or offsets is None:
        raise ShardvarValueError(
            f"input must be 2-D, or 1-D with offsets; got shape {list(ids.shape)} and offsets={offsets}"
        )
    offsets = as_ids(offsets).to(ids.device)
    if offsets.dim() != 1 or offsets.numel() == 0 or int(offsets[0]) != 0:
        raise ShardvarValueError(f"offsets must be 1-D, non-empty and start at 0; got {offsets.tolist()[:8]}")
    if bool((offsets[1:] < offsets[:-1]).any()) or int(offsets[-1]) > ids.numel():
        raise ShardvarValueError(
            f"offsets must be non-decreasing and at most len(input)={ids.numel()}; got {offsets.tolist()[:8]}"
        )
    if include_last_offset:
        if int(offsets[-1]) != ids.numel():
            raise ShardvarValueError(
                f"with include_last_offset=True the last offset must equal len(input)={ids.numel()}; "
                f"got {int(offsets[-1])}"
            )
        offsets = offsets[:-1]
    positions = torch.arange(ids.numel(), device=ids.device)
    return torch.searchsorted(offsets, positions, right=True) - 1, offsets.numel()
