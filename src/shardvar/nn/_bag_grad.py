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

from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["sparse_bag"]


def _bag_of(offsets: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The bag of each id, and each bag's length."""
    lengths = torch.diff(offsets, append=offsets.new_tensor([n]))
    return torch.repeat_interleave(
        torch.arange(offsets.numel(), device=offsets.device), lengths, output_size=n
    ), lengths


def row_gradient(
    rows: torch.Tensor,
    offsets: torch.Tensor,
    scale: torch.Tensor | None,
    mode: str,
    grad: torch.Tensor,
    shape: tuple[int, int],
) -> torch.Tensor:
    """The coalesced sparse gradient of the weight: for each distinct row, the sum over the bags holding it."""
    n = rows.numel()
    bag, lengths = _bag_of(offsets, n)
    weight = scale
    if mode == "mean":
        share = lengths.clamp(min=1).to(grad.dtype).reciprocal_().index_select(0, bag)
        weight = share if weight is None else weight * share
    # A stable sort takes torch's radix path; 32-bit keys halve its passes over memory.
    keys = rows.to(torch.int32) if shape[0] <= torch.iinfo(torch.int32).max else rows
    ordered, order = torch.sort(keys, stable=True)
    unique, counts = torch.unique_consecutive(ordered, return_counts=True)
    starts = counts.cumsum(0).sub_(counts)
    psw = weight.index_select(0, order) if weight is not None else None
    summed = F.embedding_bag(bag.index_select(0, order), grad, starts, mode="sum", per_sample_weights=psw)
    return torch.sparse_coo_tensor(
        unique.to(torch.int64)[None], summed, shape, is_coalesced=True, check_invariants=False
    )


class _SparseBag(torch.autograd.Function):
    @staticmethod
    def forward(rows: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor, psw: Any, mode: str) -> torch.Tensor:
        return F.embedding_bag(rows, weight, offsets, mode=mode, per_sample_weights=psw)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
        rows, weight, offsets, psw, mode = inputs
        ctx.save_for_backward(rows, offsets, psw, weight if ctx.needs_input_grad[3] else None)
        ctx.mode, ctx.shape = mode, tuple(weight.shape)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        rows, offsets, psw, weight = ctx.saved_tensors
        grad = grad.contiguous()
        weight_grad = row_gradient(rows, offsets, psw, ctx.mode, grad, ctx.shape) if ctx.needs_input_grad[1] else None
        psw_grad = None
        if ctx.needs_input_grad[3]:  # learned per-sample weights: each id's row against its bag's gradient
            bag, _ = _bag_of(offsets, rows.numel())
            psw_grad = (grad.index_select(0, bag) * weight.index_select(0, rows)).sum(1)
        return None, weight_grad, None, psw_grad, None


def sparse_bag(
    rows: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor, mode: str, psw: torch.Tensor | None
) -> torch.Tensor:
    """``F.embedding_bag(rows, weight, offsets, mode, sparse=True, per_sample_weights=psw)`` (sum or mean)
    with the weight's gradient summed per distinct row (see the module's docstring)."""
    return _SparseBag.apply(rows, weight, offsets, psw, mode)
