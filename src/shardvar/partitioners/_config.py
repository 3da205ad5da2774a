"""AutoDist's PartitionerConfig: a partition list such as [1, 4, 1] and its string "1,4,1"."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

import torch

from .._deprecation import renamed
from .._errors import ShardvarTypeError, ShardvarValueError
from .._validate import check_int_sequence
from ..layout import Layout
from ._partitioners import AxisPartitioner, Partitioner, check_shape

__all__ = ["PartitionerConfig"]

_ENTRY = re.compile(r"^[+-]?\d+$")


def _parse(partition_str: object) -> tuple[int, ...]:
    if not isinstance(partition_str, str):
        raise ShardvarTypeError(f"partition_str must be a str such as '1,4,1'; got {partition_str!r}")
    entries = [e.strip() for e in partition_str.split(",")]
    for e in entries:
        if not _ENTRY.match(e):
            raise ShardvarValueError(
                f"malformed partition_str {partition_str!r}: entry {e!r} is not an integer; expected e.g. '1,4,1'"
            )
    return tuple(int(e) for e in entries)


def _check_list(partition_list: object, source: str) -> tuple[int, ...]:
    if isinstance(partition_list, (str, bytes)) or not isinstance(partition_list, (Sequence, torch.Size)):
        raise ShardvarTypeError(f"partition_list must be a list of ints such as [1, 4, 1]; got {partition_list!r}")
    if not len(partition_list):
        raise ShardvarValueError(f"{source} must not be empty; got {partition_list!r}")
    values = check_int_sequence(partition_list, f"{source} entries", 1)
    if sum(v > 1 for v in values) > 1:
        raise ShardvarValueError(f"{source} may have at most one entry > 1 (one partitioned axis); got {list(values)}")
    return tuple(values)


class PartitionerConfig:
    """How many shards each axis of a variable gets, in list or string form.

    >>> c = PartitionerConfig(partition_str="1, 4, 1")
    >>> c.partition_list, c.partition_str, c.num_shards, c.axis
    ([1, 4, 1], '1,4,1', 4, 1)
    """

    __slots__ = ("_partitions",)

    def __init__(self, partition_list: Sequence[int] | None = None, partition_str: str | None = None) -> None:
        if partition_list is None and partition_str is None:
            raise ShardvarValueError(
                "give partition_list (e.g. [1, 4, 1]) or partition_str (e.g. '1,4,1'); got neither"
            )
        from_list = None if partition_list is None else _check_list(partition_list, "partition_list")
        from_str = None if partition_str is None else _check_list(_parse(partition_str), "partition_str")
        if from_list is not None and from_str is not None and from_list != from_str:
            raise ShardvarValueError(
                f"partition_list {list(from_list)} and partition_str {partition_str!r} disagree; "
                "give one, or both equal"
            )
        self._partitions: tuple[int, ...] = from_list if from_list is not None else from_str  # type: ignore[assignment]

    @classmethod
    def from_partitioner(
        cls,
        partitioner: Partitioner | AxisPartitioner,
        shape: Sequence[int],
        dtype: torch.dtype | str | None = None,
        axis: int = 0,
    ) -> PartitionerConfig:
        """The config a partitioner's output gives for a variable of ``shape`` and ``dtype``."""
        if isinstance(partitioner, AxisPartitioner):
            return cls(partitioner(shape, dtype))
        return cls(partitioner(shape, dtype, axis))

    @property
    def partition_list(self) -> list[int]:
        return list(self._partitions)

    @property
    def partition_str(self) -> str:
        return ",".join(map(str, self._partitions))

    @property
    def num_shards(self) -> int:
        return math.prod(self._partitions)

    @property
    def axis(self) -> int:
        """The one axis with more than one shard; 0 when no axis is split."""
        return next((i for i, p in enumerate(self._partitions) if p > 1), 0)

    @renamed(strategy="partition_strategy")
    def layout(self, shape: Sequence[int], partition_strategy: str = "div") -> Layout:
        """The :class:`Layout` this config gives a variable of ``shape``.

        >>> PartitionerConfig(partition_str="1,4").layout((3, 10))
        Layout(strategy='div', sizes=(3, 3, 2, 2), axis=1)
        """
        shape = check_shape(shape)
        if len(shape) != len(self._partitions):
            raise ShardvarValueError(
                f"partition list {self.partition_list} has {len(self._partitions)} entries but shape {list(shape)} "
                f"has {len(shape)} dimensions"
            )
        return Layout.from_partitions(shape, self._partitions, partition_strategy)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PartitionerConfig) and other._partitions == self._partitions

    def __hash__(self) -> int:
        return hash(self._partitions)

    def __repr__(self) -> str:
        return f"PartitionerConfig(partition_list={self.partition_list})"

    def __str__(self) -> str:
        return self.partition_str
