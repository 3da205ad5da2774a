"""Every recorded reference case in ../shared/conformance/partitioners.json."""

from __future__ import annotations

import pytest

import shardvar
from conftest import ERRORS, conformance_cases

FACTORIES = {
    "FixedShards": shardvar.FixedShardsPartitioner,
    "MinSize": shardvar.MinSizePartitioner,
    "MaxSize": shardvar.MaxSizePartitioner,
    "fixed_size_partitioner": shardvar.fixed_size_partitioner,
    "min_max_variable_partitioner": shardvar.min_max_variable_partitioner,
    "variable_axis_size_partitioner": shardvar.variable_axis_size_partitioner,
}
LEGACY = {"fixed_size_partitioner", "min_max_variable_partitioner", "variable_axis_size_partitioner"}


@pytest.mark.parametrize("case", conformance_cases("partitioners.json"))
def test_partitioner_case(case: dict) -> None:
    factory = FACTORIES[case["partitioner"]]
    if "error" in case:
        with pytest.raises(ERRORS[case["error"]]):
            p = factory(**case["args"])
            if not case.get("construct_only"):
                p(case["shape"], case["dtype"], case["axis"])
        return
    if case["partitioner"] in LEGACY:
        got = factory(**case["args"], axis=case["axis"])(case["shape"], case["dtype"])
    else:
        got = factory(**case["args"])(case["shape"], case["dtype"], axis=case["axis"])
    assert got == case["expected"]
