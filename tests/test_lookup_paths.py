"""Every lookup path equals the unsharded torch op: shardvar's slabs, user-allocated shards (moved
into one slab), views that must stay where they are (read shard by shard), one shard, and bags;
and on every path a bad id or bad offsets raise shardvar's error and change nothing."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import shardvar
from shardvar import Layout, ShardedVariable


@st.composite
def tables(draw, dtypes=(torch.float64,)):
    rows = draw(st.integers(1, 40))
    n = draw(st.integers(1, min(rows, 9)))
    strategy = draw(st.sampled_from(["div", "mod"]))
    layout = Layout.balanced(strategy, rows, n)
    full = torch.randn(rows, 3, dtype=draw(st.sampled_from(dtypes)))
    kind = draw(st.sampled_from(["slab", "user", "views"]))
    if kind == "slab":
        v = shardvar.shard_tensor(full, layout, requires_grad=True)
    elif kind == "user":  # allocated one by one: moved into one slab, identity kept
        shards = [torch.nn.Parameter(p.clone()) for p in layout.split(full)]
        v = ShardedVariable(shards, partition_strategy=strategy)
        assert all(a is b for a, b in zip(v.variables, shards, strict=True))
    else:  # views of someone else's tensor: never moved, read shard by shard
        base = full.clone().requires_grad_()
        v = ShardedVariable([p for p in layout.split(base)], partition_strategy=strategy)
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

    from shardvar.variables._plan import _member

    starts = torch.tensor([0, *itertools.accumulate(sizes)][:-1])
    rows = torch.arange(sum(sizes))
    want = torch.bucketize(rows, starts[1:], right=True)
    assert torch.equal(_member(rows, sizes, starts), want)
    balanced = [len(sizes) + 3] * 2 + [len(sizes) + 2] * len(sizes)  # the div layouts' shape, forced
    starts = torch.tensor([0, *itertools.accumulate(balanced)][:-1])
    rows = torch.arange(sum(balanced))
    assert torch.equal(_member(rows, balanced, starts), torch.bucketize(rows, starts[1:], right=True))


def _bag_call(data, v, rows: int, ids: list[int]):
    """A bag lookup of ``ids`` with options drawn: mode, 1-D with offsets or 2-D, padding, weights."""
    mode = data.draw(st.sampled_from(["sum", "mean", "max"]))
    kwargs = {"mode": mode, "padding_idx": data.draw(st.none() | st.integers(0, rows - 1))}
    if data.draw(st.booleans()) and len(ids) % 2 == 0:
        t, offsets = torch.tensor(ids).reshape(2, -1), None  # fixed-size bags, one per row
    else:
        t = torch.tensor(ids)
        cut = sorted(data.draw(st.lists(st.integers(0, len(ids)), max_size=3)))
        kwargs["include_last_offset"] = data.draw(st.booleans())
        offsets = torch.tensor([0, *cut, *([len(ids)] if kwargs["include_last_offset"] else [])])
    if mode == "sum" and data.draw(st.booleans()):
        kwargs["per_sample_weights"] = torch.rand(t.shape, dtype=v.dtype)
    return lambda: shardvar.embedding_bag(v, t, offsets, **kwargs), t


@given(tables(dtypes=(torch.float32, torch.float64, torch.bfloat16)), st.data())
@settings(max_examples=200, deadline=None)
def test_a_bad_id_in_a_lookup_or_bag_is_named_and_changes_nothing(table, data) -> None:
    """Checked up front, or (valid-looking div slabs on the CPU) only once the torch op refuses it:
    the same error, naming the first bad id and its position, either way."""
    v, full, kind = table
    rows = full.shape[0]
    ids = data.draw(st.lists(st.integers(0, rows - 1), min_size=1, max_size=10))
    for _ in range(data.draw(st.integers(1, 2))):
        bad = data.draw(st.sampled_from([rows, rows + 5, -1, -rows - 1, 2**40]))
        ids.insert(data.draw(st.integers(0, len(ids))), bad)
    if data.draw(st.booleans()):
        call, t = _bag_call(data, v, rows, ids)
    else:  # a plain lookup, 1-D or 2-D
        t = torch.tensor(ids)
        t = t.reshape(2, -1) if len(ids) % 2 == 0 and data.draw(st.booleans()) else t
        padding_idx = data.draw(st.none() | st.integers(0, rows - 1))
        call = lambda: shardvar.variables.functional.embedding(v.store, t, padding_idx=padding_idx)  # noqa: E731
    flat = int(torch.nonzero((t.reshape(-1) < 0) | (t.reshape(-1) >= rows))[0])
    position = flat if t.dim() == 1 else tuple(divmod(flat, t.shape[1]))
    before = [p.detach().clone() for p in v.variables]
    expected = re.escape(f"got {int(t.reshape(-1)[flat])} at position {position}")
    with torch.set_grad_enabled(data.draw(st.booleans())), pytest.raises(shardvar.ShardvarIndexError, match=expected):
        call()
    assert all(torch.equal(a, b.detach()) for a, b in zip(before, v.variables, strict=True))
    assert all(p.grad is None for p in ([full] if kind == "views" else v.variables))  # the leaves


@pytest.mark.parametrize("strategy", ["div", "mod"])
@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(
    "offsets, last, match",
    [
        ([1, 3], False, "start at 0"),
        ([0, 4, 2], False, "non-decreasing"),  # read as [0, 2, 4] by some kernels, refused by none
        ([0, 3, 3, 2, 6], True, "non-decreasing"),
        ([0, 2, 7], False, r"at most len\(input\)=6"),
        ([0, -2, 4], False, "non-decreasing"),
        ([0, 2, 4], True, r"last offset must equal len\(input\)=6; got 4"),
    ],
)
def test_bad_offsets_are_refused_before_any_read(strategy, mode, dtype, offsets, last, match) -> None:
    v = shardvar.shard_tensor(torch.randn(10, 3, dtype=dtype), Layout.balanced(strategy, 10, 3), requires_grad=True)
    before = [p.detach().clone() for p in v.variables]
    for padding_idx in (None, 1):
        with pytest.raises(shardvar.ShardvarValueError, match=match):
            shardvar.embedding_bag(
                v, torch.tensor([1, 2, 3, 4, 5, 6]), torch.tensor(offsets), mode=mode, padding_idx=padding_idx,
                include_last_offset=last,
            )  # fmt: skip
    assert all(torch.equal(a, b.detach()) for a, b in zip(before, v.variables, strict=True))
    assert all(p.grad is None for p in v.variables)


def test_valid_ids_of_a_div_slab_are_read_once_by_the_op(monkeypatch) -> None:
    """The CPU op checks ids into a div slab itself: shardvar scans them only when it refuses one.
    Into a mod slab (storage rows, where a bad id can land on a good row) or with max_norm
    (renormalised before the op reads) they are checked first."""
    from shardvar.layout import check_ids
    from shardvar.variables import _functional

    scanned = []
    monkeypatch.setattr(_functional, "check_ids", lambda ids, n: scanned.append(n) or check_ids(ids, n))
    full = torch.randn(12, 3)
    ids, offsets = torch.tensor([0, 11, 5, 5, 2]), torch.tensor([0, 2])
    for strategy, max_norm, want in [("div", None, []), ("mod", None, [12]), ("div", 1.0, [12])]:
        scanned.clear()
        v = shardvar.shard_tensor(full, Layout.balanced(strategy, 12, 4))
        got = _functional.embedding_bag(v.store, ids, offsets, mode="sum", max_norm=max_norm)
        torch.testing.assert_close(got, F.embedding_bag(ids, full.clone(), offsets, mode="sum", max_norm=max_norm))
        got = _functional.embedding(v.store, ids, max_norm=max_norm)
        torch.testing.assert_close(got, F.embedding(ids, full.clone(), max_norm=max_norm))
        assert scanned == want * 2, (strategy, max_norm, scanned)
