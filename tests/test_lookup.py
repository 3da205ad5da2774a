"""Lookups against torch's unsharded ops, and their error messages."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import shardvar
from shardvar import Layout, ShardedVariable


@st.composite
def tables(draw):
    rows = draw(st.integers(1, 30))
    n = draw(st.integers(1, 6))
    layout = draw(st.sampled_from([Layout.div(rows, n), Layout.mod(rows, n), Layout.ceil(rows, n)]))
    table = torch.randn(rows, 3, generator=torch.Generator().manual_seed(draw(st.integers(0, 99))))
    slab = draw(st.booleans())
    v = shardvar.shard_tensor(table, layout)
    if not slab:
        v = ShardedVariable([s.clone() for s in v.variables], partition_strategy=layout.strategy)
    return v, table


@given(tables(), st.data())
@settings(deadline=None)
def test_embedding_lookup_equals_f_embedding(pair, data) -> None:
    v, table = pair
    shape = data.draw(st.lists(st.integers(0, 3), max_size=3))
    ids = torch.randint(0, table.shape[0], shape)
    torch.testing.assert_close(shardvar.embedding_lookup(v, ids), F.embedding(ids, table))
    if (
        v.layout.sizes == Layout.div(table.shape[0], len(v.variables)).sizes
    ):  # a list is read with the reference's sizes
        as_list = shardvar.embedding_lookup(v.variables, ids, partition_strategy=v.layout.strategy)
        torch.testing.assert_close(as_list, F.embedding(ids, table))


def sparse(indices, values, shape):
    return torch.sparse_coo_tensor(torch.tensor(indices).T, torch.tensor(values), shape, check_invariants=True)


def test_embedding_lookup_sparse_combiners_against_embedding_bag() -> None:
    torch.manual_seed(0)
    table = torch.randn(11, 4)
    v = shardvar.shard_tensor(table, Layout.mod(11, 3))
    entries = [(0, 0), (0, 1), (0, 2), (2, 0), (3, 0), (3, 1)]
    ids = [3, 10, 3, 0, 7, 7]
    weights = [0.5, 2.0, 1.0, 3.0, 1.0, 4.0]
    sp_ids, sp_w = sparse(entries, ids, (5, 3)), sparse(entries, weights, (5, 3))
    offsets = torch.tensor([0, 3, 3, 4, 6])
    flat, w = torch.tensor(ids), torch.tensor(weights)
    got = shardvar.embedding_lookup_sparse(v, sp_ids, sp_w, combiner="sum")
    torch.testing.assert_close(got, F.embedding_bag(flat, table, offsets, mode="sum", per_sample_weights=w))
    got = shardvar.embedding_lookup_sparse(v, sp_ids, None, combiner="mean")
    torch.testing.assert_close(got, F.embedding_bag(flat, table, offsets, mode="mean"))
    got = shardvar.embedding_lookup_sparse(v, sp_ids, sp_w, combiner="sqrtn")
    rows = table[flat] * w[:, None]
    expected = torch.zeros(5, 4).index_add(0, torch.tensor([0, 0, 0, 2, 3, 3]), rows)
    norms = torch.zeros(5).index_add(0, torch.tensor([0, 0, 0, 2, 3, 3]), w * w).sqrt()
    expected = torch.where(norms[:, None] > 0, expected / norms.clamp(min=1e-30)[:, None], torch.zeros_like(expected))
    torch.testing.assert_close(got, expected)
    assert got[1].abs().sum() == 0 and got[4].abs().sum() == 0  # empty bags give zeros


def test_safe_embedding_lookup_sparse_drops_invalid_entries() -> None:
    table = torch.arange(12.0).reshape(6, 2)
    shards = [table[0:2], table[2:4], table[4:5], table[5:6]]  # a plain list, read as "div"
    entries = [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0)]
    sp_ids = sparse(entries, [1, -1, 2, 5, 4], (4, 2))
    sp_w = sparse(entries, [2.0, 1.0, 0.0, 1.0, -1.0], (4, 2))
    got = shardvar.safe_embedding_lookup_sparse(shards, sp_ids, sp_w, combiner="sum")
    torch.testing.assert_close(got, torch.stack([2 * table[1], table[5], torch.zeros(2), torch.zeros(2)]))
    got = shardvar.safe_embedding_lookup_sparse(shards, sp_ids, sp_w, combiner="mean", default_id=3)
    torch.testing.assert_close(got, torch.stack([table[1], table[5], table[3], table[3]]))
    got = shardvar.safe_embedding_lookup_sparse(shards, sp_ids, None, combiner="mean")
    torch.testing.assert_close(got, torch.stack([table[1], (table[2] + table[5]) / 2, table[4], torch.zeros(2)]))


def test_max_norm_clips_without_touching_the_table() -> None:
    table = torch.tensor([[3.0, 4.0], [0.3, 0.4], [0.0, 0.0]])
    v = shardvar.shard_tensor(table, Layout.mod(3, 2))
    got = shardvar.embedding_lookup(v, torch.tensor([0, 1, 2]), max_norm=1.0)
    torch.testing.assert_close(got, torch.tensor([[0.6, 0.8], [0.3, 0.4], [0.0, 0.0]]))
    torch.testing.assert_close(v.to_tensor(), table)


@pytest.mark.parametrize(
    "call, exc, match",
    [
        (
            lambda v: shardvar.embedding_lookup(v, [1], partition_strategy="div"),
            ValueError,
            "conflicts with the ShardedVariable's own layout",
        ),
        (
            lambda v: shardvar.embedding_lookup([torch.ones(1, 2), torch.ones(3, 2)], [0], partition_strategy="div"),
            ValueError,
            r"reference's sizes \[2, 2\]; got \[1, 3\]",
        ),
        (
            lambda v: shardvar.embedding_lookup([torch.ones(1, 2), torch.ones(3, 2)], [0]),
            ValueError,
            r"must have sizes \[2, 2\]",
        ),
        (lambda v: shardvar.embedding_lookup(v, [6]), IndexError, r"ids must be in \[0, 6\); got 6"),
        (lambda v: shardvar.embedding_lookup(v, [0.5]), TypeError, "ids must be integers"),
        (lambda v: shardvar.embedding_lookup("table", [0]), TypeError, "params must be"),
        (
            lambda v: shardvar.embedding_lookup(ShardedVariable([torch.ones(2, 2)], axis=1), [0]),
            ValueError,
            "along axis 0",
        ),
        (
            lambda v: shardvar.embedding_lookup_sparse(v, sparse([(0, 0)], [1], (1, 1)), combiner="max"),
            ValueError,
            "combiner must be one of",
        ),
        (lambda v: shardvar.embedding_lookup_sparse(v, torch.tensor([[1]])), TypeError, "sparse COO"),
        (
            lambda v: shardvar.embedding_lookup_sparse(
                v, sparse([(0, 0)], [1], (1, 2)), sparse([(0, 1)], [1.0], (1, 2))
            ),
            ValueError,
            "same indices",
        ),
    ],
)
def test_bad_input(call, exc, match) -> None:
    v = shardvar.shard_tensor(torch.ones(6, 2), Layout.mod(6, 2))
    with pytest.raises(exc, match=match):
        call(v)


def test_create_partitioned_variables_values_do_not_depend_on_the_slicing() -> None:
    def init(shape, dtype):
        return torch.randn(shape, dtype=dtype)

    values = []
    for slicing in ([1, 1], [2, 1], [3, 1], [7, 1], [1, 3]):
        torch.manual_seed(5)
        v = shardvar.create_partitioned_variables([7, 4], slicing, init)
        assert len(v.variables) == max(slicing)
        values.append(v.to_tensor().detach())
    for other in values[1:]:
        torch.testing.assert_close(other, values[0])
    assert all(p.requires_grad for p in v.variables)
    v = shardvar.create_partitioned_variables([5, 2], [2, 1], 0.5, dtype=torch.float64, trainable=False)
    assert v.dtype == torch.float64 and not v.requires_grad and bool((v.to_tensor() == 0.5).all())


@pytest.mark.parametrize(
    "args, exc, match",
    [
        (([4, 2], [2], 0.0), ValueError, "same length"),
        (([4, 2], [2, 2], 0.0), ValueError, "at most one entry > 1"),
        (([4, 2], [5, 1], 0.0), ValueError, "into 5 shards; at most 4"),
        (([4, 2], [2, 1], torch.zeros(3, 2)), ValueError, r"initializer tensor has shape \[3, 2\]"),
        (([4, 2], [2, 1], lambda s, d: torch.zeros(2)), ValueError, "initializer returned"),
        (([4, 2], [2, 1], "zeros"), TypeError, "initializer must be"),
        (([], [], 0.0), ValueError, "0-d"),
    ],
)
def test_create_partitioned_variables_errors(args, exc, match) -> None:
    with pytest.raises(exc, match=match):
        shardvar.create_partitioned_variables(*args)
