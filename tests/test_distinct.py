"""The distinct-ids plan of fetched-row lookups, and its expansion, against torch.unique and F.embedding."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from shardvar.variables._distinct import distinct, expand, pool

id_lists = st.lists(st.integers(0, 40), min_size=0, max_size=200)


@settings(max_examples=60, deadline=None)
@given(id_lists)
def test_distinct_matches_torch_unique(values: list[int]) -> None:
    ids = torch.tensor(values, dtype=torch.int64)
    found = distinct(ids, 41)
    unique, inverse = torch.unique(ids, return_inverse=True)
    assert torch.equal(found.ids, unique) and torch.equal(found.inverse, inverse)
    # Each group lists the positions of one id, in input order.
    counts = torch.bincount(inverse, minlength=unique.numel()) if ids.numel() else torch.zeros(0, dtype=torch.int64)
    assert torch.equal(found.offsets, counts.cumsum(0) - counts)
    assert torch.equal(ids.index_select(0, found.order), unique.repeat_interleave(counts))
    for start, n in zip(found.offsets.tolist(), counts.tolist(), strict=True):
        group = found.order[start : start + n]
        assert bool((group[1:] > group[:-1]).all())


@settings(max_examples=40, deadline=None)
@given(id_lists, st.integers(1, 5))
def test_distinct_orders_by_key(values: list[int], world: int) -> None:
    ids = torch.tensor(values, dtype=torch.int64)
    owner = ids % world
    found = distinct(ids, 41 * world, owner * 41 + ids)
    assert bool((found.ids % world)[1:].ge((found.ids % world)[:-1]).all())
    assert torch.equal(found.ids.index_select(0, found.inverse), ids)
    assert found.ids.numel() == torch.unique(ids).numel()


def test_distinct_keeps_wide_ids_apart() -> None:
    # Ids that agree in their low 32 bits stay distinct when the bound says they may be wide.
    ids = torch.tensor([5, (1 << 32) + 5, 5])
    assert distinct(ids, (1 << 63) - 1).ids.tolist() == [5, (1 << 32) + 5]


@settings(max_examples=40, deadline=None)
@given(id_lists.filter(bool), st.sampled_from([torch.float32, torch.float64]))
def test_expand_matches_embedding_values_and_gradient(values: list[int], dtype: torch.dtype) -> None:
    ids = torch.tensor(values, dtype=torch.int64)
    found = distinct(ids, 41)
    rows = torch.randn(found.ids.numel(), 3, dtype=dtype, requires_grad=True)
    ref_rows = rows.detach().clone().requires_grad_(True)
    grad = torch.randn(ids.numel(), 3, dtype=dtype)
    out = expand(rows, found)
    ref = F.embedding(found.inverse, ref_rows)
    assert torch.equal(out, ref)
    out.backward(grad)
    ref.backward(grad)
    torch.testing.assert_close(rows.grad, ref_rows.grad, rtol=0, atol=1e-12 if dtype == torch.float64 else 1e-5)


def test_expand_is_twice_differentiable() -> None:
    ids = torch.tensor([3, 1, 3, 3, 0])
    found = distinct(ids, 4)
    rows = torch.randn(found.ids.numel(), 2, dtype=torch.float64, requires_grad=True)
    torch.autograd.gradcheck(lambda r: expand(r, found), (rows,))
    torch.autograd.gradgradcheck(lambda r: expand(r, found), (rows,))


def _loose(rows: int = 9, width: int = 3):
    """A variable whose mod shards are views of two tensors: no full slab, lookups fetch rows."""
    from shardvar import ShardedVariable

    a, b = torch.randn(rows, width), torch.randn(rows, width)
    v = ShardedVariable([a[0::2].requires_grad_(), b[1::2].requires_grad_()], partition_strategy="mod")
    assert v.store.full_slab is None
    return v


def test_dense_gradient_memory_is_reused_only_once_nothing_holds_it() -> None:
    v = _loose()
    shards = list(v.variables)
    ids = torch.tensor([0, 3, 3, 8])

    def step(grad_scale: float) -> list[torch.Tensor]:
        (v.sparse_read(ids) * grad_scale).sum().backward()
        return [s.grad for s in shards]

    first = step(1.0)
    kept = [g.clone() for g in first]
    second = step(2.0)  # the first gradients are still .grad: they accumulate, nothing is reused
    for g, k in zip(second, kept, strict=True):
        torch.testing.assert_close(g, 3 * k)
    held = shards[0].grad  # the user keeps one gradient while zero_grad drops the .grad
    for s in shards:
        s.grad = None
    third = step(1.0)
    torch.testing.assert_close(held, 3 * kept[0])  # untouched by the next backward
    for g, k in zip(third, kept, strict=True):
        torch.testing.assert_close(g, k)
    del held, first, second, third
    for s in shards:
        s.grad = None
    fourth = step(1.0)
    for g, k in zip(fourth, kept, strict=True):
        torch.testing.assert_close(g, k)


def test_copies_and_pickles_carry_no_gradient_buffer() -> None:
    import copy
    import io

    v = _loose()
    v.sparse_read(torch.tensor([1, 2])).sum().backward()
    for s in v.variables:
        s.grad = None
    clone = copy.deepcopy(v)
    (clone.sparse_read(torch.tensor([2])) * 3).sum().backward()
    torch.testing.assert_close(clone.variables[0].grad[1], torch.full((3,), 3.0))
    buffer = io.BytesIO()
    torch.save(v, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    torch.testing.assert_close(loaded.sparse_read(torch.arange(9)), v.sparse_read(torch.arange(9)))


def _bags(draw_lengths: list[int]) -> torch.Tensor:
    lengths = torch.tensor(draw_lengths, dtype=torch.int64)
    return lengths.cumsum(0) - lengths


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.integers(0, 6), min_size=1, max_size=30).filter(sum),
    st.sampled_from(["sum", "mean", "weighted"]),
    st.sampled_from([torch.float32, torch.float64]),
    st.integers(0, 2**31),
)
def test_pooled_distinct_rows_match_embedding_bag(lengths: list[int], mode: str, dtype: torch.dtype, seed: int) -> None:
    # Bags of every length (empty ones too) over fetched distinct rows: torch's values bit for bit,
    # its gradient (torch sums each row's ids in another order) to rounding, per-sample weights too.
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 12, (sum(lengths),), generator=g)
    offsets, found = _bags(lengths), distinct(ids, 12)
    weights = torch.rand(ids.numel(), generator=g, dtype=dtype) if mode == "weighted" else None
    op = "sum" if mode == "weighted" else mode
    rows = torch.randn(found.ids.numel(), 4, generator=g, dtype=dtype, requires_grad=True)
    ref_rows = rows.detach().clone().requires_grad_(True)
    out = pool(rows, found, offsets, op, weights)
    ref = F.embedding_bag(found.inverse, ref_rows, offsets, mode=op, per_sample_weights=weights)
    assert torch.equal(out, ref)
    grad = torch.randn(out.shape, generator=g, dtype=dtype)
    out.backward(grad)
    ref.backward(grad)
    torch.testing.assert_close(rows.grad, ref_rows.grad, rtol=0, atol=1e-12 if dtype == torch.float64 else 1e-5)


@pytest.mark.parametrize(("mode", "weighted", "other"), [("max", False, False), ("sum", True, False),
                                                         ("sum", False, True)])  # fmt: skip
def test_pool_leaves_what_it_does_not_cover_to_the_op(mode: str, weighted: bool, other: bool) -> None:
    ids = torch.tensor([3, 1, 3, 0])
    found, offsets = distinct(ids, 4), torch.tensor([0, 2])
    weights = torch.rand(4, requires_grad=True) if weighted else None  # learned weights need their own gradient
    assert pool(torch.randn(3, 2), found, offsets, mode, weights, other) is None


def test_pooled_rows_are_twice_differentiable() -> None:
    ids = torch.tensor([3, 1, 3, 3, 0])
    found, offsets = distinct(ids, 4), torch.tensor([0, 2, 2])
    rows = torch.randn(found.ids.numel(), 2, dtype=torch.float64, requires_grad=True)
    for mode in ("sum", "mean"):
        torch.autograd.gradcheck(lambda r, m=mode: pool(r, found, offsets, m, None), (rows,))
        torch.autograd.gradgradcheck(lambda r, m=mode: pool(r, found, offsets, m, None), (rows,))


@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_a_bag_lookup_of_fetched_rows_runs_no_second_sort_in_backward(mode: str) -> None:
    # Fetched rows (shards with no full slab here; other ranks' rows alike) were grouped by the
    # lookup's sort: their gradient is its segment sums, not torch's embedding_bag backward, which
    # sorts the ids again (a third of a distributed fused step's sorting).
    from shardvar.variables import functional

    v, ids, offsets = _loose(), torch.tensor([8, 1, 8, 3, 0, 1, 5]), torch.tensor([0, 3, 3, 5])
    plain = torch.zeros(9, 3)
    plain[0::2], plain[1::2] = v.variables[0].detach(), v.variables[1].detach()  # the logical table (mod)
    plain.requires_grad_(True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        functional.embedding_bag(v.store, ids, offsets, mode=mode).pow(2).sum().backward()
    ran = {e.name for e in prof.events()}
    assert not {n for n in ran if n.startswith("aten::_embedding_bag") and "backward" in n}, sorted(ran)
    F.embedding_bag(ids, plain, offsets, mode=mode).pow(2).sum().backward()
    got = torch.zeros(9, 3)
    got[0::2], got[1::2] = v.variables[0].grad, v.variables[1].grad
    torch.testing.assert_close(got, plain.grad, rtol=0, atol=1e-6)
