"""``F.embedding`` and ``F.embedding_bag`` over a ShardStore: the one implementation of every lookup.

A lookup finds a *source*: a weight tensor and the indices into it that stand for the ids.

* full slab (one allocation holds the whole table on one device): the weight is the slab itself
  (:class:`SlabView`, or the lone shard) and the indices are the ids' storage rows, so the lookup
  is the unsharded torch op, with all its options, at its speed.
* otherwise (several devices, shards that cannot share a slab, or shards on other ranks): the
  distinct ids' rows are fetched (locally with :class:`GatherRows`, or from their owners by the
  store's ``exchange``) and the op runs on those rows with each id's position among them.

Either way the torch op itself handles padding, bags, per-sample weights and sparse gradients.
Which op, and how it is called, is :mod:`._kernels`' (re-exported here: ``embedding_rows``,
``embedding_bag_rows``, ``bag_parts``, ``packed_bag_rows``, ``packed_rows``, ``renorm_rows``,
``segment_sum``): every lookup in shardvar, this module's and the modules' above it, runs through them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from .._errors import ShardvarDTypeError, ShardvarValueError
from .._validate import BAG_MODES, check_bag_mode, check_bool, check_int, check_number
from ..layout import as_ids, check_ids
from . import _gather
from ._autograd import GatherRows, SlabView, gather_local, scatter_grads
from ._bag_grad import slab_bags, sums_rows
from ._distinct import Distinct, distinct, expand, pool, segment_sum
from ._jagged import bags, check_jagged, is_nested, on_values
from ._kernels import bag_parts, embedding_bag_rows, embedding_rows, packed_bag_rows, packed_rows, renorm_rows
from ._meta import check_readable
from ._spread import checked, exchange_of, spread
from ._store import ShardStore

__all__ = [
    "BAG_MODES", "bag_parts", "check_padding_idx", "checked", "embedding", "embedding_bag",
    "embedding_bag_rows", "embedding_rows", "gather", "gather_local", "packed_bag_rows", "packed_rows",
    "renorm", "renorm_rows", "scatter_grads", "segment_sum", "slab_weight", "spread",
]


class _Source(NamedTuple):
    weight: torch.Tensor
    indices: torch.Tensor
    padding_idx: int | None
    max_norm: float | None  # left for the torch op to apply (the full-slab path)
    sparse: bool
    distinct: Distinct | None = None  # fetched rows: the ids' grouping, whose sums make their gradient


def check_padding_idx(padding_idx: Any, num_rows: int) -> int | None:
    """``padding_idx`` normalised to [0, num_rows), as nn.Embedding accepts it (negative counts back)."""
    if padding_idx is None:
        return None
    p = check_int(padding_idx, "padding_idx")
    if not -num_rows <= p < num_rows:
        raise ShardvarValueError(f"padding_idx must be within [-{num_rows}, {num_rows}); got {p}")
    return p % num_rows


def slab_weight(store: ShardStore) -> torch.Tensor:
    """The full slab as a tensor whose gradient reaches the shards (the lone shard itself if only one)."""
    shards = list(store.local_shards().values())
    if len(shards) == 1 and shards[0].is_contiguous():
        # One shard is the table: no Function, no copy, nothing to pay for sharding.
        return shards[0].view(store.full_slab.shape) if shards[0].dim() != 2 else shards[0]
    if not torch.is_grad_enabled() or not any(s.requires_grad for s in shards):
        # Nothing to differentiate: the slab tensor itself, which requires no grad (the Function's
        # bookkeeping costs more than the checks of a lookup; its output would not require grad either).
        return store.full_slab
    return SlabView.apply(store, *shards)


def _source(
    store: ShardStore,
    ids: torch.Tensor,
    padding_idx: int | None,
    max_norm: float | None,
    norm_type: float,
    sparse: bool,
    by_rows: bool = False,
) -> _Source:
    """Where the op reads: the full slab, or the fetched rows of the distinct ids (``by_rows``)."""
    if _on_meta(store):  # a table being planned, not filled (device="meta"): results have shapes only
        weight = torch.empty(store.layout.num_rows, store.width, dtype=store.dtype, device="meta")
        return _Source(weight, ids, padding_idx, None, False)
    exchange = exchange_of(store)
    if exchange is None and store.full_slab is not None and not by_rows:
        logical = store.logical_slab  # ids are the slab's rows
        rows = ids if logical else store.slab_rows(ids)
        if _transformed(ids):
            rows = _poison_bad(ids, rows, store.layout.num_rows)
        pad = padding_idx
        if padding_idx is not None and not logical:
            pad = int(store.slab_rows(torch.tensor([padding_idx], device=ids.device))[0])
        return _Source(slab_weight(store), rows, pad, max_norm, sparse)
    found = _distinct(store, ids, exchange)
    unique, inverse = found.ids, found.inverse
    request, pad = unique, None
    if padding_idx is not None:
        found = None  # padding ids point at a row of their own: no longer the distinct rows
        # The padding row goes last, and every padding id points at it: the op then gives it no
        # gradient (and leaves it out of bags) exactly as for an unsharded table.
        pad = unique.numel()
        request = torch.cat([unique, unique.new_tensor([padding_idx])])
        inverse = torch.where(ids == padding_idx, pad, inverse)
    if exchange is not None:
        rows = exchange.rows(store, request, sparse=sparse, max_norm=max_norm, norm_type=norm_type)
    else:
        if max_norm is not None:
            renorm(store, unique, max_norm, norm_type)
        rows = GatherRows.apply(store, request, sparse, *store.local_shards().values())
    return _Source(rows, inverse, pad, None, False, found)


def _distinct(store: ShardStore, ids: torch.Tensor, exchange: Any) -> Distinct:
    unchecked = torch.iinfo(torch.int64).max  # the bound of ids nobody checked: no narrower sort key
    if exchange is None:  # valid ids (checked on the host), unless a torch.func transform hides them
        return distinct(ids, unchecked if _transformed(ids) else store.layout.num_rows)
    # Grouped by owning rank (the rows come back in that order), if every id is valid; an invalid
    # one is sent as it is, and the exchange reports it on every rank.
    grouping = exchange.grouping_key(store, ids)
    return distinct(ids, unchecked) if grouping is None else distinct(ids, grouping[1], grouping[0])


def renorm(store: ShardStore, ids: torch.Tensor, max_norm: float, norm_type: float) -> None:
    """Rescale rows ``ids`` (valid, local) in place to norm <= max_norm, as nn.Embedding's max_norm does."""
    group, row = store.route(ids)
    with torch.no_grad():
        for g in range(len(store.groups)):
            rows = row[group == g] if len(store.groups) > 1 else row
            if rows.numel():
                target = store.group_rows(g)  # a view of the shards' memory (2-D tables only)
                renorm_rows(target, rows.to(target.device), max_norm, norm_type)


def _transformed(t: torch.Tensor) -> bool:
    """Whether ``t`` is wrapped by a torch.func transform (vmap, grad): no host reads of its values."""
    if torch.compiler.is_compiling():
        return False  # dynamo traces real tensors (the id check becomes a graph break)
    return torch._C._functorch.is_functorch_wrapped_tensor(t)


def _on_meta(store: ShardStore) -> bool:
    return bool(store.groups) and store.groups[0].device.type == "meta"


def _ids(store: ShardStore, ids: Any, check: bool = True) -> torch.Tensor:
    """``ids`` as an int64 tensor, checked against the table unless ``check`` is False (the caller's op does)."""
    device = store.groups[0].device if store.groups else None
    meta = _on_meta(store)
    t = as_ids(ids, device=None if isinstance(ids, torch.Tensor) else device, allow_meta=meta)
    if meta:
        return t.to("meta")  # shapes only: a meta table holds no values to check ids against
    if check and not _transformed(t):
        check_ids(t, store.layout.num_rows)  # a distributed lookup's refusal is agreed: see checked
    return t


def _op_checks_ids(store: ShardStore, ids: Any, max_norm: float | None) -> bool:
    """Whether the torch op will read ``ids`` unchanged and refuse one outside the table before any write.

    So on the CPU (whose embedding, embedding_bag and index_select kernels check every index; CUDA's
    do not) when the ids are the rows of one full slab in logical order (div shards: a mod layout
    maps ids to storage rows, where a bad id may land on a good row) and nothing reads them first:
    no max_norm (which renormalises rows in place before the op), no exchange, no torch.func
    transform or compilation. Such ids are checked only if the op refuses them
    (:func:`_refused_ids`): an O(n) pass saved on every valid lookup, the same error for a bad one.
    """
    return (
        store.logical_slab
        and max_norm is None
        and isinstance(ids, torch.Tensor)
        and ids.is_cpu
        and store.full_slab.is_cpu
        and exchange_of(store) is None
        and not torch.compiler.is_compiling()
        and not torch._C._functorch.is_functorch_wrapped_tensor(ids)
    )


def _poison_bad(ids: torch.Tensor, rows: torch.Tensor, num_rows: int) -> torch.Tensor:
    # Under vmap the ids cannot be checked on the host: an id outside the table becomes row -1,
    # which the torch op itself refuses (IndexError), instead of a valid row of another id.
    return torch.where((ids < 0) | (ids >= num_rows), -1, rows)


def _options(store: ShardStore, max_norm: Any, norm_type: Any) -> tuple[float | None, float]:
    max_norm = check_number(max_norm, "max_norm", positive=True, allow_none=True)
    if max_norm is not None and (len(store.shape) != 2 or store.layout.axis != 0):
        raise ShardvarValueError(f"max_norm needs a 2-D table split along axis 0; got shape {list(store.shape)}")
    return max_norm, check_number(norm_type, "norm_type")


def gather(store: ShardStore, ids: Any) -> torch.Tensor:
    """Rows ``ids`` (any shape) of the logical variable: shape ``ids.shape + row_shape``."""
    return embedding(store, ids)


def _prepare(
    store: ShardStore, ids: Any, padding_idx: Any, max_norm: Any, norm_type: Any, sparse: bool, defer: bool = False
) -> tuple[torch.Tensor, int | None, float | None, float, bool]:
    """Everything a lookup checks before reading: the store, options, ids and padding index.

    With ``defer`` (the caller reads the full slab with a torch op) the ids are left to the op
    where it checks them (:func:`_op_checks_ids`); the last value says if they were.
    """
    store.refresh()
    check_readable(store)
    max_norm, norm_type = _options(store, max_norm, norm_type)
    deferred = defer and _op_checks_ids(store, ids, max_norm)
    ids = _ids(store, ids, check=not deferred)
    _check_sparse(store, check_bool(sparse, "sparse"))
    pad = None if padding_idx is None else check_padding_idx(padding_idx, store.layout.num_rows)
    return ids, pad, max_norm, norm_type, deferred


def embedding(
    store: ShardStore,
    ids: Any,
    *,
    padding_idx: int | None = None,
    max_norm: float | None = None,
    norm_type: float = 2.0,
    scale_grad_by_freq: bool = False,
    sparse: bool = False,
) -> torch.Tensor:
    """``F.embedding(ids, table)`` where the table is the store's logical variable (split along axis 0).

    Jagged ids give jagged rows (the lookup of their values, in their structure).
    """

    def lookup(ids: Any) -> torch.Tensor:
        prepared = checked(store, lambda: _prepare(store, ids, padding_idx, max_norm, norm_type, sparse, defer=True))
        ids, pad, clip, norm, deferred = prepared
        src = _source(store, ids.reshape(-1), pad, clip, norm, sparse)
        if src.distinct is not None and not scale_grad_by_freq:
            out = expand(src.weight, src.distinct, store.recycler)
        else:
            args = (src.indices, src.weight, src.padding_idx, src.max_norm, norm, scale_grad_by_freq, src.sparse)
            out = _refused_ids(functools.partial(_gather.embedding, *args), deferred, store, ids)
        return out.reshape((*ids.shape, *store.row_shape))  # a tuple: 0-d ids of 1-D params give a 0-d result

    if is_nested(ids):  # its structure checked before the lookup, which checks its values
        checked(store, lambda: check_jagged(ids, "ids"))
    return on_values(ids, lookup)


def _check_sparse(store: ShardStore, sparse: bool) -> None:
    if sparse and (len(store.shape) != 2 or store.layout.axis != 0):
        raise ShardvarValueError(
            f"sparse gradients need a 2-D variable split along axis 0; got shape {list(store.shape)} "
            f"split along axis {store.layout.axis}"
        )


def check_bag(
    ids: torch.Tensor, offsets: torch.Tensor | None, include_last_offset: bool, op_checks_ends: bool = False
) -> torch.Tensor | None:
    """Offsets of 1-D ``ids`` (None for 2-D), or the error naming what is wrong with them.

    With ``op_checks_ends`` (the CPU op, where it also checks the ids: :func:`_op_checks_ids`) the
    first and last offset are left to the op, which refuses a first other than 0 or a last past the
    ids before it reads anything; :func:`_refused_ids` then names them. Their order never is.
    """
    if ids.dim() == 2:
        if offsets is not None:
            raise ShardvarValueError(
                f"offsets must be None when input is 2-D (each row is one bag); got offsets={offsets!r:.60} with "
                f"input of shape {list(ids.shape)}"
            )
        return None
    if ids.dim() != 1 or offsets is None:
        raise ShardvarValueError(
            f"input must be 2-D, or 1-D with offsets; got shape {list(ids.shape)} and offsets={offsets}"
        )
    offsets = as_ids(offsets, what="offsets")  # checked where they are (a meta table's ids are meta), then moved
    if offsets.dim() != 1 or (offsets.numel() == 0 and (ids.numel() or include_last_offset)):
        raise _not_from_zero(offsets, ids)  # no bag for the ids: torch would drop them without a word
    if offsets.numel() == 0:  # no id and no bag: an empty batch, as torch reads it
        return offsets if offsets.device == ids.device else offsets.to(ids.device)
    # The order is checked first on every device: not every torch kernel refuses decreasing
    # offsets (CPU max bags, padded sum bags read them as sorted).
    ordered = not bool(torch.lt(offsets[1:], offsets[:-1]).any())
    if not (op_checks_ends and ordered and not include_last_offset):
        _check_ends(ids, offsets, include_last_offset, ordered)
    return offsets if offsets.device == ids.device else offsets.to(ids.device)


def _not_from_zero(offsets: torch.Tensor, ids: torch.Tensor) -> ShardvarValueError:
    got = f"{offsets.tolist()[:8]} for {ids.numel()} ids"
    return ShardvarValueError(f"offsets must be 1-D, non-empty and start at 0; got {got}")


def _check_ends(ids: torch.Tensor, offsets: torch.Tensor, include_last_offset: bool, ordered: bool) -> None:
    ends = offsets[:: max(offsets.numel() - 1, 1)].tolist()  # the first and last offset, read at once
    first, last = ends[0], ends[-1]
    if first != 0:
        raise _not_from_zero(offsets, ids)
    if last > ids.numel() or not ordered:
        raise ShardvarValueError(
            f"offsets must be non-decreasing and at most len(input)={ids.numel()}; got {offsets.tolist()[:8]}"
        )
    if include_last_offset and last != ids.numel():
        raise ShardvarValueError(
            f"with include_last_offset=True the last offset must equal len(input)={ids.numel()}; got {last}"
        )


def check_weights(per_sample_weights: Any, ids: torch.Tensor, mode: str, dtype: torch.dtype) -> torch.Tensor | None:
    if per_sample_weights is None:
        return None
    if mode != "sum":
        raise ShardvarValueError(f"per_sample_weights are only supported with mode='sum'; got mode={mode!r}")
    w = torch.as_tensor(per_sample_weights)
    if tuple(w.shape) != tuple(ids.shape):
        raise ShardvarValueError(
            f"per_sample_weights of shape {list(w.shape)} must match input of shape {list(ids.shape)}"
        )
    if w.dtype != dtype:
        raise ShardvarDTypeError(f"per_sample_weights must have the table's dtype {dtype}; got {w.dtype}")
    bad = ~torch.isfinite(w)  # a NaN weight would poison a fused optimizer's rows and state in backward
    if bool(bad.any()):
        at = int(bad.reshape(-1).nonzero()[0])
        raise ShardvarValueError(f"per_sample_weights must be finite; got {w.reshape(-1)[at].item()} at position {at}")
    return w.to(ids.device)


def embedding_bag(
    store: ShardStore,
    ids: Any,
    offsets: Any = None,
    *,
    mode: str = "mean",
    per_sample_weights: Any = None,
    padding_idx: int | None = None,
    include_last_offset: bool = False,
    max_norm: float | None = None,
    norm_type: float = 2.0,
    scale_grad_by_freq: bool = False,
    sparse: bool = False,
) -> torch.Tensor:
    """``F.embedding_bag`` over the store's logical ``[rows, dim]`` table; everything is checked first.

    Jagged ``[B, j]`` input is B bags (its rows), as ``F.embedding_bag`` reads it.
    """
    # torch has no sparse gradient for max bags; fetched rows give each shard a sparse one anyway.
    by_rows = sparse and mode == "max"

    def check() -> tuple:
        check_bag_mode(mode)
        given = bags(ids, offsets, per_sample_weights, include_last_offset)  # jagged input as values and offsets
        prepared = _prepare(store, given[0], padding_idx, max_norm, norm_type, sparse, defer=not by_rows)
        bag_offsets = check_bag(prepared[0], given[1], given[3], op_checks_ends=prepared[4])
        return *prepared, given[1], given[3], bag_offsets, check_weights(given[2], prepared[0], mode, store.dtype)

    ids, pad, max_norm, norm_type, deferred, offsets, include_last_offset, bag_offsets, weights = checked(store, check)
    local = sparse and exchange_of(store) is None and not _transformed(ids)
    if local and sums_rows(store, mode, scale_grad_by_freq, pad, max_norm, include_last_offset):
        op = functools.partial(slab_bags, store, ids, bag_offsets, mode, weights)  # no gradient row per id
        return _refused_ids(op, deferred, store, ids, (offsets, include_last_offset))
    src = _source(store, ids if ids.dim() == 1 else ids.reshape(-1), pad, max_norm, norm_type, sparse, by_rows)
    indices = src.indices if src.indices.shape == ids.shape else src.indices.reshape(ids.shape)
    options = (src.max_norm, norm_type, scale_grad_by_freq, mode, src.sparse, weights, include_last_offset)
    pooled = pool(src.weight, src.distinct, bag_offsets, mode, weights, scale_grad_by_freq or include_last_offset)
    if pooled is not None:  # fetched distinct rows: their gradient from the lookup's own grouping
        return pooled
    op = functools.partial(embedding_bag_rows, indices, src.weight, bag_offsets, *options, src.padding_idx)
    return _refused_ids(op, deferred, store, ids, (offsets, include_last_offset))


def _refused_ids(
    op: Callable[[], torch.Tensor], deferred: bool, store: ShardStore, ids: torch.Tensor, bag: tuple | None = None
) -> torch.Tensor:
    """``op()``; if it fails on what was left to it (``deferred``: the ids, a bag's first and last
    offset), the error shardvar gives for them, in the order it checks them; else the op's own."""
    try:
        return op()
    except (RuntimeError, IndexError) as e:
        if not deferred:
            raise
        error = e
    check_ids(ids, store.layout.num_rows)  # names the first bad id
    if bag is not None:
        check_bag(ids, *bag)  # (offsets, include_last_offset): names bad ends
    raise error
