"""The collection's sparse bag gradient: one row per distinct id (a sparse product), equal to torch's."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from shardvar import EmbeddingBagCollection, TableConfig
from shardvar.variables._bag_grad import sparse_bag


@settings(max_examples=15, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 6), min_size=1, max_size=8),
    mode=st.sampled_from(["sum", "mean"]),
    weighted=st.booleans(),
    seed=st.integers(0, 1000),
)
def test_the_sparse_product_equals_torchs_per_id_gradient(lengths, mode, weighted, seed) -> None:
    g = torch.Generator().manual_seed(seed)
    n, weighted = sum(lengths), weighted and mode == "sum"
    rows, offsets = torch.randint(0, 7, (n,), generator=g), torch.tensor([0, *lengths[:-1]]).cumsum(0)
    psw = torch.rand(n, generator=g).requires_grad_() if weighted else None
    table = torch.randn(7, 3, generator=g, requires_grad=True)
    grad = torch.randn(len(lengths), 3, generator=g)
    got = sparse_bag(rows, table, offsets, mode, psw)
    got.backward(grad)
    ours, ours_psw = table.grad, psw.grad if weighted else None
    assert ours._nnz() == rows.unique().numel()  # one row per distinct id, no per-id copies
    table.grad = None
    psw = psw.detach().requires_grad_() if weighted else None
    want = F.embedding_bag(rows, table, offsets, mode=mode, sparse=True, per_sample_weights=psw)
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    want.backward(grad)
    torch.testing.assert_close(ours.to_dense(), table.grad.to_dense(), atol=1e-6, rtol=0)
    if weighted:
        torch.testing.assert_close(ours_psw, psw.grad, atol=1e-6, rtol=0)


def test_a_sparse_collection_hands_each_shard_the_distinct_rows_only() -> None:
    ebc = EmbeddingBagCollection({"a": TableConfig(50, 4, 2, "mod"), "b": TableConfig(30, 4)}, sparse=True)
    ids = {"a": torch.tensor([[1, 1, 3], [3, 1, 1]]), "b": torch.tensor([[2, 2, 2], [2, 5, 2]])}
    sum(v.sum() for v in ebc(ids).values()).backward()
    nnz = [p.grad.coalesce()._nnz() for bag in ebc.embedding_bags.values() for p in bag.weight.variables]
    assert sum(p.grad._nnz() for bag in ebc.embedding_bags.values() for p in bag.weight.variables) == sum(nnz) == 4
