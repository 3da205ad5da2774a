"""How a ShardedVariable acts as its logical tensor to torch functions (``__torch_function__``).

Handlers live in one table, :data:`HANDLERS`, keyed by the torch function, in the order tried:

1. ``out=`` a ShardedVariable, and in-place functions (``torch.clamp_``, ``Tensor.add_``,
   ``nn.init.normal_``...): the result is computed, checked, then written through to every shard
   (all of them or none); random ones run on the logical tensor, so values equal the unsharded
   twin's for the same seed.
2. Shard-local ops: elementwise ops run shard by shard (the result is joined once); reductions
   (sum, mean, amax, amin, norm) combine per-shard partials; ``x @ v`` and ``v @ x`` multiply
   shard by shard, never building the whole table.
3. Anything else materialises the table with a warning, once per op, that names ``to_tensor()``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch

from .._errors import ShardvarTypeError, ShardvarValueError
from ..layout import Layout
from ._spread import local
from ._store import ShardStore
from ._update import assign
from ._values import as_value, check_local, check_range, materialise

__all__ = ["HANDLERS", "ShardvarMaterializeWarning", "torch_function", "is_sharded", "inplace"]

HANDLERS: dict[Callable, Callable[[Callable, tuple, dict], Any]] = {}
_WARNED: set[str] = set()


class ShardvarMaterializeWarning(UserWarning):
    """A torch function with no shard-local form built the whole table for one call."""


def is_sharded(obj: Any) -> bool:
    return isinstance(getattr(obj, "_store", None), ShardStore) and hasattr(obj, "to_tensor")


def _store(obj: Any) -> ShardStore:
    return obj.store


def _materialise(obj: Any) -> Any:
    if is_sharded(obj):
        return materialise(_store(obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_materialise(o) for o in obj)
    if isinstance(obj, dict):
        return {k: _materialise(v) for k, v in obj.items()}
    return obj


def _name(func: Callable) -> str:
    return getattr(func, "__qualname__", None) or getattr(func, "__name__", repr(func))


def implements(*funcs: Callable) -> Callable:
    def register(handler: Callable) -> Callable:
        for f in funcs:
            HANDLERS[f] = handler
        return handler

    return register


_TARGET_KEYWORDS = ("tensor", "input", "self")


def _inplace_target(args: tuple, kwargs: dict) -> tuple[Any, str | None]:
    """The variable an in-place call writes: its first argument (or ``tensor=``, as nn.init passes it)."""
    if args and is_sharded(args[0]):
        return args[0], None
    for key in _TARGET_KEYWORDS:
        if is_sharded(kwargs.get(key)):
            return kwargs[key], key
    return None, None


def inplace(func: Callable, args: tuple, kwargs: dict) -> Any:
    """Run in-place ``func`` on the variable's logical value, then write the result through.

    The variable is untouched until the whole result exists and is checked; then every shard is
    written. Random fills draw in logical order, as they would on the unsharded tensor.
    """
    target, key = _inplace_target(args, kwargs)
    check_local(_store(target), _name(func))
    value = materialise(_store(target))  # a new tensor
    rest = _materialise({k: v for k, v in kwargs.items() if k != key})
    others = _materialise(args[1:])
    if getattr(func, "__name__", "") == "copy_" and others:
        check_range(as_value(others[0]), value.dtype)  # copy_ casts, but never wraps out-of-range ints
    try:
        with torch.no_grad():
            if key is None:
                func(value, *others, **rest)
            else:
                func(*_materialise(args), **{key: value}, **rest)
    except (RuntimeError, TypeError, ValueError, IndexError) as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ShardvarValueError(f"{_name(func)} failed on the variable ({first}); nothing was written") from e
    assign(_store(target), value)
    return target


def _write_out(func: Callable, args: tuple, kwargs: dict) -> Any:
    out = kwargs.pop("out")
    plain = not any(is_sharded(a) for a in (*args, *kwargs.values()))
    result = func(*args, **kwargs) if plain else torch_function(func, args, kwargs)
    assign(_store(out), result)
    return out


def _is_inplace(func: Callable) -> bool:
    name = getattr(func, "__name__", "")
    return (name.endswith("_") and not name.endswith("__")) or name in _AUGMENTED


_AUGMENTED = {"__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__", "__imod__", "__ipow__"}


def torch_function(func: Callable, args: tuple, kwargs: dict | None) -> Any:
    kwargs = dict(kwargs or {})
    if is_sharded(kwargs.get("out")):
        return _write_out(func, args, kwargs)
    if _is_inplace(func) and _inplace_target(args, kwargs)[0] is not None:
        return inplace(func, args, kwargs)
    handler = HANDLERS.get(func)
    if handler is not None:
        result = handler(func, args, kwargs)
        if result is not NotImplemented:
            return result
    name = _name(func)
    if name not in _WARNED:
        _WARNED.add(name)
        warnings.warn(
            f"{name} has no shard-local form: it builds the whole ShardedVariable as one tensor; call "
            "to_tensor() once and reuse the result to make that explicit",
            ShardvarMaterializeWarning,
            stacklevel=3,
        )
    return func(*_materialise(args), **_materialise(kwargs))


# -- elementwise -----------------------------------------------------------------------------------


def _shard_args(args: tuple, layout: Layout, out_ndim: int, s: int, sharded_ndim: int) -> list[Any]:
    """Shard ``s``'s part of each argument, aligned by broadcasting against the output."""
    out_axis = layout.axis + out_ndim - sharded_ndim
    parts = []
    for a in args:
        if is_sharded(a):
            parts.append(_store(a).local_shards()[s])
            continue
        if isinstance(a, torch.Tensor):
            d = out_axis - (out_ndim - a.dim())
            if d >= 0 and a.shape[d] == layout.num_rows and layout.num_rows != 1:
                a = Layout(layout.strategy, layout.sizes, d).split(a)[s]
        parts.append(a)
    return parts


def _elementwise(func: Callable, args: tuple, kwargs: dict) -> Any:
    sharded = [a for a in args if is_sharded(a)]
    stores = [_store(a) for a in sharded]
    if not stores:
        return NotImplemented
    layout = stores[0].layout
    if any(st.layout != layout or not local(st) for st in stores) or len(args) > 3:
        return NotImplemented
    shapes = [st.shape for st in stores] + [a.shape for a in args if isinstance(a, torch.Tensor)]
    try:
        out_shape = torch.broadcast_shapes(*shapes)
    except RuntimeError:
        return NotImplemented
    out_ndim, sharded_ndim = len(out_shape), len(stores[0].shape)
    if out_shape[layout.axis + out_ndim - sharded_ndim] != layout.num_rows:
        return NotImplemented
    parts = [func(*_shard_args(args, layout, out_ndim, s, sharded_ndim), **kwargs) for s in range(layout.num_shards)]
    return Layout(layout.strategy, layout.sizes, layout.axis + out_ndim - sharded_ndim).join(parts)


_ELEMENTWISE = [
    "add", "sub", "mul", "div", "true_divide", "floor_divide", "remainder", "fmod", "pow", "neg", "abs", "exp",
    "expm1", "log", "log1p", "log2", "sqrt", "rsqrt", "square", "reciprocal", "sin", "cos", "tanh", "sigmoid",
    "relu", "clamp", "clip", "sign", "round", "floor", "ceil", "trunc", "maximum", "minimum", "eq", "ne", "lt",
    "le", "gt", "ge", "logical_and", "logical_or", "logical_not", "logical_xor", "isnan", "isinf", "isfinite",
    "bitwise_and", "bitwise_or", "bitwise_xor", "bitwise_not", "nan_to_num", "erf", "where", "erfinv",
]  # fmt: skip
_OPERATORS = [
    "__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__truediv__", "__rtruediv__",
    "__floordiv__", "__rfloordiv__", "__mod__", "__rmod__", "__pow__", "__rpow__", "__neg__", "__pos__", "__abs__",
    "__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__", "__and__", "__rand__", "__or__", "__ror__",
    "__xor__", "__rxor__", "__invert__",
]  # fmt: skip
implements(
    *(getattr(torch, n) for n in _ELEMENTWISE if hasattr(torch, n)),
    *(getattr(torch.Tensor, n) for n in _ELEMENTWISE + _OPERATORS if hasattr(torch.Tensor, n)),
    torch.nn.functional.relu,
    torch.nn.functional.sigmoid,
    torch.nn.functional.tanh,
)(_elementwise)


def reject_distributed(obj: Any, what: str) -> None:
    if is_sharded(obj) and not local(_store(obj)):
        raise ShardvarTypeError(f"{what} is not supported on a distributed variable; use lookups or local_shards()")
