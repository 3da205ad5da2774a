"""Building ShardedVariables: shards allocated as consecutive pieces of one slab per device."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from .._errors import ShardvarTypeError, ShardvarValueError
from ..layout import Layout
from ..partitioners import PartitionerConfig, check_shape
from ._sharded_variable import ShardedVariable
from ._store import ShardStore

__all__ = ["shard_tensor", "create_partitioned_variables", "to_layout"]

Initializer = torch.Tensor | float | int | Callable[[tuple[int, ...], torch.dtype], torch.Tensor]


def to_layout(spec: Any, shape: Sequence[int], dtype: torch.dtype | str | None = None, strategy: str = "div") -> Layout:
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
        return Layout.from_partitions(shape, [min(spec, max(shape[0], 1))] + [1] * (len(shape) - 1), strategy)
    if isinstance(spec, str):
        spec = PartitionerConfig(partition_str=spec)
    if isinstance(spec, PartitionerConfig):
        return spec.layout(shape, strategy)
    if isinstance(spec, (Partitioner, AxisPartitioner)):
        return spec.layout(shape, dtype if dtype is not None else torch.float32, strategy=strategy)
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


def initial_value(initializer: Initializer, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """The logical initial value: drawn once for the whole shape, so it never depends on the slicing."""
    if isinstance(initializer, torch.Tensor):
        if tuple(initializer.shape) != shape:
            raise ShardvarValueError(f"initializer tensor has shape {list(initializer.shape)}; expected {list(shape)}")
        return initializer.to(dtype)
    if isinstance(initializer, (int, float)) and not isinstance(initializer, bool):
        return torch.full(shape, initializer, dtype=dtype)
    if callable(initializer):
        value = initializer(shape, dtype)
        if not isinstance(value, torch.Tensor) or tuple(value.shape) != shape:
            got = list(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise ShardvarValueError(f"initializer returned {got}; expected a tensor of shape {list(shape)}")
        return value.to(dtype)
    raise ShardvarTypeError(
        f"initializer must be a tensor, a number, or a callable (shape, dtype) -> tensor; got {initializer!r:.80}"
    )


def create_partitioned_variables(
    shape: Sequence[int],
    slicing: Sequence[int],
    initializer: Initializer,
    dtype: torch.dtype = torch.float32,
    trainable: bool = True,
    name: str | None = None,
    partition_strategy: str = "div",
) -> ShardedVariable:
    """A ShardedVariable of ``shape`` split by ``slicing`` (slices per axis, e.g. ``[4, 1]``).

    Uneven splits give the first shards one extra row, as the reference does. Unlike the
    reference, a random initializer is drawn once for the whole logical shape, so logical row r
    has the same value whatever the slicing.

    >>> v = create_partitioned_variables([5, 2], [2, 1], torch.arange(10.).reshape(5, 2))
    >>> [list(s.shape) for s in v.variables]
    [[3, 2], [2, 2]]
    """
    shape = check_shape(shape)
    slicing = list(slicing)
    if len(slicing) != len(shape):
        raise ShardvarValueError(f"shape {list(shape)} and slicing {slicing} must have the same length")
    layout = PartitionerConfig(slicing).layout(shape, partition_strategy)
    value = initial_value(initializer, shape, dtype)
    return shard_tensor(value.detach(), layout, requires_grad=trainable, name=name)
