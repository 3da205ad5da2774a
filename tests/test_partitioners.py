"""Partitioners: documented behaviour, argument validation, and their layouts."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from shardvar import (
    FixedShardsPartitioner,
    Layout,
    MaxSizePartitioner,
    MinSizePartitioner,
    ShardvarTypeError,
    ShardvarValueError,
    fixed_size_partitioner,
    min_max_variable_partitioner,
    variable_axis_size_partitioner,
)


def test_reference_docstring_examples() -> None:
    assert FixedShardsPartitioner(2)((10, 3), torch.float32) == [2, 1]
    assert MinSizePartitioner(min_shard_bytes=4, max_shards=2)((6, 1), torch.float32) == [2, 1]
    assert MinSizePartitioner(min_shard_bytes=4, max_shards=10)((6, 1), torch.float32) == [6, 1]
    assert MaxSizePartitioner(max_shard_bytes=4)((6, 1), torch.float32) == [6, 1]
    assert MaxSizePartitioner(max_shard_bytes=4, max_shards=2)((6, 1), torch.float32) == [2, 1]
    assert MaxSizePartitioner(max_shard_bytes=1024)((6, 1), torch.float32) == [1, 1]
    assert min_max_variable_partitioner(max_partitions=16)((1024, 1024), "float32") == [16, 1]
    assert min_max_variable_partitioner(max_partitions=8)((1024, 1024), "float32") == [8, 1]


@pytest.mark.parametrize("shape", [(10, 3), [10, 3], torch.Size([10, 3])])
@pytest.mark.parametrize("dtype", [torch.float32, "float32", "torch.float32", "float"])
def test_shapes_and_dtypes_in_any_form(shape, dtype) -> None:
    assert MaxSizePartitioner(12)(shape, dtype) == [10, 1]


def test_string_dtype_uses_bytes_per_string() -> None:
    assert MaxSizePartitioner(16, bytes_per_string=4)((8, 2), "string") == [4, 1]
    assert variable_axis_size_partitioner(16, bytes_per_string_element=8)((8, 2), "string") == [8, 1]
    assert MinSizePartitioner(8, max_shards=100, bytes_per_string=2)((8,), "string") == [2]


def test_axis_argument_and_negative_axis() -> None:
    assert FixedShardsPartitioner(4)((3, 10), "float32", axis=1) == [1, 4]
    assert FixedShardsPartitioner(4)((3, 10), "float32", axis=-1) == [1, 4]
    assert fixed_size_partitioner(4, axis=1)((3, 10)) == [1, 4]


def test_zero_size_axis_gets_one_shard() -> None:
    assert FixedShardsPartitioner(4)((0, 3), "float32") == [1, 1]
    assert MaxSizePartitioner(4)((0, 3), "float32") == [1, 1]
    assert MaxSizePartitioner(4)((5, 0), "float32") == [1, 1]
    assert MinSizePartitioner(4, 8)((0, 3), "float32") == [1, 1]


@pytest.mark.parametrize(
    "call, exc, match",
    [
        (lambda: FixedShardsPartitioner(0), ShardvarValueError, "`num_shards` must be positive; got 0"),
        (lambda: FixedShardsPartitioner("4"), ShardvarTypeError, "`num_shards` must be an int; got '4'"),
        (
            lambda: MinSizePartitioner(min_shard_bytes=0),
            ShardvarValueError,
            "`min_shard_bytes` must be positive; got 0",
        ),
        (lambda: MinSizePartitioner(max_shards=0), ShardvarValueError, "`max_shards` must be positive; got 0"),
        (lambda: MinSizePartitioner(bytes_per_string=-2), ShardvarValueError, "`bytes_per_string` must be positive"),
        (lambda: MaxSizePartitioner(0), ShardvarValueError, "`max_shard_bytes` must be positive; got 0"),
        (lambda: MaxSizePartitioner(4, max_shards=-1), ShardvarValueError, "`max_shards` must be positive; got -1"),
        (lambda: MaxSizePartitioner(4, max_shards=0), ShardvarValueError, "`max_shards` must be positive; got 0"),
        (
            lambda: min_max_variable_partitioner(min_slice_size=0),
            ShardvarValueError,
            "`min_slice_size` must be positive",
        ),
        (
            lambda: min_max_variable_partitioner(max_partitions=0),
            ShardvarValueError,
            "`max_partitions` must be positive",
        ),
        (
            lambda: variable_axis_size_partitioner(8, bytes_per_string_element=0),
            ShardvarValueError,
            "`bytes_per_string_element`",
        ),
        (lambda: fixed_size_partitioner(2, axis=1.0), ShardvarTypeError, "`axis` must be an int"),
        (lambda: FixedShardsPartitioner(2)((4, 4), "float32", axis=2), ShardvarValueError, "axis 2 is out of range"),
        (lambda: fixed_size_partitioner(2, axis=3)((4, 4)), ShardvarValueError, "axis 3 is out of range"),
        (lambda: MaxSizePartitioner(4)((4, 4), "complex-ish"), ShardvarValueError, "unknown dtype name 'complex-ish'"),
        (lambda: MaxSizePartitioner(4)((4, 4), 3), ShardvarTypeError, "dtype must be a torch.dtype"),
        (lambda: FixedShardsPartitioner(2)((4, None), "float32"), ShardvarValueError, "fully defined"),
        (lambda: FixedShardsPartitioner(2)((4, -1), "float32"), ShardvarValueError, "must be >= 0; got -1"),
        (lambda: FixedShardsPartitioner(2)((), "float32"), ShardvarValueError, "0-d"),
        (lambda: FixedShardsPartitioner(2)("10,3", "float32"), ShardvarTypeError, "shape must be a tuple"),
    ],
)
def test_bad_arguments(call, exc, match) -> None:
    with pytest.raises(exc, match=match):
        call()


shapes = st.lists(st.integers(0, 50), min_size=1, max_size=3)


@given(shapes, st.integers(1, 12), st.integers(1, 2000), st.sampled_from(["float32", "int8", "float64", "string"]))
def test_every_partitioner_gives_a_valid_layout(shape, n, nbytes, dtype) -> None:
    for p in (FixedShardsPartitioner(n), MinSizePartitioner(nbytes, n), MaxSizePartitioner(nbytes, n)):
        for axis in range(len(shape)):
            partitions = p(shape, dtype, axis)
            assert len(partitions) == len(shape)
            assert all(k == 1 for i, k in enumerate(partitions) if i != axis)
            assert 1 <= partitions[axis] <= max(1, min(n, shape[axis]))
            layout = p.layout(shape, dtype, axis)
            assert layout.num_rows == shape[layout.axis]
            assert layout.num_shards == partitions[axis]
            if partitions[axis] > 1:
                assert layout.axis == axis


def test_layout_from_partitioner() -> None:
    assert FixedShardsPartitioner(4).layout((10, 3), "float32") == Layout("div", (3, 3, 2, 2))
    assert FixedShardsPartitioner(4).layout((10, 3), "float32", partition_strategy="mod") == Layout("mod", (3, 3, 2, 2))
    assert fixed_size_partitioner(2, axis=1).layout((10, 3)) == Layout("div", (2, 1), axis=1)


def test_partitioners_are_values() -> None:
    assert FixedShardsPartitioner(3) == FixedShardsPartitioner(3)
    assert eval(repr(MaxSizePartitioner(8, 2)), {"MaxSizePartitioner": MaxSizePartitioner}) == MaxSizePartitioner(8, 2)
    assert len({MinSizePartitioner(4), MinSizePartitioner(4)}) == 1
