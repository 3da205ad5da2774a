"""embedding_lookup_sparse and safe_embedding_lookup_sparse take weights of any float dtype with params of any
float dtype, as TensorFlow does (low-precision tables pooled in float32, cast back); bad sp_ids say their rank."""

from __future__ import annotations

import itertools

import pytest
import torch

import shardvar
from shardvar import ShardvarDTypeError, ShardvarTypeError

FLOATS = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
TOLERANCE = {torch.float16: 2e-3, torch.bfloat16: 2e-2, torch.float32: 1e-6, torch.float64: 1e-12}
BAGS = [[3, 7, 7], [], [0, 11], [5]]  # a bag per row; the second empty
WEIGHTS = [[0.5, 2.0, -0.25], [], [1.5, 0.75], [3.0]]


def _sparse(rows: list[list[float]], dtype: torch.dtype) -> torch.Tensor:
    indices = [[b, j] for b, bag in enumerate(rows) for j in range(len(bag))]
    values = [v for bag in rows for v in bag]
    shape = (len(rows), max(map(len, rows)))
    return torch.sparse_coo_tensor(
        torch.tensor(indices).T, torch.tensor(values, dtype=dtype), shape, check_invariants=True
    )


def _reference(table: torch.Tensor, weights: torch.dtype, combiner: str, safe: bool) -> torch.Tensor:
    """TensorFlow's computation in float64: the rows and weights rounded to the dtype it pools in, then cast back."""
    pooled_in = torch.float32 if table.dtype in (torch.float16, torch.bfloat16) else table.dtype
    rows = table.to(pooled_in).double()
    out = torch.zeros(len(BAGS), table.shape[1], dtype=torch.float64)
    for b, (bag, ws) in enumerate(zip(BAGS, WEIGHTS, strict=True)):
        kept = [(i, w) for i, w in zip(bag, ws, strict=True) if not safe or w > 0]
        w = torch.tensor([w for _, w in kept], dtype=weights).to(pooled_in).double()
        if not kept:
            continue
        total = (w[:, None] * rows[[i for i, _ in kept]]).sum(0)
        denom = {"sum": 1.0, "mean": w.sum(), "sqrtn": (w * w).sum().sqrt()}[combiner]
        out[b] = total / denom if denom != 0 else 0.0
    return out


@pytest.mark.parametrize("safe", [False, True], ids=["embedding_lookup_sparse", "safe_embedding_lookup_sparse"])
@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
@pytest.mark.parametrize(("params", "weights"), list(itertools.product(FLOATS, FLOATS)), ids=str)
def test_every_params_and_weights_dtype_pool_as_tensorflow(
    params: torch.dtype, weights: torch.dtype, combiner: str, safe: bool
) -> None:
    torch.manual_seed(0)
    table = torch.randn(12, 3, dtype=torch.float64).to(params)
    shards = list(table.split([4, 4, 4]))
    lookup = shardvar.safe_embedding_lookup_sparse if safe else shardvar.embedding_lookup_sparse
    out = lookup(shards, _sparse(BAGS, torch.int64), _sparse(WEIGHTS, weights), combiner=combiner,
                 partition_strategy="div")  # fmt: skip
    assert out.dtype == params
    expected = _reference(table, weights, combiner, safe)
    tol = TOLERANCE[params]
    torch.testing.assert_close(out.double(), expected.to(params).double(), atol=tol * 10, rtol=tol)


@pytest.mark.parametrize("params", FLOATS, ids=str)
def test_low_precision_weighted_bags_have_gradients_in_the_params_dtype(params: torch.dtype) -> None:
    table = shardvar.ShardedVariable([torch.nn.Parameter(torch.ones(6, 2, dtype=params)) for _ in range(2)])
    out = shardvar.embedding_lookup_sparse(table, _sparse(BAGS[:1], torch.int64), _sparse(WEIGHTS[:1], torch.float32),
                                           combiner="sum")  # fmt: skip
    out.sum().backward()
    grads = [p.grad for p in table.variables]
    assert all(g.dtype == params for g in grads)
    torch.testing.assert_close(grads[0][3].double(), torch.full((2,), 0.5, dtype=torch.float64))
    torch.testing.assert_close(grads[1][1].double(), torch.full((2,), 1.75, dtype=torch.float64))


@pytest.mark.parametrize("safe", [False, True])
def test_integer_weights_are_refused(safe: bool) -> None:
    lookup = shardvar.safe_embedding_lookup_sparse if safe else shardvar.embedding_lookup_sparse
    with pytest.raises(
        ShardvarDTypeError, match=r"sp_weights must hold floating-point weights; got dtype torch\.int64"
    ):
        lookup([torch.ones(12, 3)], _sparse(BAGS, torch.int64), _sparse([[1, 2, 3], [], [4, 5], [6]], torch.int64))


def _big_sparse(rank: int) -> torch.Tensor:
    n = 200_000
    indices = torch.stack([torch.arange(n) % 7 for _ in range(rank)])
    return torch.sparse_coo_tensor(indices, torch.zeros(n, dtype=torch.int64), (7,) * rank, check_invariants=False)


BAD_IDS = {
    "sparse rank 1": (_big_sparse(1), False, r"got a sparse_coo tensor of rank 1, shape \[7\]$"),
    "sparse rank 3": (_big_sparse(3), False, r"got a sparse_coo tensor of rank 3, shape \[7, 7, 7\]$"),
    "safe, sparse rank 1": (_big_sparse(1), True, r"got a sparse_coo tensor of rank 1, shape \[7\]$"),
    "dense": (torch.zeros(300, 400, dtype=torch.int64), False, r"got a dense tensor of rank 2, shape \[300, 400\]$"),
    "list": ([[0, 1]] * 1000, True, r"got a list$"),
}


@pytest.mark.parametrize("case", sorted(BAD_IDS))
def test_sp_ids_of_another_rank_or_kind_are_named_by_rank_and_shape(case: str) -> None:
    sp_ids, safe, says = BAD_IDS[case]
    lookup = shardvar.safe_embedding_lookup_sparse if safe else shardvar.embedding_lookup_sparse
    with pytest.raises(ShardvarTypeError, match=says) as raised:
        lookup([torch.ones(12, 3)], sp_ids)
    assert len(str(raised.value)) < 200  # the tensor's values are never printed
