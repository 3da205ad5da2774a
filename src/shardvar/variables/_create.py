"""Building ShardedVariables: shards allocated as consecutive pieces of one slab per device."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .._deprecation import renamed
from .._errors import ShardvarTypeError, ShardvarValueError
from .._pages import empty
from .._validate import check_bool
from ..layout import Layout
from ..partitioners import PartitionerConfig, check_shape
from ._sharded_variable import ShardedVariable
from ._store import ShardStore

__all__ = ["shard_tensor", "create_partitioned_variables", "to_layout"]

Initializer = torch.Tensor | float | int | Callable[[tuple[int, ...], torch.dtype], torch.Tensor]


@renamed(strategy="partition_strategy")
def to_layout(
    spec: Any, shape: Sequence[int], dtype: torch.dtype | str | None = None, partition_strategy: str = "div"
) -> Layout:
    """A Layout from a Layout, a shard count, a PartitionerConfig, its string form or a partitioner."""
    from ..partitioners import AxisPartitioner, Partitioner

    shape = check_shape(shape)
    if isinstance(spec, Layout):
        spec.check_shape(shape)
        return spec
    if isinstance(spec, bool):
        raise ShardvarTypeError(f"expected a shard count, partitioner, PartitionerConfig or Layout; got {spec!r}")
    if isinstance(spec, int):
        if spec < 1:
            raise ShardvarValueError(f"the number of shards must be >= 1; got {spec}")
        return Layout.from_partitions(shape, [min(spec, max(shape[0], 1))] + [1] * (len(shape) - 1), partition_strategy)
    if isinstance(spec, str):
        spec = PartitionerConfig(partition_str=spec)
    if isinstance(spec, PartitionerConfig):
        return spec.layout(shape, partition_strategy)
    if isinstance(spec, (Partitioner, AxisPartitioner)):
        return spec.layout(shape, dtype if dtype is not None else torch.float32, partition_strategy=partition_strategy)
    raise ShardvarTypeError(
        f"expected a shard count, partitioner, PartitionerConfig, partition string or Layout; got {spec!r:.100}"
    )


def shard_tensor(
    tensor: torch.Tensor,
    layout: Layout,
    *,
    devices: Sequence[torch.device | str] | None = None,
    requires_grad: bool = False,
    name: str | None = None,
) -> ShardedVariable:
    """Copy ``tensor`` into shards laid out by ``layout`` (one slab per device when split along axis 0).

    Shards on the same device are consecutive pieces of one allocation, which lets lookups and
    scatter updates run as a single kernel over the whole table.

    >>> shard_tensor(torch.arange(10.), Layout.mod(10, 3)).variables[1]
    tensor([1., 4., 7.])
    """
    if not isinstance(tensor, torch.Tensor):
        raise ShardvarTypeError(f"shard_tensor needs a tensor; got {type(tensor).__name__}")
    if not isinstance(layout, Layout):
        raise ShardvarTypeError(f"shard_tensor needs a Layout (e.g. Layout.div(rows, n)); got {layout!r:.60}")
    layout.check_shape(tensor.shape)
    store = ShardStore.allocate(
        layout, tensor.shape, tensor.dtype, devices=devices, values=tensor.detach(), requires_grad=requires_grad
    )
    return ShardedVariable.from_store(store, name=name)


def _fills_in_place(initializer: Callable) -> bool:
    """PyTorch's convention (``nn.init.normal_``: fill the tensor given) rather than ``(shape, dtype)``.

    torch.nn.init's functions (also inside functools.partial) fill in place; any other callable
    that takes two positional arguments follows the reference's ``(shape, dtype)``; one that takes
    only one fills the tensor it is given.
    """
    func = getattr(initializer, "func", initializer)  # functools.partial(nn.init.normal_, std=0.02)
    if getattr(func, "__module__", None) == "torch.nn.init":
        return True
    try:
        params = list(inspect.signature(initializer).parameters.values())
    except (TypeError, ValueError):
        return False
    if any(p.kind == p.VAR_POSITIONAL for p in params):
        return False
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) == 1


def _as_initial(value: Any, shape: tuple[int, ...], dtype: torch.dtype | None, what: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        try:
            value = torch.as_tensor(value, dtype=dtype)  # nested lists, numpy arrays, as the reference accepts
        except (TypeError, ValueError, RuntimeError):
            raise ShardvarValueError(
                f"{what} returned {type(value).__name__}; expected a tensor of shape {list(shape)}"
            ) from None
    if tuple(value.shape) != shape:
        raise ShardvarValueError(f"{what} returned shape {list(value.shape)}; expected a tensor of shape {list(shape)}")
    return value if dtype is None else value.to(dtype)


def initial_value(initializer: Initializer, shape: tuple[int, ...], dtype: torch.dtype | None) -> torch.Tensor:
    """The logical initial value: drawn once for the whole shape, so it never depends on the slicing.

    ``initializer`` is a tensor (its dtype unless ``dtype`` is given), a number, an in-place
    PyTorch initializer (``nn.init.normal_``: fills the tensor it is given), or a callable
    ``(shape, dtype) -> tensor`` (or nested lists), as the reference's initializers are.
    """
    if isinstance(initializer, torch.Tensor):
        if tuple(initializer.shape) != shape:
            raise ShardvarValueError(f"initializer tensor has shape {list(initializer.shape)}; expected {list(shape)}")
        return initializer.detach() if dtype is None else initializer.detach().to(dtype)
    dtype = dtype or torch.float32
    if isinstance(initializer, (int, float)) and not isinstance(initializer, bool):
        return empty(shape, dtype=dtype).fill_(initializer)
    if callable(initializer):
        if _fills_in_place(initializer):
            out = empty(shape, dtype=dtype)
            with torch.no_grad():
                result = initializer(out)
            return _as_initial(out if result is None else result, shape, dtype, "initializer")
        return _as_initial(initializer(shape, dtype), shape, dtype, "initializer")
    raise ShardvarTypeError(
        "initializer must be a tensor, a number, an in-place initializer such as nn.init.normal_, or a callable "
        f"(shape, dtype) -> tensor; got {initializer!r:.80}"
    )


def create_partitioned_variables(
    shape: Sequence[int],
    slicing: Sequence[int],
    initializer: Initializer,
    dtype: torch.dtype | None = None,
    trainable: bool | None = None,
    name: str | None = None,
    partition_strategy: str = "div",
) -> ShardedVariable:
    """A ShardedVariable of ``shape`` split by ``slicing`` (slices per axis, e.g. ``[4, 1]``).

    Uneven splits give the first shards one extra row, as the reference does. Unlike the
    reference, a random initializer is drawn once for the whole logical shape, so logical row r
    has the same value whatever the slicing. ``dtype`` defaults to the initializer tensor's, else
    float32; ``trainable`` defaults to whether the dtype can carry gradients (integers cannot).

    >>> v = create_partitioned_variables([5, 2], [2, 1], torch.arange(10.).reshape(5, 2))
    >>> [list(s.shape) for s in v.variables]
    [[3, 2], [2, 2]]
    >>> torch.manual_seed(0) and None
    >>> create_partitioned_variables([4, 3], [2, 1], torch.nn.init.xavier_uniform_).shape
    torch.Size([4, 3])
    """
    shape = check_shape(shape)
    slicing = list(slicing)
    if len(slicing) != len(shape):
        raise ShardvarValueError(f"shape {list(shape)} and slicing {slicing} must have the same length")
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise ShardvarTypeError(f"dtype must be a torch.dtype; got {dtype!r:.60}")
    layout = PartitionerConfig(slicing).layout(shape, partition_strategy)
    value = initial_value(initializer, shape, dtype)
    differentiable = value.dtype.is_floating_point or value.dtype.is_complex
    if trainable is None:
        trainable = differentiable
    elif check_bool(trainable, "trainable") and not differentiable:
        raise ShardvarTypeError(
            f"a {value.dtype} variable cannot be trainable; pass trainable=False (integers carry no gradients)"
        )
    return shard_tensor(value, layout, requires_grad=trainable, name=name)
