"""A pooled lookup whose sparse weight gradient is one row per distinct id: a sparse product.

``F.embedding_bag(..., sparse=True)`` hands back a gradient row per looked-up id (each bag's
gradient copied to every id in it, 20 copies for bags of 20), which the optimizer then sorts and
sums again. Here the gradient of the distinct rows is computed at once as ``S @ grad_bags``,
``S[u, b]`` being the weight of row ``u`` in bag ``b`` (its per-sample weights summed, divided by
the bag's length for mean bags). That product is itself a pooled lookup: once the ids are sorted,
the ids of each distinct row are a "bag" of bag numbers, and ``F.embedding_bag`` over the bags'
gradient sums them (FBGEMM's kernel, as its CPU backward does). The work is a radix sort of each
table's ids and one pass over them, never a per-id copy of the gradient, and the result is
coalesced. A collection's tables are done one at a time (its ids are packed table by table), so
the sort's arrays are one table's, and a fused optimizer's rows are summed and updated a slice
at a time: the step's peak holds the batch's rows and the bags' gradient, little else.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from ..variables._distinct import segments, sparse_rows

__all__ = ["Part", "sparse_bag"]


def _bag_of(offsets: torch.Tensor, first_bag: int, first_id: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The bag of each of the ids ``[first_id, stop)`` whose bags (numbered from ``first_bag``) start at
    ``offsets``, 32-bit where the numbers fit (half the memory of a per-id array); and each bag's length."""
    lengths = torch.diff(offsets, append=offsets.new_tensor([stop]))
    last = first_bag + offsets.numel()
    dtype = torch.int32 if last <= torch.iinfo(torch.int32).max else torch.int64
    numbers = torch.arange(first_bag, last, dtype=dtype, device=offsets.device)
    return torch.repeat_interleave(numbers, lengths, output_size=stop - first_id), lengths


class Part(NamedTuple):
    """One table's share of a lookup of several: its bags ``[bags_lo, bags_hi)`` (their ids are one range
    of the input), the rows ``[start, stop)`` of the weight it owns, and the sink its gradient goes to
    in backward, ``sink(rows - start, gradient rows)`` (a fused optimizer's update; None: the weight's
    ``.grad``)."""

    bags_lo: int
    bags_hi: int
    start: int
    stop: int
    sink: Callable[[torch.Tensor, torch.Tensor], None] | None = None


MODES = {"sum": 0, "mean": 1}  # the kernel's codes

# The rows a sink takes at once: their summed gradient and the optimizer's copy of them stay small
# (and in cache), whatever the batch; one call of a few kernels per 4096 rows of 64 floats.
SINK_BYTES = 1 << 20


def row_gradient(
    rows: torch.Tensor,
    offsets: torch.Tensor,
    scale: torch.Tensor | None,
    mode: str,
    grad: torch.Tensor,
    shape: tuple[int, int],
    parts: Sequence[Part] = (),
) -> torch.Tensor | None:
    """The coalesced sparse gradient of the weight: for each distinct row, the sum over the bags holding it.

    Part by part (default: one of everything), in the order given (ascending rows): one part's ids
    are sorted at a time, and a sink's rows are summed and handed to it a slice at a time
    (:data:`SINK_BYTES`), so neither all tables' nor one table's summed rows ever exist at once.
    None when the sinks took every row.
    """
    parts = parts or [Part(0, offsets.numel(), 0, shape[0])]
    ends = torch.cat([offsets, offsets.new_tensor([rows.numel()])])  # bag b's ids: [ends[b], ends[b + 1])
    bounds = ends[[i for p in parts for i in (p.bags_lo, p.bags_hi)]].tolist()
    found = []
    for part, lo, hi in zip(parts, bounds[::2], bounds[1::2], strict=True):
        if hi <= lo and part.sink is not None:  # nothing to hand over
            continue
        bags = offsets[part.bags_lo : part.bags_hi]
        unique, starts, bag, weight = _part_rows(rows[lo:hi], bags, part.bags_lo, scale, lo, mode, grad, shape[0])
        if part.sink is None:
            found.append((unique, F.embedding_bag(bag, grad, starts, mode="sum", per_sample_weights=weight)))
        else:
            _to_sink(part, unique, starts, bag, weight, grad)
    if not found:  # the sinks took every row
        return None
    unique = torch.cat([u for u, _ in found]) if len(found) != 1 else found[0][0]
    summed = torch.cat([v for _, v in found]) if len(found) != 1 else found[0][1]
    return sparse_rows(unique, summed, shape[0], coalesced=True)


def _to_sink(
    part: Part,
    unique: torch.Tensor,
    starts: torch.Tensor,
    bag: torch.Tensor,
    weight: torch.Tensor | None,
    grad: torch.Tensor,
) -> None:
    """Sum the part's distinct rows a slice at a time, each slice handed to the sink before the next."""
    step = max(1, SINK_BYTES // max(1, grad.shape[1] * grad.element_size()))
    cuts = torch.cat([starts[::step], starts.new_tensor([bag.numel()])]).tolist()  # each slice's first id
    for k, first in enumerate(range(0, unique.numel(), step)):
        lo, hi = cuts[k], cuts[k + 1]
        summed = F.embedding_bag(
            bag[lo:hi], grad, starts[first : first + step] - lo, mode="sum",
            per_sample_weights=None if weight is None else weight[lo:hi],
        )  # fmt: skip
        part.sink(unique[first : first + step].to(torch.int64).sub_(part.start), summed)


def _part_rows(
    rows: torch.Tensor,
    offsets: torch.Tensor,
    first_bag: int,
    scale: torch.Tensor | None,
    first_id: int,
    mode: str,
    grad: torch.Tensor,
    bound: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One part's ids ``rows`` (ids ``first_id`` on of the input, in ``[0, bound)``) as bags of bag numbers:
    (distinct rows, where each one's ids start, each sorted id's bag, its weight or None). Pooling the
    bags' gradient over them gives each distinct row's gradient."""
    n = rows.numel()
    bag, lengths = _bag_of(offsets, first_bag, first_id, first_id + n)
    weight = None if scale is None else scale[first_id : first_id + n]
    if mode == "mean":
        share = lengths.clamp(min=1).to(grad.dtype).reciprocal_().repeat_interleave(lengths, output_size=n)
        weight = share if weight is None else share.mul_(weight)
    unique, order, starts = segments(rows, bound)
    bag = bag.index_select(0, order)  # each sorted id's bag (a gather: several times a binary search's speed)
    weight = None if weight is None else weight.index_select(0, order)
    return unique, starts.to(bag.dtype), bag, weight  # the kernel takes offsets of its ids' dtype


class _SparseBag(torch.autograd.Function):
    @staticmethod
    def forward(
        rows: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor, psw: Any, mode: str, parts: Any
    ) -> torch.Tensor:
        # The kernel without what its own backward keeps (each id's bag: a per-id array and a pass);
        # ``F.embedding_bag`` would take that path, the weight requiring grad. (Its ``.out`` form
        # computes into a fresh tensor and copies: no help.)
        return torch.ops.aten._embedding_bag_forward_only(
            weight, rows, offsets, False, MODES[mode], False, psw, False, -1
        )[0]

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
        rows, weight, offsets, psw, mode, parts = inputs
        ctx.save_for_backward(rows, offsets, psw, weight if ctx.needs_input_grad[3] else None)
        ctx.mode, ctx.shape, ctx.parts = mode, tuple(weight.shape), parts

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        rows, offsets, psw, weight = ctx.saved_tensors
        grad = grad.contiguous()
        psw_grad = None
        if ctx.needs_input_grad[3]:  # learned per-sample weights (before any sink changes the rows they read)
            bag, _ = _bag_of(offsets, 0, 0, rows.numel())
            psw_grad = (grad.index_select(0, bag) * weight.index_select(0, rows)).sum(1)
        weight_grad = None
        if ctx.needs_input_grad[1]:
            weight_grad = row_gradient(rows, offsets, psw, ctx.mode, grad, ctx.shape, ctx.parts)
        return None, weight_grad, None, psw_grad, None, None


def sparse_bag(
    rows: torch.Tensor,
    weight: torch.Tensor,
    offsets: torch.Tensor,
    mode: str,
    psw: torch.Tensor | None,
    parts: Sequence[Part] = (),
) -> torch.Tensor:
    """``F.embedding_bag(rows, weight, offsets, mode, sparse=True, per_sample_weights=psw)`` (sum or mean)
    with the weight's gradient summed per distinct row (see the module's docstring); the rows of
    ``parts`` (each table's bags, ascending, disjoint rows; default: one) with a sink go to it in
    backward, not to the weight's gradient."""
    return _SparseBag.apply(rows, weight, offsets, psw, mode, tuple(parts))
