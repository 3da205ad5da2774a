"""A pooled lookup whose sparse weight gradient is one row per distinct id: a sparse product.

``F.embedding_bag(..., sparse=True)`` hands back a gradient row per looked-up id (each bag's
gradient copied to every id in it, 20 copies for bags of 20), which the optimizer then sorts and
sums again. Here the gradient of the distinct rows is computed at once as ``S @ grad_bags``,
``S[u, b]`` being the weight of row ``u`` in bag ``b`` (its per-sample weights summed, divided by
the bag's length for mean bags). That product is itself a pooled lookup: once the ids are sorted,
the ids of each distinct row are a "bag" of bag numbers, and ``F.embedding_bag`` over the bags'
gradient sums them (FBGEMM's kernel, as its CPU backward does). The work is one radix sort of the
ids and one pass over them, never a per-id copy of the gradient, and the result is coalesced.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from ..variables._distinct import sort_stable

__all__ = ["sparse_bag"]


def _bag_of(offsets: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The bag of each id, and each bag's length."""
    lengths = torch.diff(offsets, append=offsets.new_tensor([n]))
    return torch.repeat_interleave(
        torch.arange(offsets.numel(), device=offsets.device), lengths, output_size=n
    ), lengths


# Rows [start, stop) of the weight whose gradient goes to ``sink(rows - start, gradient rows)`` in
# backward rather than to the weight's .grad (a fused optimizer's update, one table at a time).
Sink = tuple[int, int, Callable[[torch.Tensor, torch.Tensor], None]]


def row_gradient(
    rows: torch.Tensor,
    offsets: torch.Tensor,
    scale: torch.Tensor | None,
    mode: str,
    grad: torch.Tensor,
    shape: tuple[int, int],
    sinks: Sequence[Sink] = (),
) -> torch.Tensor | None:
    """The coalesced sparse gradient of the weight: for each distinct row, the sum over the bags holding it.

    The rows of each sink's range are handed to the sink as they are summed (one range's rows
    exist at a time); None when the sinks took every row.
    """
    n = rows.numel()
    ordered, order = sort_stable(rows, shape[0])
    bag, lengths = _bag_of(offsets, n)
    bag = bag.index_select(0, order)  # each sorted id's bag (a gather: several times a binary search's speed)
    weight = None if scale is None else scale.index_select(0, order)
    if mode == "mean":
        share = lengths.clamp(min=1).to(grad.dtype).reciprocal_().index_select(0, bag)
        weight = share if weight is None else weight.mul_(share)
    del order
    bounds = [(start, stop) for start, stop, _ in sinks]
    cuts = torch.searchsorted(ordered, ordered.new_tensor(bounds).reshape(-1)).tolist() if sinks else []
    kept, done = [], 0
    for (start, _, sink), lo, hi in zip(sinks, cuts[::2], cuts[1::2], strict=True):
        kept.append((done, lo))
        unique, summed = _summed_rows(ordered[lo:hi], bag[lo:hi], None if weight is None else weight[lo:hi], grad)
        sink(unique.to(torch.int64).sub_(start), summed)
        done = hi
    kept = [(lo, hi) for lo, hi in [*kept, (done, n)] if hi > lo or not sinks]
    if not kept:  # the sinks took every row
        return None
    parts = [
        _summed_rows(ordered[lo:hi], bag[lo:hi], None if weight is None else weight[lo:hi], grad) for lo, hi in kept
    ]
    unique = torch.cat([u for u, _ in parts]) if len(parts) != 1 else parts[0][0]
    summed = torch.cat([v for _, v in parts]) if len(parts) != 1 else parts[0][1]
    return torch.sparse_coo_tensor(
        unique.to(torch.int64)[None], summed, shape, is_coalesced=True, check_invariants=False
    )


def _summed_rows(
    ordered: torch.Tensor, bag: torch.Tensor, weight: torch.Tensor | None, grad: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(distinct rows, their gradient) of sorted ids: the ids of a row are a bag of bag numbers, pooled."""
    unique, counts = torch.unique_consecutive(ordered, return_counts=True)
    starts = counts.cumsum(0).sub_(counts)
    return unique, F.embedding_bag(bag, grad, starts, mode="sum", per_sample_weights=weight)


class _SparseBag(torch.autograd.Function):
    @staticmethod
    def forward(
        rows: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor, psw: Any, mode: str, sinks: Any
    ) -> torch.Tensor:
        return F.embedding_bag(rows, weight, offsets, mode=mode, per_sample_weights=psw)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
        rows, weight, offsets, psw, mode, sinks = inputs
        ctx.save_for_backward(rows, offsets, psw, weight if ctx.needs_input_grad[3] else None)
        ctx.mode, ctx.shape, ctx.sinks = mode, tuple(weight.shape), sinks

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        rows, offsets, psw, weight = ctx.saved_tensors
        grad = grad.contiguous()
        psw_grad = None
        if ctx.needs_input_grad[3]:  # learned per-sample weights (before any sink changes the rows they read)
            bag, _ = _bag_of(offsets, rows.numel())
            psw_grad = (grad.index_select(0, bag) * weight.index_select(0, rows)).sum(1)
        weight_grad = None
        if ctx.needs_input_grad[1]:
            weight_grad = row_gradient(rows, offsets, psw, ctx.mode, grad, ctx.shape, ctx.sinks)
        return None, weight_grad, None, psw_grad, None, None


def sparse_bag(
    rows: torch.Tensor,
    weight: torch.Tensor,
    offsets: torch.Tensor,
    mode: str,
    psw: torch.Tensor | None,
    sinks: Sequence[Sink] = (),
) -> torch.Tensor:
    """``F.embedding_bag(rows, weight, offsets, mode, sparse=True, per_sample_weights=psw)`` (sum or mean)
    with the weight's gradient summed per distinct row (see the module's docstring); the rows of
    ``sinks`` (ascending, disjoint ranges) go to them in backward, not to the weight's gradient."""
    return _SparseBag.apply(rows, weight, offsets, psw, mode, tuple(sinks))
