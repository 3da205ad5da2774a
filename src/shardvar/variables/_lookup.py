"""The reference's lookups: embedding_lookup, embedding_lookup_sparse, safe_embedding_lookup_sparse, embedding_bag.

Names and arguments follow TensorFlow's. Each is a thin layer over ``_functional``'s
``F.embedding`` / ``F.embedding_bag`` on the variable's store: TensorFlow's combiners become
``F.embedding_bag`` modes with per-sample weights, so bags are pooled by torch's own kernel.
``max_norm`` keeps the reference's meaning: looked-up rows are clipped, the table is not written.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from .._errors import ShardvarDTypeError, ShardvarTypeError, ShardvarValueError
from .._validate import check_choice, check_has_values, check_number
from ..layout import as_ids
from . import _functional
from ._jagged import bags, on_values
from ._sharded_variable import ShardedVariable
from ._values import ids_device

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
    variable = ShardedVariable(list(params), partition_strategy=strategy)
    layout = variable.layout
    if layout.contiguous and not layout.is_balanced:
        raise ShardvarValueError(
            f"with partition_strategy={strategy!r} a list of shards must have the reference's sizes "
            f"{list(layout.strategy.sizes(layout.num_rows, layout.num_shards))}; got {list(layout.sizes)}. "
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
    ``partition_strategy`` ("mod" by default, as in the reference). A list's tensors are moved
    into one allocation the first time when nothing else shares their memory, so later lookups
    over the same list run as one kernel.

    >>> shards = [torch.tensor([[0.], [2.]]), torch.tensor([[1.], [3.]])]
    >>> embedding_lookup(shards, torch.tensor([3, 0]), partition_strategy="mod")
    tensor([[3.],
            [0.]])
    """
    variable = as_sharded(params, partition_strategy)
    max_norm = check_number(max_norm, "max_norm", positive=True, allow_none=True)

    def lookup(flat: Any) -> torch.Tensor:
        rows = _functional.gather(variable.store, flat)
        return _clip(rows, rows.dim() - len(variable.store.row_shape), max_norm)

    return on_values(ids, lookup)  # jagged ids: jagged rows


def _described(x: Any) -> str:
    """What ``x`` is, in a few words: never its values (printing a large tensor costs its size)."""
    if isinstance(x, torch.Tensor):
        layout = str(x.layout).removeprefix("torch.").replace("strided", "dense")
        return f"a {layout} tensor of rank {x.dim()}, shape {list(x.shape)}"
    return f"a {type(x).__name__}"


def _sparse_parts(sp: Any, what: str, flatten: bool = False) -> tuple[torch.Tensor, torch.Tensor, tuple[int, ...]]:
    """(bag of each entry, the entries, the batch shape) of a sparse ``[batch..., k]`` tensor."""
    is_coo = isinstance(sp, torch.Tensor) and sp.layout == torch.sparse_coo
    if not is_coo or not (sp.dim() >= 2 if flatten else sp.dim() == 2):
        shape = "[batch..., k] (rank 2 or more)" if flatten else "[batch, k] (rank 2)"
        raise ShardvarTypeError(f"{what} must be a torch sparse COO tensor {shape}; got {_described(sp)}")
    check_has_values(sp, what)
    # Not coalesced on purpose: coalescing would add up repeated entries of a bag.
    indices = sp.indices() if sp.is_coalesced() else sp._indices()
    values = sp.values() if sp.is_coalesced() else sp._values()
    batch = tuple(sp.shape[:-1])
    bag = torch.zeros_like(indices[0])
    for d, size in enumerate(batch):  # leading dimensions flatten row-major, as in the reference
        bag = bag * size + indices[d]
    return bag, values, batch


def _same_indices(sp_ids: torch.Tensor, sp_weights: Any) -> torch.Tensor | None:
    if sp_weights is None:
        return None
    _, weights, _ = _sparse_parts(sp_weights, "sp_weights", flatten=True)
    ids_idx = sp_ids.indices() if sp_ids.is_coalesced() else sp_ids._indices()
    w_idx = sp_weights.indices() if sp_weights.is_coalesced() else sp_weights._indices()
    if w_idx.shape != ids_idx.shape or not torch.equal(w_idx, ids_idx.to(w_idx.device)):
        raise ShardvarValueError(
            f"sp_weights must have the same indices as sp_ids; got {w_idx.shape[1]} entries at "
            f"{w_idx.T[:4].tolist()}... for {ids_idx.shape[1]} at {ids_idx.T[:4].tolist()}..."
        )
    if not weights.is_floating_point():
        raise ShardvarDTypeError(f"sp_weights must hold floating-point weights; got dtype {weights.dtype}")
    return weights


def _computed_in(params: torch.dtype, weights: torch.Tensor | None) -> torch.dtype:
    """The dtype weighted bags are pooled in, as the reference: float16 and bfloat16 tables in float32
    (cast back after), others in their own; the weights, of any float dtype, are cast to it."""
    low = weights is not None and params in (torch.float16, torch.bfloat16)
    return torch.float32 if low else params


def _bag_weights(
    bag: torch.Tensor, weights: torch.Tensor | None, batch: int, combiner: str, dtype: torch.dtype
) -> tuple[str, torch.Tensor | None]:
    """TensorFlow's combiner as an ``F.embedding_bag`` mode and per-sample weights."""
    if weights is None and combiner in ("sum", "mean"):
        return combiner, None
    w = torch.ones(bag.numel(), dtype=dtype, device=bag.device) if weights is None else weights.to(bag.device, dtype)
    if combiner == "sum":
        return "sum", w
    denom = w if combiner == "mean" else w * w
    total = torch.zeros(batch, dtype=dtype, device=bag.device).index_add(0, bag, denom)
    if combiner == "sqrtn":
        total = total.sqrt()
    # Empty or zero-weight bags give zeros, as the reference's div_no_nan does.
    scale = torch.where(total != 0, 1 / torch.where(total != 0, total, torch.ones_like(total)), torch.zeros_like(total))
    return "sum", w * scale.index_select(0, bag)


def _combine(
    variable: ShardedVariable,
    ids: torch.Tensor,
    bag: torch.Tensor,
    weights: torch.Tensor | None,
    batch: int,
    combiner: str,
    max_norm: float | None,
) -> torch.Tensor:
    """Pool rows ``ids`` into ``batch`` bags (entry j into bag ``bag[j]``) with a TensorFlow combiner."""
    store = variable.store
    if bag.numel() > 1 and bool((bag[1:] < bag[:-1]).any()):
        order = torch.argsort(bag, stable=True)  # F.embedding_bag wants each bag's entries together
        bag, ids = bag.index_select(0, order), ids.index_select(0, order.to(ids.device))
        weights = None if weights is None else weights.index_select(0, order.to(weights.device))
    dtype = _computed_in(store.dtype, weights)
    mode, per_sample = _bag_weights(bag, weights, batch, combiner, dtype)
    offsets = torch.zeros(batch, dtype=torch.int64, device=bag.device)
    if batch > 1:
        offsets[1:] = torch.bincount(bag, minlength=batch)[:-1].cumsum(0)
    if max_norm is None and dtype == store.dtype:
        out = _functional.embedding_bag(store, ids, offsets.to(ids.device), mode=mode, per_sample_weights=per_sample)
    else:  # clipped rows, or a low-precision table's rows in float32: pooled apart
        rows = _clip(_functional.gather(store, ids), 1, max_norm).reshape(ids.numel(), store.width).to(dtype)
        positions = torch.arange(ids.numel(), device=rows.device)
        out = _functional.embedding_bag_rows(
            positions, rows, offsets.to(rows.device), mode=mode, per_sample_weights=per_sample
        )
    # bags pool flat rows; params of rank > 2 keep their row shape
    return out.reshape((batch, *store.row_shape)).to(store.dtype)


def _check_combiner(combiner: Any) -> str:
    return check_choice(combiner, "combiner", COMBINERS)


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
    combiner = _check_combiner(combiner)
    variable = as_sharded(params, partition_strategy)
    max_norm = check_number(max_norm, "max_norm", positive=True, allow_none=True)
    bag, ids, batch = _sparse_parts(sp_ids, "sp_ids")
    weights = _same_indices(sp_ids, sp_weights)
    ids = as_ids(ids, device=ids_device(variable.store))
    return _combine(variable, ids, bag, weights, batch[0], combiner, max_norm)


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

    Bags left empty give zeros, or the row of ``default_id`` when given. ``sp_ids`` of rank > 2
    are flattened to ``[batch, k]`` and the result has their leading shape, as in the reference.
    The partition strategy of a list of shards defaults to "div", as in the reference.
    """
    combiner = _check_combiner(combiner)
    variable = as_sharded(params, partition_strategy, default="div")
    max_norm = check_number(max_norm, "max_norm", positive=True, allow_none=True)
    bag, ids, batch_shape = _sparse_parts(sp_ids, "sp_ids", flatten=True)
    weights = _same_indices(sp_ids, sp_weights)
    ids = as_ids(ids, device=ids_device(variable.store))
    keep = ids >= 0
    if weights is not None:
        keep &= weights.to(keep.device) > 0
        weights = weights[keep.to(weights.device)]
    batch = math.prod(batch_shape)
    bag = bag[keep.to(bag.device)]
    out = _combine(variable, ids[keep], bag, weights, batch, combiner, max_norm)
    if default_id is not None:
        empty = (torch.bincount(bag, minlength=batch) == 0).to(out.device)  # counted where the ids are: not meta
        default_row = embedding_lookup(variable, torch.tensor([default_id], device=variable.device), max_norm=max_norm)
        out = torch.where(empty.reshape((-1, *[1] * (out.dim() - 1))), default_row.to(out.device), out)
    return out.reshape((*batch_shape, *out.shape[1:]))


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
    max_norm = check_number(max_norm, "max_norm", positive=True, allow_none=True)
    input, offsets, per_sample_weights, include_last_offset = bags(
        input, offsets, per_sample_weights, include_last_offset
    )
    options = {
        "mode": mode,
        "per_sample_weights": per_sample_weights,
        "padding_idx": padding_idx,
        "include_last_offset": include_last_offset,
        "scale_grad_by_freq": scale_grad_by_freq,
        "sparse": sparse,
    }
    if max_norm is None:
        return _functional.embedding_bag(variable.store, input, offsets, **options)
    # Clip the rows first (the reference's max_norm), then pool the clipped rows.
    rows = _clip(_functional.embedding(variable.store, input, sparse=sparse), input.dim(), max_norm)
    flat = rows.reshape(-1, rows.shape[-1])
    positions = torch.arange(flat.shape[0], device=flat.device).reshape(input.shape)
    pad = None
    if padding_idx is not None:
        p = _functional.check_padding_idx(padding_idx, variable.shape[0])
        flat = torch.cat([flat, flat.new_zeros(1, flat.shape[1])])
        pad = flat.shape[0] - 1
        positions = torch.where(input.to(positions.device) == p, pad, positions)
    return _functional.embedding_bag_rows(
        positions,
        flat,
        offsets,
        mode=mode,
        per_sample_weights=per_sample_weights,
        include_last_offset=include_last_offset,
        padding_idx=pad,
    )
