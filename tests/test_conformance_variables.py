"""The reference's recorded lookup, slicing and layout cases, for a list of shards and a ShardedVariable."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import shardvar
from conftest import ERRORS, conformance_cases


def lookup_shards(case: dict) -> list[torch.Tensor]:
    dim = case["dim"]
    return [
        torch.tensor([[s * 1000 + r + 0.25 * c for c in range(dim)] for r in range(rows)], dtype=torch.float32).reshape(
            rows, dim
        )
        for s, rows in enumerate(case["shard_rows"])
    ]


@pytest.mark.parametrize("as_variable", [False, True], ids=["list", "ShardedVariable"])
@pytest.mark.parametrize("case", conformance_cases("lookup.json"))
def test_lookup_case(case: dict, as_variable: bool) -> None:
    shards = lookup_shards(case)
    params = shardvar.ShardedVariable(shards, partition_strategy=case["strategy"]) if as_variable else shards
    strategy = None if as_variable else case["strategy"]
    if case.get("sparse"):
        n = len(case["ids"])
        index = torch.tensor([case["segments"], list(range(n))])
        sp_ids = torch.sparse_coo_tensor(
            index, torch.tensor(case["ids"]), (case["batch"], max(n, 1)), check_invariants=True
        )
        sp_w = None
        if case["weights"] is not None:
            sp_w = torch.sparse_coo_tensor(
                index,
                torch.tensor(case["weights"], dtype=torch.float32),
                (case["batch"], max(n, 1)),
                check_invariants=True,
            )
        got = shardvar.embedding_lookup_sparse(
            params, sp_ids, sp_w, partition_strategy=strategy, combiner=case["combiner"], max_norm=case.get("max_norm")
        )
    else:
        got = shardvar.embedding_lookup(
            params, torch.tensor(case["ids"]), partition_strategy=strategy, max_norm=case["max_norm"]
        )
    np.testing.assert_allclose(got.numpy(), np.array(case["expected"], dtype=np.float32), rtol=1e-5, atol=1e-3)


def slicing_variable(case: dict, initial_plus_one: bool) -> shardvar.ShardedVariable:
    shards, start = [], 0
    for rows in case["shard_rows"]:
        shards.append(
            torch.arange(start, start + rows, dtype=torch.float32).reshape(rows, 1) + (1 if initial_plus_one else 0)
        )
        start += rows
    return shardvar.ShardedVariable(shards)


@pytest.mark.parametrize("case", conformance_cases("slicing.json", keep=lambda c: "op" not in c))
def test_slicing_case(case: dict) -> None:
    v = slicing_variable(case, initial_plus_one=False)
    key = slice(*case["slice"]) if "slice" in case else case["index"]
    if "error" in case:
        with pytest.raises(ERRORS[case["error"]]):
            v[key]
        return
    assert v[key].reshape(-1).tolist() == case["expected"]


@pytest.mark.parametrize("as_variable", [False, True], ids=["list", "ShardedVariable"])
@pytest.mark.parametrize("case", conformance_cases("slicing.json", keep=lambda c: "op" in c))
def test_scatter_case(case: dict, as_variable: bool) -> None:
    v = slicing_variable(case, initial_plus_one=True)
    if not as_variable:
        # The same op through a fresh ShardedVariable over the plain list of shard tensors.
        v = shardvar.ShardedVariable(list(v.variables))
    getattr(v, case["op"])(torch.tensor(case["indices"]), torch.tensor(case["updates"]))
    np.testing.assert_allclose(v.numpy().reshape(-1), case["after"], rtol=1e-6)
    read = case["sparse_read"]
    np.testing.assert_allclose(
        v.sparse_read(torch.tensor(read["ids"])).reshape(-1).numpy(), read["expected"], rtol=1e-6
    )


@pytest.mark.parametrize("case", conformance_cases("layout.json"))
def test_layout_case(case: dict) -> None:
    value = torch.arange(float(np.prod(case["shape"]))).reshape(case["shape"])
    v = shardvar.create_partitioned_variables(case["shape"], case["slicing"], value)
    assert [list(s.shape) for s in v.variables] == case["shard_shapes"]
    assert torch.equal(v.to_tensor().detach(), value)
    config = shardvar.PartitionerConfig(case["slicing"])
    assert [list(s) for s in config.layout(case["shape"]).shard_shapes(case["shape"])] == case["shard_shapes"]
