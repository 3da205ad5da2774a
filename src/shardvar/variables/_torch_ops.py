"""Shard-local reductions and matrix products for ``ShardedVariable.__torch_function__``.

A reduction runs on every shard and combines the partial results (sum of sums, max of maxes,
the p-norm of the shards' p-norms); a product ``x @ v`` or ``v @ x`` multiplies shard by shard
and sums or joins the pieces, so neither ever builds the whole table. Forms not handled here
return ``NotImplemented`` and fall back to materialising (with a warning).
"""

from __future__ import annotations

import functools
import math
import operator
from collections.abc import Callable
from typing import Any

import torch

from ..layout import Layout
from ._spread import local
from ._store import ShardStore
from ._torch_function import implements, is_sharded

__all__: list[str] = []

_NO_ARG = object()


def _parse(args: tuple, kwargs: dict, names: tuple[str, ...]) -> dict[str, Any] | None:
    """Positional ``args[1:]`` and ``kwargs`` by name, or None when they do not fit ``names``."""
    if len(args) - 1 > len(names) or any(k not in names for k in kwargs):
        return None
    out = dict(zip(names, args[1:], strict=False))
    if any(k in out for k in kwargs):
        return None
    return {**out, **kwargs}


def _dims(dim: Any, ndim: int) -> tuple[int, ...] | None:
    if dim is None or dim == ():
        return tuple(range(ndim))
    dims = (dim,) if isinstance(dim, int) else tuple(dim)
    if not all(isinstance(d, int) and -ndim <= d < ndim for d in dims):
        return None
    return tuple(sorted({d % ndim for d in dims}))


def _reduce(store: ShardStore, dims: tuple[int, ...], keepdim: bool, part: Callable, combine: Callable) -> Any:
    """``part(shard, dims, keepdim)`` per shard; joined along the sharded axis, or combined across it."""
    axis = store.layout.axis
    shards = [t for s, t in store.local_shards().items() if axis not in dims or store.layout.sizes[s]]
    partials = [part(t, dims, keepdim) for t in shards]
    if axis not in dims:
        out_axis = axis if keepdim else axis - sum(d < axis for d in dims)
        return Layout(store.layout.strategy, store.layout.sizes, out_axis).join(partials)
    return combine(torch.stack(partials))


def _complete(v: Any) -> ShardStore | None:
    store = v.store if is_sharded(v) else None
    return store if store is not None and local(store) and store.groups else None


def _sum_like(func: Callable, args: tuple, kwargs: dict) -> Any:
    store = _complete(args[0])
    opts = _parse(args, kwargs, ("dim", "keepdim", "dtype")) if store else None
    if opts is None or (dims := _dims(opts.get("dim"), len(store.shape))) is None:
        return NotImplemented
    keepdim, dtype = bool(opts.get("keepdim", False)), opts.get("dtype")
    mean = getattr(func, "__name__", "") == "mean"
    total = _reduce(
        store,
        dims,
        keepdim,
        lambda t, d, k: t.sum(dim=d, keepdim=k, dtype=dtype),
        lambda stacked: stacked.sum(0),
    )
    return total / math.prod(store.shape[d] for d in dims) if mean else total


def _extreme(func: Callable, args: tuple, kwargs: dict) -> Any:
    store = _complete(args[0])
    name = getattr(func, "__name__", "")
    if store is None or store.layout.num_rows == 0:
        return NotImplemented
    if name in ("max", "min"):
        if len(args) > 1 or kwargs:
            return NotImplemented  # max(dim) also returns indices: materialise
        opts = {}
    else:
        opts = _parse(args, kwargs, ("dim", "keepdim"))
    if opts is None or (dims := _dims(opts.get("dim"), len(store.shape))) is None:
        return NotImplemented
    op = torch.amax if name in ("max", "amax") else torch.amin
    return _reduce(
        store, dims, bool(opts.get("keepdim", False)), lambda t, d, k: op(t, dim=d, keepdim=k), lambda x: op(x, 0)
    )


def _combine_norms(p: float) -> Callable[[torch.Tensor], torch.Tensor]:
    if p == math.inf:
        return lambda x: x.amax(0)
    if p == -math.inf:
        return lambda x: x.amin(0)
    if p == 0:
        return lambda x: x.sum(0)
    return lambda x: x.pow(p).sum(0).pow(1 / p)


def _norm(func: Callable, args: tuple, kwargs: dict) -> Any:
    store = _complete(args[0])
    names = ("ord", "dim", "keepdim", "dtype") if func is torch.linalg.vector_norm else ("p", "dim", "keepdim", "dtype")
    opts = _parse(args, kwargs, names) if store else None
    if opts is None:
        return NotImplemented
    p = opts.get("ord", opts.get("p", 2))
    p = 2 if p == "fro" else p
    if not isinstance(p, (int, float)) or (dims := _dims(opts.get("dim"), len(store.shape))) is None:
        return NotImplemented
    dtype = opts.get("dtype")
    part = lambda t, d, k: torch.linalg.vector_norm(t, p, dim=d, keepdim=k, dtype=dtype)  # noqa: E731
    return _reduce(store, dims, bool(opts.get("keepdim", False)), part, _combine_norms(float(p)))


implements(torch.sum, torch.Tensor.sum, torch.mean, torch.Tensor.mean)(_sum_like)
implements(torch.amax, torch.Tensor.amax, torch.amin, torch.Tensor.amin)(_extreme)
implements(torch.max, torch.Tensor.max, torch.min, torch.Tensor.min)(_extreme)
implements(torch.norm, torch.Tensor.norm, torch.linalg.vector_norm)(_norm)


def _any_all(func: Callable, args: tuple, kwargs: dict) -> Any:
    store = _complete(args[0])
    if store is None or len(args) > 1 or kwargs:
        return NotImplemented
    name = getattr(func, "__name__", "")
    results = [getattr(t, name)() for t in store.local_shards().values()]
    return torch.stack(results).any() if name == "any" else torch.stack(results).all()


def _like(func: Callable, args: tuple, kwargs: dict) -> Any:
    # empty_like, zeros_like, randn_like...: the result depends on the shape, dtype and device only.
    if not args or not is_sharded(args[0]):
        return NotImplemented
    v = args[0]
    template = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    return func(template, *args[1:], **kwargs)


implements(torch.any, torch.Tensor.any, torch.all, torch.Tensor.all)(_any_all)
implements(
    torch.empty_like, torch.zeros_like, torch.ones_like, torch.full_like, torch.rand_like, torch.randn_like,
    torch.randint_like,
)(_like)  # fmt: skip


# -- matrix products -------------------------------------------------------------------------------


def _along(layout: Layout, axis: int) -> Layout:
    return Layout(layout.strategy, layout.sizes, axis)


def _x_at_v(x: torch.Tensor, store: ShardStore) -> torch.Tensor:
    shards = list(store.local_shards().values())
    if store.layout.axis == 0:  # the contracted dimension is sharded: sum the shards' products
        pieces = _along(store.layout, x.dim() - 1).split(x)
        return functools.reduce(operator.add, (p @ t for p, t in zip(pieces, shards, strict=True)))
    out_axis = max(x.dim() - 1, 0)
    return _along(store.layout, out_axis).join([x @ t for t in shards])


def _v_at_x(store: ShardStore, x: torch.Tensor) -> torch.Tensor:
    shards = list(store.local_shards().values())
    if store.layout.axis == 0:  # rows of the result are sharded: join the shards' products
        return store.layout.join([t @ x for t in shards])
    pieces = _along(store.layout, max(x.dim() - 2, 0)).split(x)
    return functools.reduce(operator.add, (t @ p for p, t in zip(pieces, shards, strict=True)))


def _matmul(func: Callable, args: tuple, kwargs: dict) -> Any:
    if kwargs or len(args) != 2:
        return NotImplemented
    a, b = args
    if func is torch.Tensor.__rmatmul__:
        a, b = b, a
    if is_sharded(b) and isinstance(a, torch.Tensor) and _matrix(b) and a.dim() >= 1 and a.shape[-1] == len(b):
        return _x_at_v(a, b.store)
    if is_sharded(a) and isinstance(b, torch.Tensor) and _matrix(a) and b.dim() >= 1:
        inner = b.shape[0 if b.dim() == 1 else -2]
        return _v_at_x(a.store, b) if inner == a.store.shape[1] else NotImplemented
    return NotImplemented


def _matrix(v: Any) -> bool:
    store = _complete(v)
    return store is not None and len(store.shape) == 2


implements(
    torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.Tensor.__rmatmul__, torch.mm, torch.Tensor.mm
)(_matmul)


def _linear(func: Callable, args: tuple, kwargs: dict) -> Any:
    """``F.linear(x, v, bias)``: each shard of ``v``'s rows gives its slice of the outputs (vocabulary-parallel)."""
    opts = _parse((None, *args), kwargs, ("input", "weight", "bias"))
    if (
        opts is None
        or not is_sharded(opts.get("weight"))
        or is_sharded(opts.get("input"))
        or not _matrix(opts["weight"])
    ):
        return NotImplemented
    x, store, bias = opts["input"], opts["weight"].store, opts.get("bias")
    if is_sharded(bias) or x.shape[-1] != store.shape[1]:
        return NotImplemented
    shards = list(store.local_shards().values())
    out_axis = x.dim() - 1
    if store.layout.axis == 0:
        out = _along(store.layout, out_axis).join([torch.nn.functional.linear(x, t) for t in shards])
    else:
        pieces = _along(store.layout, out_axis).split(x)
        out = functools.reduce(
            operator.add, (torch.nn.functional.linear(p, t) for p, t in zip(pieces, shards, strict=True))
        )
    return out if bias is None else out + bias


implements(torch.nn.functional.linear)(_linear)
