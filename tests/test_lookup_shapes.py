"""Every rank of ids x every rank of params, against the unsharded reference (issue 22, parts 2 and 4).

``embedding_lookup`` gives ``ids.shape + params.shape[1:]`` for ids of any rank (0-d and Python ints
included) and params of any rank; the sparse lookups keep the params' trailing dimensions. Each
law is checked for every layout (div, mod, ceil), over a slab and over separate shards.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import shardvar
from shardvar import Layout, ShardedVariable

LAYOUTS = {"div": Layout.div, "mod": Layout.mod, "ceil": Layout.ceil}


@st.composite
def sharded(draw, min_rank: int = 1):
    """(variable, the unsharded table): any rank >= min_rank, any layout, one slab or separate shards."""
    rows = draw(st.integers(1, 12))
    row_shape = draw(st.lists(st.integers(1, 3), min_size=min_rank - 1, max_size=3))
    table = torch.randn((rows, *row_shape), generator=torch.Generator().manual_seed(draw(st.integers(0, 99))))
    layout = LAYOUTS[draw(st.sampled_from(sorted(LAYOUTS)))](rows, draw(st.integers(1, 4)))
    v = shardvar.shard_tensor(table, layout)
    if draw(st.booleans()):
        v = ShardedVariable([s.clone() for s in v.variables], partition_strategy=layout.strategy)
    return v, table


def reference_clip(rows: torch.Tensor, ids_ndim: int, max_norm: float) -> torch.Tensor:
    """The reference's max_norm: each looked-up row (all its trailing dims) clipped to L2 norm max_norm."""
    dims = tuple(range(ids_ndim, rows.dim()))
    norm = rows.pow(2).sum(dims, keepdim=True).sqrt() if dims else rows.abs()
    return torch.where(norm > max_norm, rows * max_norm / norm, rows)


@given(sharded(), st.lists(st.integers(0, 3), max_size=3), st.sampled_from([None, 0.5]), st.data())
@settings(deadline=None, max_examples=30)
def test_lookup_shape_is_ids_shape_plus_row_shape(pair, ids_shape, max_norm, data) -> None:
    v, table = pair
    ids = torch.randint(0, table.shape[0], ids_shape)
    expected = table[ids]
    if max_norm is not None:
        expected = reference_clip(expected, ids.dim(), max_norm)
    got = shardvar.embedding_lookup(v, ids, max_norm=max_norm)
    assert got.shape == (*ids.shape, *table.shape[1:])
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(v.sparse_read(ids), table[ids])
    if ids.dim() == 0:  # a Python int is a 0-d id
        torch.testing.assert_close(shardvar.embedding_lookup(v, int(ids), max_norm=max_norm), expected)
        torch.testing.assert_close(v.sparse_read(int(ids)), table[ids])


@pytest.mark.parametrize("ids", [torch.tensor(3), 3], ids=["tensor", "int"])
@pytest.mark.parametrize("strategy", ["div", "mod"])
def test_zero_d_ids_on_one_d_params_give_a_zero_d_result(ids, strategy) -> None:
    shards = [torch.tensor([0.0, 1.0, 2.0]), torch.tensor([3.0, 4.0])]
    table = ShardedVariable(shards, partition_strategy=strategy).to_tensor()
    got = shardvar.embedding_lookup(shards, ids, partition_strategy=strategy)
    assert got.shape == () and got == table[3]


ZERO_D_LOOKUPS = {
    "embedding_lookup": lambda v, ids, path: shardvar.embedding_lookup(v, ids),
    "sparse_read": lambda v, ids, path: v.sparse_read(ids),
    "getitem": lambda v, ids, path: v[ids],
    "served checkpoint": lambda v, ids, path: (shardvar.save({"v": v}, path), shardvar.open(path)["v"].lookup(ids))[1],
}


@pytest.mark.parametrize("entry", sorted(ZERO_D_LOOKUPS))
@pytest.mark.parametrize("rank", [1, 2, 3])
def test_zero_d_ids_in_every_lookup_give_the_row_shape(entry, rank, tmp_path) -> None:
    table = torch.arange(7.0 * 2 ** (rank - 1)).reshape(7, *[2] * (rank - 1))
    v = shardvar.shard_tensor(table, Layout.mod(7, 3))
    for ids in (torch.tensor(5), 5):
        got = ZERO_D_LOOKUPS[entry](v, ids, tmp_path / f"c{type(ids).__name__}")
        assert got.shape == table.shape[1:]
        torch.testing.assert_close(got, table[5])
    if rank == 2:
        emb = shardvar.ShardedEmbedding(7, 2, partitioner=3, _weight=table)
        torch.testing.assert_close(emb(torch.tensor(5)), table[5])


def sparse_bags(draw, rows: int) -> tuple[list[list[int]], list[list[float]]]:
    bags = draw(st.lists(st.lists(st.integers(0, rows - 1), max_size=3), min_size=1, max_size=4))
    weights = [[draw(st.sampled_from([0.5, 1.0, 2.0])) for _ in bag] for bag in bags]
    return bags, weights


def to_sparse(bags: list[list], dtype: torch.dtype) -> torch.Tensor:
    k = max([len(b) for b in bags] + [1])
    entries = [(b, j) for b, bag in enumerate(bags) for j in range(len(bag))]
    values = [x for bag in bags for x in bag]
    indices = torch.tensor(entries, dtype=torch.int64).reshape(-1, 2).T
    return torch.sparse_coo_tensor(indices, torch.tensor(values, dtype=dtype), (len(bags), k), check_invariants=True)


def reference_bag(table, bag, weights, combiner, max_norm) -> torch.Tensor:
    """One bag pooled as the reference pools it, over rows of any shape (zeros when empty)."""
    if not bag:
        return torch.zeros(table.shape[1:])
    rows = table[torch.tensor(bag)]
    if max_norm is not None:
        rows = reference_clip(rows, 1, max_norm)
    w = torch.tensor(weights).reshape((-1, *[1] * (rows.dim() - 1)))
    total = (rows * w).sum(0)
    denom = {"sum": torch.tensor(1.0), "mean": w.sum(), "sqrtn": w.pow(2).sum().sqrt()}[combiner]
    return total / denom


@given(sharded(min_rank=2), st.sampled_from(["sum", "mean", "sqrtn"]), st.booleans(), st.data())
@settings(deadline=None, max_examples=20)
def test_sparse_lookups_keep_the_trailing_dims(pair, combiner, weighted, data) -> None:
    v, table = pair
    bags, weights = sparse_bags(data.draw, table.shape[0])
    max_norm = data.draw(st.sampled_from([None, 0.5]))
    if not weighted:
        weights = [[1.0] * len(b) for b in bags]
    sp_ids, sp_w = to_sparse(bags, torch.int64), to_sparse(weights, table.dtype) if weighted else None
    pooled = [reference_bag(table, b, w, combiner, max_norm) for b, w in zip(bags, weights, strict=True)]
    expected = torch.stack(pooled)
    for lookup in (shardvar.embedding_lookup_sparse, shardvar.safe_embedding_lookup_sparse):
        got = lookup(v, sp_ids, sp_w, combiner=combiner, max_norm=max_norm)
        assert got.shape == (len(bags), *table.shape[1:])
        torch.testing.assert_close(got, expected)
    default = data.draw(st.integers(0, table.shape[0] - 1))
    got = shardvar.safe_embedding_lookup_sparse(v, sp_ids, sp_w, combiner=combiner, default_id=default)
    full = [
        reference_bag(table, b or [default], w or [1.0], combiner, None) for b, w in zip(bags, weights, strict=True)
    ]
    torch.testing.assert_close(got, torch.stack(full))


@pytest.mark.parametrize("sharding", ["one shard", "div 3", "mod 3"])
def test_sparse_lookup_of_rank_three_params_gives_batch_by_row_shape(sharding) -> None:
    table = torch.randn(13, 2, 5)
    layout = {"one shard": Layout.div(13, 1), "div 3": Layout.div(13, 3), "mod 3": Layout.mod(13, 3)}[sharding]
    v = shardvar.shard_tensor(table, layout)
    sp_ids = to_sparse([[0, 12], [5]], torch.int64)
    for lookup in (shardvar.embedding_lookup_sparse, shardvar.safe_embedding_lookup_sparse):
        got = lookup(v, sp_ids, combiner="sum")
        assert got.shape == (2, 2, 5)
        torch.testing.assert_close(got, torch.stack([table[0] + table[12], table[5]]))


# -- jagged ids (issue 22, part 3) ----------------------------------------------------------------


def _jagged_forms() -> dict[str, torch.Tensor]:
    plain = torch.nested.nested_tensor(
        [torch.tensor([1, 2, 8]), torch.tensor([3]), torch.tensor([0, 0])], layout=torch.jagged
    )
    deep = torch.nested.nested_tensor([torch.tensor([[1, 2], [0, 8]]), torch.tensor([[3, 4]])], layout=torch.jagged)
    holes = torch.nested.nested_tensor_from_jagged(
        torch.tensor([5, 1, 7, 2, 2, 6]), torch.tensor([0, 3, 4, 6]), lengths=torch.tensor([2, 1, 1])
    )
    return {"[B, j]": plain, "[B, j, k]": deep, "ragged dim 2": deep.transpose(1, 2), "with holes": holes}


JAGGED = _jagged_forms()


def _lookups(v: ShardedVariable) -> dict:
    """Every id lookup over ``v`` (a [9, 3] table): name -> (call, unsharded reference on one row of ids)."""
    emb = shardvar.ShardedEmbedding(9, 3, partitioner=v.layout, _weight=v.to_tensor().detach())
    table = v.to_tensor().detach()
    return {
        "embedding_lookup": (lambda ids: shardvar.embedding_lookup(v, ids), lambda ids: table[ids]),
        "embedding_lookup max_norm": (
            lambda ids: shardvar.embedding_lookup(v, ids, max_norm=0.5),
            lambda ids: reference_clip(table[ids], ids.dim(), 0.5),
        ),
        "sparse_read": (v.sparse_read, lambda ids: table[ids]),
        "ShardedEmbedding": (emb, lambda ids: table[ids]),
    }


@pytest.mark.parametrize("form", sorted(JAGGED))
@pytest.mark.parametrize("layout", ["div", "mod"])
@pytest.mark.parametrize("entry", ["embedding_lookup", "embedding_lookup max_norm", "sparse_read", "ShardedEmbedding"])
def test_jagged_ids_give_jagged_rows_in_their_structure(form, layout, entry) -> None:
    ids = JAGGED[form]
    v = shardvar.shard_tensor(torch.randn(9, 3, generator=torch.Generator().manual_seed(0)), LAYOUTS[layout](9, 3))
    call, reference = _lookups(v)[entry]
    out = call(ids)
    assert out.is_nested and out.layout == torch.jagged and out.dim() == ids.dim() + 1
    for got, row in zip(out.unbind(), ids.unbind(), strict=True):
        torch.testing.assert_close(got, reference(row))


def test_gradients_of_jagged_rows_reach_the_shards() -> None:
    ids = JAGGED["[B, j]"]
    emb = shardvar.ShardedEmbedding(9, 3, partitioner=3)
    reference = torch.nn.Embedding.from_pretrained(emb.weight.to_tensor().detach(), freeze=False)
    emb(ids).values().square().sum().backward()
    reference(ids.values()).square().sum().backward()
    torch.testing.assert_close(emb.weight.grad, reference.weight.grad)


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
@pytest.mark.parametrize("entry", ["ShardedEmbeddingBag", "embedding_bag", "embedding_bag max_norm"])
def test_jagged_input_to_bags_is_one_bag_per_row(mode, entry) -> None:
    ids = JAGGED["[B, j]"]
    table = torch.randn(9, 3, generator=torch.Generator().manual_seed(1))
    v = shardvar.shard_tensor(table, Layout.mod(9, 3))
    weights = torch.nested.nested_tensor_from_jagged(torch.rand(ids.values().numel()), ids.offsets())
    pw = weights if mode == "sum" else None
    ref_table = reference_clip(table, 1, 0.5) if entry.endswith("max_norm") else table
    expected = torch.nn.functional.embedding_bag(
        ids.values(), ref_table, ids.offsets()[:-1], mode=mode, per_sample_weights=None if pw is None else pw.values()
    )
    bag = shardvar.ShardedEmbeddingBag(9, 3, partitioner=Layout.mod(9, 3), mode=mode, _weight=table)
    got = {
        "ShardedEmbeddingBag": lambda: bag(ids, per_sample_weights=pw),
        "embedding_bag": lambda: shardvar.embedding_bag(v, ids, mode=mode, per_sample_weights=pw),
        "embedding_bag max_norm": lambda: shardvar.embedding_bag(
            v, ids, mode=mode, per_sample_weights=pw, max_norm=0.5
        ),
    }[entry]()
    torch.testing.assert_close(got, expected)


with warnings.catch_warnings():  # torch warns that the strided layout is a prototype: that is the point
    warnings.simplefilter("ignore", UserWarning)
    STRIDED = torch.nested.nested_tensor([torch.tensor([1, 2]), torch.tensor([3])])
V = shardvar.shard_tensor(torch.randn(9, 3), Layout.div(9, 3))
JAGGED_REFUSALS = {
    "embedding_lookup strided": (
        lambda: shardvar.embedding_lookup(V, STRIDED),
        shardvar.ShardvarTypeError,
        "layout=torch.strided",
    ),
    "sparse_read strided": (lambda: V.sparse_read(STRIDED), shardvar.ShardvarTypeError, "layout=torch.jagged"),
    "embedding_bag strided": (
        lambda: shardvar.embedding_bag(V, STRIDED),
        shardvar.ShardvarTypeError,
        "layout=torch.strided",
    ),
    "bag of [B, j, k]": (
        lambda: shardvar.embedding_bag(V, JAGGED["[B, j, k]"]),
        shardvar.ShardvarValueError,
        r"got shape \[2, j\d+, 2\]",
    ),
    "bag with holes": (
        lambda: shardvar.embedding_bag(V, JAGGED["with holes"]),
        shardvar.ShardvarValueError,
        "and lengths",
    ),
    "bag with offsets": (
        lambda: shardvar.embedding_bag(V, JAGGED["[B, j]"], torch.tensor([0, 1])),
        shardvar.ShardvarValueError,
        r"offsets=tensor\(\[0, 1\]\)",
    ),
    "jagged weights, plain input": (
        lambda: shardvar.embedding_bag(
            V, torch.tensor([[1, 2]]), mode="sum", per_sample_weights=JAGGED["[B, j]"].float()
        ),
        shardvar.ShardvarTypeError,
        "only when the input is jagged",
    ),
}


@pytest.mark.parametrize("case", sorted(JAGGED_REFUSALS))
def test_unsupported_nested_forms_are_refused_naming_the_supported_ones(case) -> None:
    call, error, match = JAGGED_REFUSALS[case]
    before = V.to_tensor().clone()
    with pytest.raises(error, match=match):
        call()
    torch.testing.assert_close(V.to_tensor(), before)
