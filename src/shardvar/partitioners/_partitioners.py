"""Partitioners: how many shards a variable of a given shape and dtype gets.

Semantics follow TensorFlow's ``tf.distribute.experimental.partitioners`` and the legacy
``tf.compat.v1`` function forms exactly (checked by the conformance suite), with two
deliberate differences: arguments the reference silently accepts but cannot use (a shard count
of 0 or less, a ``min_slice_size`` of 0) are refused, and an axis of size 0 gets one (empty)
shard instead of zero shards or a ZeroDivisionError.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .._deprecation import renamed
from .._validate import check_int, check_shape, normalise_axis
from ..layout import Layout
from ._dtypes import element_size

__all__ = [
    "Partitioner",
    "FixedShardsPartitioner",
    "MinSizePartitioner",
    "MaxSizePartitioner",
    "fixed_size_partitioner",
    "min_max_variable_partitioner",
    "variable_axis_size_partitioner",
]

ShapeLike = Sequence[int] | torch.Size


def _positive_int(value: object, name: str, allow_none: bool = False) -> int | None:
    if value is None and allow_none:
        return None
    return check_int(value, f"argument `{name}`", minimum=1, expected="positive")


def _one_axis(shape: tuple[int, ...], axis: int, shards: int) -> list[int]:
    result = [1] * len(shape)
    result[axis] = max(1, shards)
    return result


class Partitioner:
    """Base class: ``p(shape, dtype, axis=0)`` returns the number of shards per axis."""

    def __call__(self, shape: ShapeLike, dtype: torch.dtype | str | None = None, axis: int = 0) -> list[int]:
        shape = check_shape(shape)
        return self._partition(shape, dtype, normalise_axis(axis, len(shape)))

    def _partition(self, shape: tuple[int, ...], dtype: object, axis: int) -> list[int]:
        raise NotImplementedError

    @renamed(strategy="partition_strategy")
    def layout(
        self, shape: ShapeLike, dtype: torch.dtype | str | None = None, axis: int = 0, partition_strategy: str = "div"
    ) -> Layout:
        """The :class:`Layout` this partitioner gives a variable of ``shape`` and ``dtype``.

        >>> FixedShardsPartitioner(4).layout((10, 3), "float32")
        Layout(strategy='div', sizes=(3, 3, 2, 2), axis=0)
        """
        shape = check_shape(shape)
        return Layout.from_partitions(shape, self(shape, dtype, axis), partition_strategy)


@dataclass(frozen=True)
class FixedShardsPartitioner(Partitioner):
    """A fixed number of shards (fewer when the axis has fewer rows).

    >>> FixedShardsPartitioner(num_shards=2)((10, 3), "float32")
    [2, 1]
    """

    num_shards: int

    def __post_init__(self) -> None:
        _positive_int(self.num_shards, "num_shards")

    def _partition(self, shape: tuple[int, ...], dtype: object, axis: int) -> list[int]:
        return _one_axis(shape, axis, min(self.num_shards, shape[axis]))


@dataclass(frozen=True)
class MinSizePartitioner(Partitioner):
    """Each shard at least ``min_shard_bytes``, as many shards as that allows, up to ``max_shards``.

    >>> MinSizePartitioner(min_shard_bytes=4, max_shards=2)((6, 1), "float32")
    [2, 1]
    """

    min_shard_bytes: int = 256 << 10
    max_shards: int = 1
    bytes_per_string: int = 16

    def __post_init__(self) -> None:
        _positive_int(self.min_shard_bytes, "min_shard_bytes")
        _positive_int(self.max_shards, "max_shards")
        _positive_int(self.bytes_per_string, "bytes_per_string")

    def _partition(self, shape: tuple[int, ...], dtype: object, axis: int) -> list[int]:
        total_bytes = math.prod(shape) * element_size(dtype, self.bytes_per_string)
        wanted = -(-total_bytes // self.min_shard_bytes)
        return _one_axis(shape, axis, min(shape[axis], self.max_shards, wanted))


@dataclass(frozen=True)
class MaxSizePartitioner(Partitioner):
    """Each shard at most ``max_shard_bytes`` (whole slices only), as few shards as possible.

    ``max_shards``, when given, takes precedence over the byte limit.

    >>> MaxSizePartitioner(max_shard_bytes=4)((6, 1), "float32")
    [6, 1]
    """

    max_shard_bytes: int
    max_shards: int | None = None
    bytes_per_string: int = 16

    def __post_init__(self) -> None:
        _positive_int(self.max_shard_bytes, "max_shard_bytes")
        _positive_int(self.max_shards, "max_shards", allow_none=True)
        _positive_int(self.bytes_per_string, "bytes_per_string")

    def _partition(self, shape: tuple[int, ...], dtype: object, axis: int) -> list[int]:
        rows = shape[axis]
        slice_bytes = math.prod(shape[:axis] + shape[axis + 1 :]) * element_size(dtype, self.bytes_per_string)
        slices_per_shard = max(1, self.max_shard_bytes // slice_bytes) if slice_bytes else max(rows, 1)
        shards = -(-rows // slices_per_shard)
        if self.max_shards is not None:
            shards = min(self.max_shards, shards)
        return _one_axis(shape, axis, shards)


@dataclass(frozen=True)
class AxisPartitioner:
    """A partitioner bound to an axis: the callable ``(shape, dtype) -> list[int]`` of the legacy forms."""

    partitioner: Partitioner
    axis: int = 0

    def __call__(self, shape: ShapeLike, dtype: torch.dtype | str | None = None) -> list[int]:
        return self.partitioner(shape, dtype, self.axis)

    @renamed(strategy="partition_strategy")
    def layout(
        self, shape: ShapeLike, dtype: torch.dtype | str | None = None, partition_strategy: str = "div"
    ) -> Layout:
        return self.partitioner.layout(shape, dtype, self.axis, partition_strategy)


def _check_axis_arg(axis: object) -> int:
    return check_int(axis, "argument `axis`")


def fixed_size_partitioner(num_shards: int, axis: int = 0) -> AxisPartitioner:
    """Legacy form of :class:`FixedShardsPartitioner`: returns ``(shape, dtype) -> list[int]``.

    >>> fixed_size_partitioner(3, axis=1)((6, 10), "float32")
    [1, 3]
    """
    return AxisPartitioner(FixedShardsPartitioner(num_shards), _check_axis_arg(axis))


def min_max_variable_partitioner(
    max_partitions: int = 1, axis: int = 0, min_slice_size: int = 256 << 10, bytes_per_string_element: int = 16
) -> AxisPartitioner:
    """Legacy form of :class:`MinSizePartitioner`: returns ``(shape, dtype) -> list[int]``.

    >>> min_max_variable_partitioner(max_partitions=16, min_slice_size=256 << 10)((1024, 1024), "float32")
    [16, 1]
    """
    inner = MinSizePartitioner(
        min_shard_bytes=_arg(min_slice_size, "min_slice_size"),
        max_shards=_arg(max_partitions, "max_partitions"),
        bytes_per_string=_arg(bytes_per_string_element, "bytes_per_string_element"),
    )
    return AxisPartitioner(inner, _check_axis_arg(axis))


def variable_axis_size_partitioner(
    max_shard_bytes: int, axis: int = 0, bytes_per_string_element: int = 16, max_shards: int | None = None
) -> AxisPartitioner:
    """Legacy form of :class:`MaxSizePartitioner`: returns ``(shape, dtype) -> list[int]``.

    >>> variable_axis_size_partitioner(max_shard_bytes=8)((10, 2), "float32")
    [10, 1]
    """
    inner = MaxSizePartitioner(
        max_shard_bytes=_arg(max_shard_bytes, "max_shard_bytes"),
        max_shards=_arg(max_shards, "max_shards", allow_none=True),
        bytes_per_string=_arg(bytes_per_string_element, "bytes_per_string_element"),
    )
    return AxisPartitioner(inner, _check_axis_arg(axis))


def _arg(value: object, name: str, allow_none: bool = False) -> int | None:
    # Validate under the legacy argument's own name, so the message names what the caller wrote.
    return _positive_int(value, name, allow_none)
