"""Sparse gradients split by shard come out coalesced, on every way shards can lie, equal to the
unsharded gradient; and ``coalesce`` equals ``Tensor.coalesce``."""

import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardvar import ShardedVariable
from shardvar._recycle import Recycler
from shardvar.variables._distinct import _scattered_sum, coalesce, segments

warnings.filterwarnings("ignore", "Sparse invariant checks")


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.integers(0, 60), max_size=200),
    st.sampled_from([torch.float32, torch.float64, torch.bfloat16]),
    st.booleans(),
)
def test_coalesce_equals_torch_coalesce(ids: list[int], dtype: torch.dtype, recycled: bool) -> None:
    keys = torch.tensor(ids, dtype=torch.int64)
    values = torch.randn(len(ids), 3).to(dtype)
    recycle = (Recycler(), "k") if recycled else None
    rows, summed = coalesce(keys, values, 61, recycle)
    want = torch.sparse_coo_tensor(keys[None], values, (61, 3), check_invariants=True).coalesce()
    assert rows.dtype == torch.int64 and torch.equal(rows, want.indices()[0])
    # Each row's occurrences added in input order, bit for bit (bfloat16: accumulated wider, as the
    # bag kernel does, in its own way); torch's coalesce adds them in an order of its own
    # (vectorised), so against it the sums agree to rounding only.
    if dtype != torch.bfloat16:
        in_order = [_sum_in_order(values[keys == k]) for k in want.indices()[0].tolist()]
        assert torch.equal(summed, torch.stack(in_order) if in_order else summed.new_zeros(0, 3))
    tol = {} if dtype != torch.bfloat16 else {"rtol": 2e-2, "atol": 2e-2}
    torch.testing.assert_close(summed, want.values(), **tol)


def _sum_in_order(rows: torch.Tensor) -> torch.Tensor:
    total = rows[0].clone()
    for row in rows[1:]:
        total += row
    return total


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 60), max_size=200), st.sampled_from([torch.float32, torch.float64]))
def test_the_gpu_segment_sum_equals_torch_coalesce(ids: list[int], dtype: torch.dtype) -> None:
    # The segment sum a GPU takes (index_add; embedding_bag's per-bag walk is slow on hot ids
    # there), checked here on the CPU, where the same ops run.
    keys = torch.tensor(ids, dtype=torch.int64)
    values = torch.randn(len(ids), 3, dtype=dtype)
    unique, order, starts = segments(keys, 61)
    want = torch.sparse_coo_tensor(keys[None], values, (61, 3), check_invariants=True).coalesce()
    assert torch.equal(unique.long(), want.indices()[0])
    torch.testing.assert_close(_scattered_sum(values, order, starts, None), want.values())


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.integers(1, 5), min_size=1, max_size=20),
    st.integers(1, 30),
    st.booleans(),
    st.sampled_from([torch.int32, torch.int64]),
)
def test_the_gpu_segment_sum_of_gathered_weighted_rows_equals_embedding_bag(sizes, rows, weighted, index) -> None:
    # A bag gradient's form: ``order`` picks rows with repeats (each id's bag), weights scale them;
    # a bag's ids and offsets come as int32 or int64, as embedding_bag takes them.
    g = torch.Generator().manual_seed(sum(sizes) * rows)
    order = torch.randint(0, rows, (sum(sizes),), generator=g).to(index)
    starts = torch.tensor([0, *sizes[:-1]]).cumsum(0).to(index)
    values = torch.randn(rows, 3, generator=g, dtype=torch.float64)
    weights = torch.rand(order.numel(), generator=g, dtype=torch.float64) if weighted else None
    want = torch.nn.functional.embedding_bag(order, values, starts, mode="sum", per_sample_weights=weights)
    torch.testing.assert_close(_scattered_sum(values, order, starts, weights), want)


def _shards(how: str, strategy: str, sizes: list[int], width: int, dtype: torch.dtype) -> list[torch.Tensor]:
    n, rows = len(sizes), sum(sizes)
    if how == "interleaved":  # views of one table, row by row (mod): one slab, rows s + n * i
        table = torch.randn(rows, width).to(dtype)
        return [table[k::n] for k in range(n)]
    if how == "back to back":  # pieces of one allocation in order: one slab
        return list(torch.randn(rows, width).to(dtype).split(sizes))
    # kept apart (a view of a larger tensor cannot be moved): one group per shard
    return [torch.randn(s, width + 1).to(dtype)[:, :width] for s in sizes]


@settings(max_examples=80, deadline=None)
@given(
    st.sampled_from(["interleaved", "back to back", "apart"]),
    st.integers(1, 6),
    st.integers(1, 9),
    st.lists(st.integers(0, 200), max_size=120),
    st.sampled_from([torch.float32, torch.float64]),
    st.booleans(),
)
def test_split_gradient_is_coalesced_and_equals_the_unsharded_one(
    how: str, n: int, per: int, draws: list[int], dtype: torch.dtype, coalesced_in: bool
) -> None:
    strategy = "mod" if how == "interleaved" else ("div", "mod")[per % 2]
    sizes = [per] * n if how == "interleaved" else [per + (k < per % n) for k in range(n)]
    var = ShardedVariable(_shards(how, strategy, sizes, 3, dtype), partition_strategy=strategy)
    store, rows = var.store, sum(sizes)
    ids = torch.tensor([d % rows for d in draws], dtype=torch.int64)
    if coalesced_in:  # a collection's summed gradient: distinct ids, ascending
        ids = ids.unique()
    values = torch.randn(ids.numel(), 3, dtype=dtype)
    want = torch.zeros(rows, 3, dtype=dtype).index_add_(0, ids, values)
    grads: dict[int, torch.Tensor] = {}
    group_of, row = store.route(ids)
    for g in range(len(store.groups)):
        mine = group_of == g
        coalesced = coalesced_in and bool((row[mine].diff() > 0).all())
        grads.update(store.split_sparse_grad(g, row[mine], values[mine], coalesced))
    for s, grad in grads.items():
        local = grad._indices()[0]
        assert torch.equal(local, local.unique()), "distinct rows, ascending"
        assert grad.shape == var.variables[s].shape
    full = {**store.zero_grads(True, skip=grads.keys()), **grads}
    whole = store.layout.join([full[s].to_dense() for s in range(n)])
    torch.testing.assert_close(whole, want, rtol=1e-6, atol=1e-6)


def test_a_gradient_coalesce_cannot_sum_is_split_as_it_came() -> None:
    # Complex rows: F.embedding_bag has no complex kernel, so the rows stay as they came, reordered.
    var = ShardedVariable(list(torch.randn(8, 2, dtype=torch.complex64).split(4)))
    ids = torch.tensor([5, 1, 5, 0])
    values = torch.randn(4, 2, dtype=torch.complex64)
    grads = var.store.split_sparse_grad(0, ids, values)
    whole = var.store.layout.join([grads[s].to_dense() for s in range(2)])
    torch.testing.assert_close(whole, torch.zeros(8, 2, dtype=torch.complex64).index_add_(0, ids, values))


@pytest.mark.parametrize("how", ["interleaved", "back to back"])
def test_a_differentiable_gradient_stays_differentiable(how: str) -> None:
    # A double backward hands in values that need their own gradient: the sums stay in the graph.
    var = ShardedVariable(_shards(how, "mod", [3, 3], 2, torch.float64), partition_strategy="mod")
    ids = torch.tensor([4, 1, 4, 0])
    values = torch.randn(4, 2, dtype=torch.float64, requires_grad=True)
    _, row = var.store.route(ids)
    grads = var.store.split_sparse_grad(0, row, values)
    total = sum(g.to_dense().pow(2).sum() for g in grads.values())
    (got,) = torch.autograd.grad(total, values)
    summed = torch.zeros(6, 2, dtype=torch.float64).index_add(0, ids, values)
    (want,) = torch.autograd.grad(summed.pow(2).sum(), values)
    torch.testing.assert_close(got, want)
