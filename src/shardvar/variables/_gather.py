"""``F.embedding`` whose output is huge-page backed: most of a large CPU lookup is its first touch.

torch allocates ``F.embedding``'s output itself, 4 KiB page by page unless the user turned on
``THP_MEM_ALLOC_ENABLE`` before torch's first allocation. A lookup that writes into a buffer from
:func:`shardvar._pages.empty` faults it in 2 MiB at a time instead, whatever that switch says.
:class:`HugePageGather` is that lookup: ``index_select`` into such a buffer forward (what
``F.embedding`` computes without ``max_norm``), and ``F.embedding``'s own backward
(its dense or sparse kernel, with ``padding_idx`` and ``scale_grad_by_freq``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from .._pages import advisable, empty

__all__ = ["FRESH_BYTES", "HugePageGather", "embedding", "select_rows"]

# glibc serves smaller buffers from its heap, reused and already faulted in, where the advice buys
# nothing and costs a syscall (measured 1.3-1.6x slower at 2-8 MiB); at and above its largest mmap
# threshold (32 MiB on 64-bit) every output is a fresh mapping, faulted page by page (0.33x at 64 MiB).
FRESH_BYTES = 32 << 20


def _fresh(nbytes: int, device: torch.device) -> bool:
    return nbytes >= FRESH_BYTES and advisable(nbytes, device)


def select_rows(weight: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """``weight.index_select(0, indices)`` for a 2-D weight, into a huge-page buffer where that pays."""
    nbytes = indices.numel() * weight.shape[1] * weight.element_size()
    if not _fresh(nbytes, weight.device):
        return weight.index_select(0, indices)
    out = empty((indices.numel(), weight.shape[1]), dtype=weight.dtype, device=weight.device)
    return torch.index_select(weight, 0, indices, out=out)


class HugePageGather(torch.autograd.Function):
    """``HugePageGather.apply(weight, indices, padding_idx, scale_grad_by_freq, sparse)``: rows of a 2-D weight."""

    @staticmethod
    def forward(weight: torch.Tensor, indices: torch.Tensor, padding_idx: Any, scale: bool, sparse: bool) -> Any:
        return select_rows(weight, indices)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
        weight, indices, padding_idx, scale, sparse = inputs
        ctx.save_for_backward(indices)
        ctx.rows, ctx.options, ctx.sparse = weight.shape[0], (-1 if padding_idx is None else padding_idx, scale), sparse

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        (indices,) = ctx.saved_tensors
        # The kernels F.embedding's own backward calls (aten.embedding_backward refuses sparse + scale).
        aten = torch.ops.aten
        backward = aten.embedding_sparse_backward if ctx.sparse else aten.embedding_dense_backward
        weight_grad = backward(grad, indices, ctx.rows, *ctx.options)
        return weight_grad, None, None, None, None


def _plain(t: torch.Tensor) -> bool:
    # Under torch.compile or a torch.func transform the op stays torch's own (traceable, batchable).
    return not torch._C._functorch.is_functorch_wrapped_tensor(t) and not torch.compiler.is_compiling()


def embedding(
    indices: torch.Tensor,
    weight: torch.Tensor,
    padding_idx: int | None,
    max_norm: float | None,
    norm_type: float,
    scale_grad_by_freq: bool,
    sparse: bool,
) -> torch.Tensor:
    """``F.embedding`` with these arguments; its output huge-page backed where that applies."""
    nbytes = indices.numel() * weight.shape[-1] * weight.element_size()
    if (
        max_norm is None
        and not (sparse and scale_grad_by_freq)  # torch refuses it in backward: keep its error
        and weight.dim() == 2
        and indices.dim() == 1
        and _fresh(nbytes, weight.device)
        and _plain(weight)
        and _plain(indices)
    ):
        return HugePageGather.apply(weight, indices, padding_idx, scale_grad_by_freq, sparse)
    return F.embedding(indices, weight, padding_idx, max_norm, norm_type, scale_grad_by_freq, sparse)
