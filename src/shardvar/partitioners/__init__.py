"""Partitioners (how many shards) and PartitionerConfig (the "1,4,1" form)."""

from ._config import PartitionerConfig
from ._dtypes import element_size, resolve_dtype
from ._partitioners import (
    AxisPartitioner,
    FixedShardsPartitioner,
    MaxSizePartitioner,
    MinSizePartitioner,
    Partitioner,
    check_shape,
    fixed_size_partitioner,
    min_max_variable_partitioner,
    variable_axis_size_partitioner,
)

__all__ = [
    "AxisPartitioner",
    "FixedShardsPartitioner",
    "MaxSizePartitioner",
    "MinSizePartitioner",
    "Partitioner",
    "PartitionerConfig",
    "check_shape",
    "element_size",
    "fixed_size_partitioner",
    "min_max_variable_partitioner",
    "resolve_dtype",
    "variable_axis_size_partitioner",
]
