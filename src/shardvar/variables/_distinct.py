"""The distinct ids of a lookup, found with one sort, and the lookup that expands their rows back.

A lookup that fetches rows (from other ranks, or from shards that share no slab) reads each
distinct id once, then gives every id its distinct row. Its backward must sum, for each distinct
id, the gradients of all its occurrences. torch's dense embedding backward does that by
accumulating into a zeroed buffer row by row; but the sort that found the distinct ids has
already put each id's occurrences next to each other, so the sum is a segment sum, which
``F.embedding_bag(mode="sum")`` computes with its vectorised kernels: 3-4x faster on a 65536-id
Zipf batch, and bit for bit the same (each segment adds its occurrences in their input order).

The sort can group the distinct ids by a key other than the id (the rank that owns each one):
the rows then come back from the exchange already in the order the lookup needs.

Bags of the distinct rows (:func:`pool`) take their rows' gradient from the same grouping: each
distinct row's is the sum of its ids' bags' gradients, a segment sum over the sort's order, where
``F.embedding_bag``'s dense backward would sort the ids again (~10 ms of a 65536-id step).

The same sort and segment sum coalesce a sparse gradient (:func:`coalesce`): ~8x faster than
``Tensor.coalesce``, which sorts 64-bit indices, on a 65536-id batch.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from .._recycle import Recycler
from ._gather import _plain, select_rows
from ._native_sort import sorter

__all__ = [
    "Distinct", "coalesce", "distinct", "expand", "pool", "segment_sum", "segments", "sort_stable", "sparse_rows",
]  # fmt: skip


class Distinct(NamedTuple):
    """``ids``: the distinct ids, ordered by key; ``inverse``: each input id's position in ``ids``.

    ``order`` lists the input positions grouped by distinct id, and ``offsets`` where each group starts.
    """

    ids: torch.Tensor
    inverse: torch.Tensor
    order: torch.Tensor
    offsets: torch.Tensor


def sort_stable(keys: torch.Tensor, bound: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.sort(keys, stable=True)`` of 1-D integer keys in ``[0, bound)``: (sorted keys, order).

    The native radix sort of :mod:`._native_sort` where it is there, else torch's (a stable sort of
    integers takes its radix path; 32-bit keys, where they fit, halve its passes over memory). The
    sorted keys come back narrowed to 32 bits where ``bound`` allows.
    """
    dtype = torch.int32 if bound <= torch.iinfo(torch.int32).max else keys.dtype
    native = sorter()
    if native is not None and native.takes(keys):
        return native.sort(keys, bound, dtype)
    return torch.sort(keys.to(dtype), stable=True)


def distinct(ids: torch.Tensor, bound: int, key: torch.Tensor | None = None) -> Distinct:
    """The distinct values of 1-D ``ids``, sorted by ``key`` (one value per id, equal for equal ids;
    default the id itself); every key is in ``[0, bound)`` (an id outside it must not reach here)."""
    # Stable, so that each group keeps its occurrences in input order (the sums add in that order).
    sorted_key, order = sort_stable(ids if key is None else key, bound)
    _, grouped, counts = torch.unique_consecutive(sorted_key, return_inverse=True, return_counts=True)
    offsets = counts.cumsum(0).sub_(counts)
    first = order.index_select(0, offsets)
    inverse = torch.empty_like(order).scatter_(0, order, grouped)
    return Distinct(ids.index_select(0, first), inverse, order, offsets)


def segment_sum(
    values: torch.Tensor,
    order: torch.Tensor,
    offsets: torch.Tensor,
    recycle: tuple[Recycler, Hashable] | None = None,
    weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """Row ``i`` is the sum of ``values[order[offsets[i]:offsets[i + 1]]]`` (each times its ``weights``
    entry where given), added in that order; every segment holds at least one entry.

    ``recycle``: a (recycler, key) to write the sums into that buffer (no page faults on a fresh
    output each step), where nothing needs their gradient.
    """
    if values.device.type != "cpu" and not torch.are_deterministic_algorithms_enabled():
        return _scattered_sum(values, order, offsets, weights)
    if recycle is None or values.requires_grad or values.device.type != "cpu":
        return F.embedding_bag(order, values, offsets, mode="sum", per_sample_weights=weights)
    recycler, key = recycle
    out = recycler.take(key, (offsets.numel(), values.shape[1]), values.dtype, values.device)
    spare = [torch.empty(0, dtype=torch.int64) for _ in range(3)]
    # embedding_bag's own out= form (F.embedding_bag has none); mode 0 is "sum".
    torch.ops.aten._embedding_bag_forward_only.out(
        values, order, offsets, False, 0, False, weights, False, -1, out0=out, out1=spare[0], out2=spare[1],
        out3=spare[2],
    )  # fmt: skip
    return out


def _scattered_sum(
    values: torch.Tensor, order: torch.Tensor, offsets: torch.Tensor, weights: torch.Tensor | None
) -> torch.Tensor:
    # On a GPU, embedding_bag's kernel walks each bag's rows one after another, so a hot id's
    # segment (a tenth of a Zipf batch) takes milliseconds: 77 ms a step for 8 tables on an H100.
    # index_add adds every row at once (atomics; its order of addition is the device's, as in
    # torch's own CUDA embedding backward). Deterministic mode keeps embedding_bag's fixed order.
    segment = torch.zeros(order.numel(), dtype=order.dtype, device=order.device)
    segment.index_fill_(0, offsets[1:].long(), 1)  # a one where each segment after the first starts (int32 too)
    rows = values.index_select(0, order)
    if weights is not None:
        rows.mul_(weights.unsqueeze(1))
    return values.new_zeros(offsets.numel(), *values.shape[1:]).index_add(0, segment.cumsum_(0), rows)


def coalesce(
    keys: torch.Tensor, values: torch.Tensor, bound: int, recycle: tuple[Recycler, Hashable] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """A sparse gradient's rows ``values`` at 1-D ``keys`` in ``[0, bound)``, coalesced: the distinct
    keys ascending (int64), and for each the sum of its rows in input order. One radix sort and a
    segment sum; ``values`` must be floating point and 2-D."""
    unique, order, starts = segments(keys, bound)
    return unique.to(torch.int64), segment_sum(values, order, starts, recycle)


def segments(keys: torch.Tensor, bound: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """1-D integer ``keys`` in ``[0, bound)`` grouped by one stable sort: (the distinct keys ascending,
    narrowed like :func:`sort_stable`'s; the input positions, key by key, each key's in input order;
    where each key's positions start). A segment sum over them adds each key's rows in input order."""
    sorted_key, order = sort_stable(keys, bound)
    unique, counts = torch.unique_consecutive(sorted_key, return_counts=True)
    return unique, order, counts.cumsum(0).sub_(counts)


class _Expand(torch.autograd.Function):
    """``_Expand.apply(rows, inverse, order, offsets, recycler)``: ``rows[inverse]``; backward: segment sums."""

    @staticmethod
    def forward(
        rows: torch.Tensor, inverse: torch.Tensor, order: torch.Tensor, offsets: torch.Tensor, recycler: Any
    ) -> Any:
        if recycler is None or rows.device.type != "cpu":
            return select_rows(rows, inverse)
        out = recycler.take("lookup", (inverse.numel(), rows.shape[1]), rows.dtype, rows.device)
        return torch.index_select(rows, 0, inverse, out=out)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
        _, _, order, offsets, _ = inputs
        ctx.save_for_backward(order, offsets)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        order, offsets = ctx.saved_tensors
        return segment_sum(grad.contiguous(), order, offsets), None, None, None, None


def expand(rows: torch.Tensor, found: Distinct, recycler: Recycler | None = None) -> torch.Tensor:
    """Each id's row, ``rows[found.inverse]``, for ``rows`` of ``found.ids`` (2-D, one per distinct id);
    its memory from ``recycler`` where given (the last lookup's, once nothing holds that)."""
    if rows.dim() == 2 and _plain(rows) and _plain(found.inverse):
        return _Expand.apply(rows, found.inverse, found.order, found.offsets, recycler)
    return F.embedding(found.inverse, rows)


class _Pool(torch.autograd.Function):
    """``_Pool.apply(rows, inverse, offsets, mean, weights, order, starts)``: sum or mean bags of
    ``rows[inverse]``; backward: each row's gradient, a segment sum of its ids' bags' gradients."""

    @staticmethod
    def forward(rows: torch.Tensor, inverse: torch.Tensor, offsets: torch.Tensor, mean: bool, weights: Any,
                order: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:  # fmt: skip
        # The forward kernel alone: F.embedding_bag would also keep what its own backward needs.
        return torch._embedding_bag_forward_only(rows, inverse, offsets, False, int(mean), False, weights, False, -1)[0]

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
        _, inverse, offsets, ctx.mean, weights, order, starts = inputs
        ctx.save_for_backward(offsets, weights, order, starts)
        ctx.ids = inverse.numel()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:  # differentiable ops: twice differentiable
        offsets, weights, order, starts = ctx.saved_tensors
        lengths = torch.diff(offsets, append=offsets.new_tensor([ctx.ids]))
        numbers = torch.arange(offsets.numel(), device=offsets.device)
        bag = torch.repeat_interleave(numbers, lengths, output_size=ctx.ids)  # each id's bag
        if ctx.mean:  # each id carries its bag's 1 / length (times its weight)
            share = lengths.clamp(min=1).to(grad.dtype).reciprocal_().repeat_interleave(lengths, output_size=ctx.ids)
            weights = share if weights is None else share.mul_(weights)
        weights = None if weights is None else weights.index_select(0, order)
        rows = segment_sum(grad.contiguous(), bag.index_select(0, order), starts, weights=weights)
        return rows, None, None, None, None, None, None


def pool(
    rows: torch.Tensor,
    found: Distinct | None,
    offsets: torch.Tensor | None,
    mode: str,
    weights: torch.Tensor | None,
    other: bool = False,
) -> torch.Tensor | None:
    """Sum or mean bags (1-D ``offsets``, the last bag to the end) of ``rows[found.inverse]``, ``rows``
    the distinct ids' (2-D, CPU); None where :func:`_Pool` does not apply (``other``: an option it does
    not take, such as scale_grad_by_freq or include_last_offset), and the caller's op runs instead."""
    if (
        other
        or found is None
        or mode == "max"
        or offsets is None
        or rows.dim() != 2
        or rows.device.type != "cpu"
        or offsets.dtype != found.inverse.dtype
        or not (_plain(rows) and _plain(found.inverse) and _plain(offsets))
        or (weights is not None and (weights.requires_grad or not _plain(weights)))
    ):
        return None
    return _Pool.apply(rows, found.inverse, offsets, mode == "mean", weights, found.order, found.offsets)


def sparse_rows(rows: torch.Tensor, values: torch.Tensor, num_rows: int, coalesced: bool = False) -> torch.Tensor:
    """The sparse COO gradient of a table of ``num_rows`` rows: ``values[i]`` at row ``rows[i]``.

    The one place shardvar builds one. Its callers made the rows themselves, so there is nothing to
    check; ATen's raw constructor also keeps clear of ``torch.sparse_coo_tensor``, which on some
    torch versions (2.11) warns that invariant checks are "implicitly disabled" even when the call
    passes ``check_invariants=False``: an error under ``-W error``.
    """
    return torch.ops.aten._sparse_coo_tensor_with_dims_and_tensors(
        1, values.dim() - 1, (num_rows, *values.shape[1:]), rows.to(torch.int64).unsqueeze(0), values,
        dtype=values.dtype, layout=torch.sparse_coo, device=values.device, is_coalesced=coalesced,
    )  # fmt: skip
