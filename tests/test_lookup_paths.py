"""Every lookup path equals the unsharded torch op: shardvar's slabs, user-allocated shards (moved
into one slab), views that must stay where they are (read shard by shard), one shard, and bags."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import shardvar
from shardvar import Layout, ShardedVariable


@st.composite
def tables(draw):
    rows = draw(st.integers(1, 40))
    n = draw(st.integers(1, min(rows, 9)))
    strategy = draw(st.sampled_from(["div", "mod"]))
    layout = Layout.balanced(strategy, rows, n)
    full = torch.randn(rows, 3, dtype=torch.float64)
    kind = draw(st.sampled_from(["slab", "user", "views"]))
    if kind == "slab":
        v = shardvar.shard_tensor(full, layout, requires_grad=True)
    elif kind == "user":  # allocated one by one: moved into one slab, identity kept
        shards = [torch.nn.Parameter(p.clone()) for p in layout.split(full)]
        v = ShardedVariable(shards, strategy=strategy)
        assert all(a is b for a, b in zip(v.variables, shards, strict=True))
    else:  # views of someone else's tensor: never moved, read shard by shard
        base = full.clone().requires_grad_()
        v = ShardedVariable([p for p in layout.split(base)], strategy=strategy)
        full = base
    return v, full, kind


@given(tables(), st.data())
@settings(max_examples=150, deadline=None)
def test_lookups_and_bags_equal_the_unsharded_ops(table, data) -> None:
    v, full, kind = table
    rows = full.shape[0]
    ids = torch.tensor(data.draw(st.lists(st.integers(0, rows - 1), min_size=1, max_size=12)))
    reference = full.detach()
    torch.testing.assert_close(shardvar.embedding_lookup(v, ids), F.embedding(ids, reference))
    mode = data.draw(st.sampled_from(["sum", "mean", "max"]))
    cut = sorted(data.draw(st.lists(st.integers(0, len(ids)), min_size=1, max_size=4)))
    offsets = torch.tensor([0, *cut])
    padding = data.draw(st.none() | st.integers(0, rows - 1))
    weights = torch.rand(len(ids), dtype=torch.float64) if mode == "sum" and data.draw(st.booleans()) else None
    got = shardvar.variables.functional.embedding_bag(
        v.store, ids, offsets, mode=mode, per_sample_weights=weights, padding_idx=padding
    )
    want = F.embedding_bag(ids, reference, offsets, mode=mode, per_sample_weights=weights, padding_idx=padding)
    torch.testing.assert_close(got, want)
    if kind != "views":
        # gradients reach exactly the rows read, as for the unsharded table
        got.sum().backward()
        leaf = reference.clone().requires_grad_()
        F.embedding_bag(ids, leaf, offsets, mode=mode, per_sample_weights=weights, padding_idx=padding).sum().backward()
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in v.variables]
        torch.testing.assert_close(v.layout.join(grads), leaf.grad)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 9), min_size=1, max_size=9))
def test_the_member_holding_each_row_of_a_slab(sizes: list[int]) -> None:
    """The division shortcut for balanced sizes agrees with a binary search, for any sizes."""
    import itertools

    from shardvar.variables._store import _member

    starts = torch.tensor([0, *itertools.accumulate(sizes)][:-1])
    rows = torch.arange(sum(sizes))
    want = torch.bucketize(rows, starts[1:], right=True)
    assert torch.equal(_member(rows, sizes, starts), want)
    balanced = [len(sizes) + 3] * 2 + [len(sizes) + 2] * len(sizes)  # the div layouts' shape, forced
    starts = torch.tensor([0, *itertools.accumulate(balanced)][:-1])
    rows = torch.arange(sum(balanced))
    assert torch.equal(_member(rows, balanced, starts), torch.bucketize(rows, starts[1:], right=True))
