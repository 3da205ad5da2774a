"""PartitionerConfig: list <-> string, validation, and driving a layout."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shardvar import (
    FixedShardsPartitioner,
    Layout,
    PartitionerConfig,
    ShardvarTypeError,
    ShardvarValueError,
    fixed_size_partitioner,
)


def test_list_and_string_forms() -> None:
    c = PartitionerConfig([1, 4, 1])
    assert (c.partition_list, c.partition_str, c.num_shards, c.axis) == ([1, 4, 1], "1,4,1", 4, 1)
    assert PartitionerConfig(partition_str=" 1 , 4,1 ") == c
    assert PartitionerConfig([1, 4, 1], "1,4,1") == c
    assert PartitionerConfig(partition_str="1,1").axis == 0
    assert PartitionerConfig([1, 1]).num_shards == 1
    assert PartitionerConfig(partition_str="3").partition_list == [3]
    assert repr(c) == "PartitionerConfig(partition_list=[1, 4, 1])" and str(c) == "1,4,1"
    assert hash(c) == hash(PartitionerConfig(partition_str="1,4,1"))


@given(st.integers(1, 6), st.integers(0, 5), st.integers(1, 50))
def test_round_trip(ndim, axis, shards) -> None:
    axis = axis % ndim
    lst = [1] * ndim
    lst[axis] = shards
    c = PartitionerConfig(lst)
    assert PartitionerConfig(partition_str=c.partition_str) == c
    assert c.num_shards == shards
    assert c.axis == (axis if shards > 1 else 0)


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        ({}, ShardvarValueError, "got neither"),
        ({"partition_list": []}, ShardvarValueError, "must not be empty"),
        ({"partition_list": [1, 0, 1]}, ShardvarValueError, "entries must be >= 1; got 0"),
        ({"partition_list": [1, -4]}, ShardvarValueError, "entries must be >= 1; got -4"),
        ({"partition_list": [2, 4]}, ShardvarValueError, r"at most one entry > 1.*\[2, 4\]"),
        ({"partition_list": [1, 2.5]}, ShardvarValueError, "integers; got 2.5"),
        ({"partition_list": [True, 2]}, ShardvarValueError, "integers; got True"),
        ({"partition_list": "1,4"}, ShardvarTypeError, "partition_list must be a list"),
        ({"partition_str": ""}, ShardvarValueError, "malformed partition_str ''"),
        ({"partition_str": "1,,4"}, ShardvarValueError, "malformed partition_str '1,,4': entry ''"),
        ({"partition_str": "1,a"}, ShardvarValueError, "entry 'a' is not an integer"),
        ({"partition_str": "1;4"}, ShardvarValueError, "entry '1;4'"),
        ({"partition_str": "1,-2"}, ShardvarValueError, ">= 1; got -2"),
        ({"partition_str": "0"}, ShardvarValueError, ">= 1; got 0"),
        ({"partition_str": [1, 2]}, ShardvarTypeError, "partition_str must be a str"),
        ({"partition_list": [1, 4], "partition_str": "4,1"}, ShardvarValueError, "disagree"),
    ],
)
def test_invalid_configs(kwargs, exc, match) -> None:
    with pytest.raises(exc, match=match):
        PartitionerConfig(**kwargs)


def test_partitioner_output_converts_and_drives_a_layout() -> None:
    c = PartitionerConfig.from_partitioner(FixedShardsPartitioner(4), (3, 10), "float32", axis=1)
    assert c == PartitionerConfig(partition_str="1,4")
    assert PartitionerConfig.from_partitioner(fixed_size_partitioner(4), (10, 3)) == PartitionerConfig([4, 1])
    assert PartitionerConfig(FixedShardsPartitioner(4)((3, 10), "float32", 1)) == c
    assert c.layout((3, 10)) == Layout("div", (3, 3, 2, 2), axis=1)
    assert c.layout((3, 10), "mod") == Layout("mod", (3, 3, 2, 2), axis=1)
    with pytest.raises(ShardvarValueError, match="has 2 entries but shape \\[10\\] has 1"):
        c.layout((10,))
    with pytest.raises(ShardvarValueError, match="into 4 shards; at most 3"):
        c.layout((3, 3))
