"""A pooled lookup whose sparse weight gradient is one row per distinct id: a sparse product.

``F.embedding_bag(..., sparse=True)`` hands back a gradient row per looked-up id (each bag's
gradient copied to every id in it, 20 copies for bags of 20), which the optimizer then sorts and
sums again. Here the gradient of the distinct rows is computed at once as ``S @ grad_bags``,
``S[u, b]`` being the weight of row ``u`` in bag ``b`` (its per-sample weights summed, divided by
the bag's length for mean bags). That product is itself a pooled lookup: once the ids are sorted,
the ids of each distinct row are a "bag" of bag numbers, and ``F.embedding_bag`` over the bags'
gradient sums them (FBGEMM's kernel, as its CPU backward does). The work is a radix sort of each
table's ids and one pass over them, never a per-id copy of the gradient, and the result is
coalesced. A collection's tables are looked up one kernel each, over their rows of the group's
allocation (a table's ids neither shifted nor joined with others': the work of a forward is its
kernels), and their gradient is found table by table, so the sort's arrays are one table's, and a fused
optimizer's rows are summed and updated a slice at a time: the step's peak holds the batch's
rows and the bags' gradient, little else.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from .._threads import run_all
from ._autograd import SlabSplit, reading
from ._distinct import segment_sum, segments, sparse_rows
from ._kernels import bag_parts

__all__ = ["Part", "pools_rows", "slab_bags", "sparse_bag", "sparse_bags"]


def _bag_of(offsets: torch.Tensor, first_bag: int, first_id: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The bag of each of the ids ``[first_id, stop)`` whose bags (numbered from ``first_bag``) start at
    ``offsets``, 32-bit where the numbers fit (half the memory of a per-id array); and each bag's length."""
    lengths = torch.diff(offsets, append=offsets.new_tensor([stop]))
    last = first_bag + offsets.numel()
    dtype = torch.int32 if last <= torch.iinfo(torch.int32).max else torch.int64
    numbers = torch.arange(first_bag, last, dtype=dtype, device=offsets.device)
    return torch.repeat_interleave(numbers, lengths, output_size=stop - first_id), lengths


class Part(NamedTuple):
    """One table's share of a lookup of several: the rows ``[start, stop)`` of the weight it owns, and the
    sink its gradient goes to in backward, ``sink(table rows, gradient rows)`` (a fused optimizer's
    update; None: the weight's ``.grad``). A sink with a ``bags(ids, offsets, bags' gradient)``
    method may take a sum bag's gradient whole, no sort and no sum here: it gives a job to run on any
    thread, or None (then it takes the rows).
    ``hold``: kept until the backward ran, then let go (a tier's
    token: the batch's rows stay in their slots until then)."""

    start: int
    stop: int
    sink: Callable[[torch.Tensor, torch.Tensor], None] | None = None
    hold: Any = None


# The rows a sink takes at once: their summed gradient and the optimizer's copy of them stay small
# (and in cache), whatever the batch; one call of a few kernels per 4096 rows of 64 floats.
SINK_BYTES = 1 << 20

Lists = Sequence[torch.Tensor | None]


def row_gradient(parts: Sequence[Part], rows: Lists, offsets: Lists, scale: Lists, grads: Lists, mode: str,
                 shape: tuple[int, int]) -> torch.Tensor | None:  # fmt: skip
    """The coalesced sparse gradient of the weight: for each distinct row, the sum over the bags holding it.

    Part by part (each with its ids, offsets, weights and bags' gradient), in the order given
    (ascending rows): one table's ids are sorted at a time, and a
    sink's rows are summed and handed to it a slice at a time (:data:`SINK_BYTES`), so neither all
    tables' nor one table's summed rows ever exist at once. None when the sinks took every row.
    """
    found = []
    grads = [g.contiguous() for g in grads]
    taken = _taken_whole(parts, rows, offsets, scale, grads, mode)
    for part, ids, offs, weights, grad, whole in zip(parts, rows, offsets, scale, grads, taken, strict=True):
        if whole or (ids.numel() == 0 and part.sink is not None):  # nothing (left) to hand over
            continue
        unique, starts, bag, weight = _part_rows(ids, offs, weights, mode, grad, part.stop - part.start)
        if part.sink is None:
            summed = segment_sum(grad, bag, starts, weights=weight)
            found.append((unique.to(torch.int64).add_(part.start), summed))
        else:
            _to_sink(part.sink, unique, starts, bag, weight, grad)
    if not found:  # the sinks took every row
        return None
    unique = torch.cat([u for u, _ in found]) if len(found) != 1 else found[0][0]
    summed = torch.cat([v for _, v in found]) if len(found) != 1 else found[0][1]
    return sparse_rows(unique, summed, shape[0], coalesced=True)


def _taken_whole(
    parts: Sequence[Part], rows: Lists, offsets: Lists, scale: Lists, grads: Lists, mode: str
) -> list[bool]:
    """Which parts' sinks took their sum bags' gradient whole (``bags``: one native pass each, the tables'
    passes run at once on the intra-op threads)."""
    jobs, taken = [], [False] * len(parts)
    for i, (part, ids, offs, weights, grad) in enumerate(zip(parts, rows, offsets, scale, grads, strict=True)):
        whole = getattr(part.sink, "bags", None)
        if whole is None or mode != "sum" or weights is not None or ids.numel() == 0:
            continue
        job = whole(ids, offs, grad)
        if job is not None:
            jobs.append(job)
            taken[i] = True
    run_all(jobs)
    return taken


def _to_sink(
    sink: Callable[[torch.Tensor, torch.Tensor], None],
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
        slice_weight = None if weight is None else weight[lo:hi]
        summed = segment_sum(grad, bag[lo:hi], starts[first : first + step] - lo, weights=slice_weight)
        sink(unique[first : first + step].to(torch.int64), summed)


def _part_rows(
    rows: torch.Tensor,
    offsets: torch.Tensor,
    scale: torch.Tensor | None,
    mode: str,
    grad: torch.Tensor,
    bound: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One part's ids ``rows`` (in ``[0, bound)``) as bags of bag numbers: (distinct rows, where each
    one's ids start, each sorted id's bag, its weight or None). Pooling the bags' gradient over them
    gives each distinct row's gradient."""
    n = rows.numel()
    bag, lengths = _bag_of(offsets, 0, 0, n)
    weight = scale
    if mode == "mean":
        share = lengths.clamp(min=1).to(grad.dtype).reciprocal_().repeat_interleave(lengths, output_size=n)
        weight = share if weight is None else share.mul_(weight)
    unique, order, starts = segments(rows, bound)
    bag = bag.index_select(0, order)  # each sorted id's bag (a gather: several times a binary search's speed)
    weight = None if weight is None else weight.index_select(0, order)
    return unique, starts.to(bag.dtype), bag, weight  # the kernel takes offsets of its ids' dtype


class _SparseBags(torch.autograd.Function):
    """``apply(weight, mode, parts, split, *rows, *offsets, *per_sample_weights, *params)``: each part's
    bags, a tuple. The weight's gradient goes to ``params`` (the tensors whose memory the weight is):
    ``split(gradient)`` gives theirs, in order (None: ``params`` is the weight itself)."""

    @classmethod
    def apply(cls, *args: Any) -> Any:  # type: ignore[override]
        # torch's ``apply`` binds the arguments to ``forward``'s signature (``inspect``, every call) to
        # fill in defaults; ``forward`` has none, so where no torch.func transform is active (which
        # needs that path) the call goes straight to autograd: a forward's worth of overhead saved.
        if torch._C._are_functorch_transforms_active():
            return super().apply(*args)
        return super(torch.autograd.Function, cls).apply(*torch._functorch.utils.unwrap_dead_wrappers(args))

    @staticmethod
    def forward(weight: torch.Tensor, mode: str, parts: Any, split: Any, *tensors: torch.Tensor | None) -> tuple:
        # The bag kernel alone (this Function computes the gradient); each part reads its table's rows.
        n = len(parts)
        return bag_parts(weight, parts, tensors[:n], tensors[n : 2 * n], tensors[2 * n :], mode)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
        weight, mode, parts, split, *tensors = inputs
        n = len(parts)
        ctx.learned = [ctx.needs_input_grad[4 + 2 * n + i] for i in range(n)]  # per-sample weights with a grad
        ctx.params = len(tensors) - 3 * n
        ctx.wanted = any(ctx.needs_input_grad[4 + 3 * n :])
        ctx.save_for_backward(*tensors[: 3 * n], weight if any(ctx.learned) else None)
        ctx.mode, ctx.shape, ctx.parts, ctx.split = mode, tuple(weight.shape), parts, split
        store = getattr(split, "store", None)  # a SlabSplit: the rows stay put until backward
        ctx.reading = reading(store) if store is not None else None

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple:
        *tensors, weight = ctx.saved_tensors
        n = len(ctx.parts)
        rows, offsets, scale = tensors[:n], tensors[n : 2 * n], tensors[2 * n :]
        learned: list[torch.Tensor | None] = [None] * n
        for i, part in enumerate(ctx.parts):  # learned per-sample weights (before any sink changes their rows)
            if ctx.learned[i]:
                bag, _ = _bag_of(offsets[i], 0, 0, rows[i].numel())
                table = weight[part.start : part.stop]
                learned[i] = (grads[i].index_select(0, bag) * table.index_select(0, rows[i])).sum(1)
        params: tuple = (None,) * ctx.params
        if ctx.wanted:
            grad = row_gradient(ctx.parts, rows, offsets, scale, grads, ctx.mode, ctx.shape)
            if grad is not None:  # None: the sinks took every row, as they take an unsharded table's
                params = (grad,) if ctx.split is None else tuple(ctx.split(grad))
        ctx.reading = None  # the store's rows may move again (see ``variables._autograd.reading``)
        ctx.parts = tuple(p._replace(hold=None) for p in ctx.parts)  # what the parts held goes (the sinks stay:
        # a graph kept for a second backward runs them again)
        return None, None, None, None, *([None] * (2 * n)), *learned, *params


def sparse_bags(
    weight: torch.Tensor,
    mode: str,
    parts: Sequence[Part],
    inputs: tuple[Lists, Lists, Lists],
    params: Sequence[torch.Tensor] | None = None,
    split: Callable[[torch.Tensor], Sequence[torch.Tensor | None]] | None = None,
) -> tuple[torch.Tensor, ...]:
    """For each part (table) ``i``, ``F.embedding_bag(rows[i], weight[start:stop], offsets[i], mode,
    sparse=True, per_sample_weights=scale[i])`` (sum or mean) of ``inputs = (rows, offsets, scale)``,
    with the weight's gradient summed per distinct row (see the module's docstring); the rows of
    ``parts`` (ascending, disjoint) with a sink go to it in backward, not to the gradient. ``rows``
    are rows of the part's table, valid (the CPU kernel refuses others; elsewhere they must be
    checked). The gradient goes to ``weight``, or, where the weight is the memory of ``params``, to
    them: ``split(gradient)`` gives each one's (one Function, not a view of them and a lookup)."""
    params = (weight,) if params is None else tuple(params)
    return _SparseBags.apply(weight, mode, tuple(parts), split, *inputs[0], *inputs[1], *inputs[2], *params)


def sparse_bag(
    rows: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor, mode: str, psw: torch.Tensor | None = None
) -> torch.Tensor:
    """One feature of :func:`sparse_bags` over the whole weight:
    ``F.embedding_bag(rows, weight, offsets, mode, sparse=True, per_sample_weights=psw)``."""
    return sparse_bags(weight, mode, [Part(0, weight.shape[0])], ([rows], [offsets], [psw]))[0]


def slab_bags(
    store: Any, ids: torch.Tensor, offsets: torch.Tensor | None, mode: str, weights: torch.Tensor | None
) -> torch.Tensor:
    """``F.embedding_bag(ids, table, offsets, mode, sparse=True, per_sample_weights=weights)`` (sum or
    mean) over a store's slab, its sparse gradient summed per distinct row (the module's docstring)
    and split into the shards' coalesced gradients: torch's own sparse gradient would be a row per
    id (a bag's gradient copied to each of its ids), which the split then sorts and sums again.
    ``ids`` are the table's rows, 1-D with ``offsets`` (bag starts) or 2-D (fixed-size bags)."""
    rows = ids if store.logical_slab else store.slab_rows(ids)
    if rows.dim() == 2:  # fixed-size bags: each row's starts
        offsets = torch.arange(rows.shape[0], dtype=rows.dtype, device=rows.device) * rows.shape[1]
        rows, weights = rows.reshape(-1), None if weights is None else weights.reshape(-1)
    slab = store.full_slab
    part = Part(0, slab.shape[0])
    shards = tuple(store.local_shards().values())
    return sparse_bags(slab, mode, [part], ([rows], [offsets], [weights]), shards, SlabSplit(store))[0]


def pools_rows(mode: str, scale_grad_by_freq: bool, padding_idx: Any, max_norm: Any, last: bool) -> bool:
    """Whether the sparse product computes a bag with these options: sum or mean, none of the options it
    leaves out (a padding row, max_norm, scale_grad_by_freq, include_last_offset: torch's op then)."""
    return not (mode == "max" or scale_grad_by_freq or padding_idx is not None or max_norm is not None or last)


def sums_rows(store: Any, mode: str, scale_grad_by_freq: bool, padding_idx: Any, max_norm: Any, last: bool) -> bool:
    """Whether :func:`slab_bags` computes a sparse bag of this local store: a sum or mean bag over a
    slab on the CPU whose shards want a gradient, with none of the options the product leaves out
    (a padding row, max_norm, scale_grad_by_freq, include_last_offset: torch's op then)."""
    if not pools_rows(mode, scale_grad_by_freq, padding_idx, max_norm, last):
        return False
    slab = store.full_slab
    if slab is None or slab.device.type != "cpu" or not torch.is_grad_enabled():
        return False
    return any(s.requires_grad for s in store.local_shards().values())
