"""Layout math against an unsharded tensor (property tests) and its error messages."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardvar import Layout, ShardvarError, ShardvarIndexError, ShardvarTypeError, ShardvarValueError
from shardvar.layout import Layout as LayoutAgain  # noqa: F401  (the layer imports on its own)
from shardvar.layout import ceil_sizes, intersect_progressions, normalise_axis


@st.composite
def layouts(draw, max_rows: int = 40, max_shards: int = 9) -> Layout:
    kind = draw(st.sampled_from(["div", "mod", "explicit", "ceil"]))
    axis = draw(st.integers(0, 2))
    n = draw(st.integers(1, max_shards))
    if kind == "explicit":
        return Layout.explicit(draw(st.lists(st.integers(0, 8), min_size=1, max_size=max_shards)), axis)
    rows = draw(st.integers(0, max_rows))
    return getattr(Layout, kind)(rows, n, axis)


def logical_and_shards(layout: Layout) -> tuple[torch.Tensor, list[torch.Tensor]]:
    shape = [2, 3, 2]
    shape.insert(layout.axis, layout.num_rows)
    shape = shape[:3]
    full = torch.arange(int(np.prod(shape)), dtype=torch.float64).reshape(shape)
    shards = [full.index_select(layout.axis, layout.shard_ids(s)) for s in range(layout.num_shards)]
    return full, shards


@given(layouts())
def test_shards_cover_every_row_once(layout: Layout) -> None:
    ids = torch.cat([layout.shard_ids(s) for s in range(layout.num_shards)])
    assert sorted(ids.tolist()) == list(range(layout.num_rows))
    assert [len(layout.shard_ids(s)) for s in range(layout.num_shards)] == list(layout.sizes)


@given(layouts(), st.data())
def test_locate_and_global_ids_are_inverse(layout: Layout, data: st.DataObject) -> None:
    if layout.num_rows == 0:
        return
    ids = torch.tensor(data.draw(st.lists(st.integers(0, layout.num_rows - 1), max_size=30)), dtype=torch.int64)
    shard, row = layout.locate(ids)
    assert torch.equal(layout.global_ids(shard, row), ids)
    for s, r, i in zip(shard.tolist(), row.tolist(), ids.tolist(), strict=True):
        assert layout.shard_ids(s)[r] == i
        assert 0 <= r < layout.sizes[s]


@given(layouts())
def test_shard_progressions_describe_shard_ids(layout: Layout) -> None:
    for s in range(layout.num_shards):
        start, step, count = layout.shard_progression(s)
        assert torch.equal(layout.shard_ids(s), start + step * torch.arange(count))


@given(layouts(), st.sampled_from([torch.int32, torch.int64]))
def test_storage_rows_written_in_place_or_into_a_buffer_equal_storage_rows(layout: Layout, dtype) -> None:
    ids = torch.randperm(layout.num_rows)  # every row, in some order
    want = layout.strategy.storage_rows(layout.sizes, ids)
    out = torch.full_like(ids, -7)  # into another buffer (int64: the no-scratch arithmetic where it applies)
    got = layout.strategy.storage_rows_into(layout.sizes, ids, out, torch.empty_like(ids))
    assert torch.equal(got, want) and got.data_ptr() == out.data_ptr()
    assert torch.equal(layout.strategy.storage_rows_into(layout.sizes, ids, torch.empty_like(ids)), want)  # no scratch
    rows = ids.to(dtype)  # in place, 32 bits where they fit
    got = layout.strategy.storage_rows_into(layout.sizes, rows, rows, torch.empty_like(rows))
    assert got.dtype == dtype and torch.equal(got.long(), want) and got.data_ptr() == rows.data_ptr()


@given(layouts())
def test_storage_rows_index_the_concatenated_shards(layout: Layout) -> None:
    stored = torch.cat([layout.shard_ids(s) for s in range(layout.num_shards)])
    ids = torch.arange(layout.num_rows)
    assert torch.equal(stored[layout.storage_rows(ids)], ids)


@given(layouts())
def test_locate_of_shard_ids_is_identity(layout: Layout) -> None:
    for s in range(layout.num_shards):
        shard, row = layout.locate(layout.shard_ids(s))
        assert (shard == s).all()
        assert torch.equal(row, torch.arange(layout.sizes[s]))


@given(layouts())
def test_locate_keeps_the_shape_of_ids(layout: Layout) -> None:
    if layout.num_rows == 0:
        return
    ids = torch.arange(layout.num_rows).repeat(2).reshape(2, -1)
    shard, row = layout.locate(ids)
    assert shard.shape == row.shape == ids.shape


@given(layouts())
def test_div_offsets_and_shapes(layout: Layout) -> None:
    full, shards = logical_and_shards(layout)
    assert [tuple(s.shape) for s in shards] == layout.shard_shapes(full.shape)
    if layout.strategy == "div":
        for s, off in enumerate(layout.offsets):
            assert torch.equal(layout.shard_ids(s), torch.arange(off, off + layout.sizes[s]))


bounds = st.one_of(st.none(), st.integers(-60, 60))


@given(layouts(), bounds, bounds, st.one_of(st.none(), st.integers(-7, 7).filter(bool)))
@settings(max_examples=400)
def test_slice_decomposition_equals_slicing_the_whole_tensor(layout, start, stop, step) -> None:
    full, shards = logical_and_shards(layout)
    key = slice(start, stop, step)
    plan = layout.decompose_slice(key)
    index = [slice(None)] * full.dim()
    index[layout.axis] = key
    expected = full.numpy()[tuple(index)]
    parts = []
    for piece in plan.pieces:
        local = [slice(None)] * full.dim()
        local[layout.axis] = piece.local_slice
        parts.append(shards[piece.shard].numpy()[tuple(local)])
        assert parts[-1].shape[layout.axis] == piece.count
    got_shape = list(expected.shape)
    if parts:
        cat = np.concatenate(parts, axis=layout.axis)
    else:
        cat = np.empty(got_shape)
    got = np.empty_like(cat)
    dest = [slice(None)] * full.dim()
    dest[layout.axis] = plan.positions().numpy()
    got[tuple(dest)] = cat
    assert plan.length == expected.shape[layout.axis]
    np.testing.assert_array_equal(got, expected)
    if layout.strategy == "div":
        assert plan.in_order
        np.testing.assert_array_equal(cat, expected)
    assert len({p.shard for p in plan.pieces}) == len(plan.pieces), "one piece per touched shard"


@given(layouts())
def test_repr_round_trips_and_layouts_are_hashable(layout: Layout) -> None:
    assert eval(repr(layout)) == layout
    assert hash(eval(repr(layout))) == hash(layout)
    assert layout.strategy in str(layout)


def test_uneven_rules() -> None:
    assert Layout.div(10, 4).sizes == (3, 3, 2, 2)
    assert Layout.mod(10, 4).sizes == (3, 3, 2, 2)
    assert Layout.ceil(10, 4).sizes == (3, 3, 3, 1)
    assert ceil_sizes(5, 4) == (2, 2, 1, 0)
    assert Layout.mod(10, 4).shard_ids(1).tolist() == [1, 5, 9]
    assert Layout("div", [1, 2]).sizes == (1, 2)


def test_layouts_are_frozen() -> None:
    layout = Layout.div(10, 2)
    with pytest.raises(AttributeError):
        layout.sizes = (5, 5)  # type: ignore[misc]


@pytest.mark.parametrize(
    "call, exc, match",
    [
        (
            lambda: Layout("hash", (1, 2)),
            ShardvarValueError,
            r"unknown partition strategy 'hash'; expected one of \['div', 'mod'\]",
        ),
        (lambda: Layout("mod", (1, 3)), ShardvarValueError, r"must have sizes \[2, 2\].*got \[1, 3\]"),
        (lambda: Layout("div", ()), ShardvarValueError, "at least one shard"),
        (lambda: Layout("div", (3, -1)), ShardvarValueError, r"shard sizes must be >= 0; got -1 at position 1"),
        (lambda: Layout("div", (3, 1.5)), ShardvarValueError, r"must be integers; got 1.5"),
        (lambda: Layout("div", "34"), ShardvarTypeError, "sequence of ints"),
        (lambda: Layout.div(10, 0), ShardvarValueError, "num_shards must be >= 1; got 0"),
        (lambda: Layout.div(10, 2, axis=-1), ShardvarValueError, "axis must be >= 0; got -1"),
        (
            lambda: Layout.div(10, 4).locate([0, 10]),
            ShardvarIndexError,
            r"ids must be in \[0, 10\); got 10 at position 1",
        ),
        (
            lambda: Layout.mod(10, 4).locate(torch.tensor([[0, 1], [-1, 2]])),
            ShardvarIndexError,
            r"got -1 at position \(1, 0\)",
        ),
        (
            lambda: Layout.div(10, 4).locate(torch.tensor([0.5])),
            ShardvarTypeError,
            "integer tensor; got dtype torch.float32",
        ),
        (lambda: Layout.div(10, 4).locate([1.0, 2.0]), ShardvarTypeError, "ids must be integers"),
        (lambda: Layout.div(10, 4).locate([True]), ShardvarTypeError, "booleans"),
        (lambda: Layout.div(10, 4).decompose_slice(slice(0, 5, 0)), ShardvarValueError, "step cannot be zero"),
        (lambda: Layout.div(10, 4).decompose_slice(slice("a", 5)), ShardvarTypeError, "slice bounds must be integers"),
        (
            lambda: Layout.div(10, 4).check_shape((9, 2)),
            ShardvarValueError,
            "covers 10 rows but shape \\[9, 2\\] has 9",
        ),
        (lambda: Layout.div(10, 4, axis=2).check_shape((10, 2)), ShardvarValueError, "axis 2 is out of range"),
        (lambda: Layout.div(10, 4).offsets and Layout.mod(10, 4).offsets, ShardvarValueError, "not contiguous"),
        (lambda: Layout.div(10, 4).global_ids([1], [3]), ShardvarIndexError, r"\[0, 3\) for shard 1; got 3"),
        (lambda: Layout.from_partitions((10, 4), (2, 2)), ShardvarValueError, "only one axis"),
        (lambda: Layout.from_partitions((3,), (4,)), ShardvarValueError, "into 4 shards; at most 3"),
        (lambda: normalise_axis(3, 2), ShardvarValueError, r"axis 3 is out of range .* expected \[-2, 2\)"),
    ],
)
def test_bad_input_is_refused_clearly(call, exc, match) -> None:
    with pytest.raises(exc, match=match) as info:
        call()
    assert isinstance(info.value, ShardvarError)


def test_errors_are_also_builtin_exceptions() -> None:
    with pytest.raises(IndexError):
        Layout.div(4, 2).locate([4])
    with pytest.raises(ValueError):
        Layout("nope", (1,))
    with pytest.raises(TypeError):
        Layout.div(4, 2).locate(torch.tensor([1.0]))


def test_from_partitions() -> None:
    assert Layout.from_partitions((6, 10), (1, 4)) == Layout("div", (3, 3, 2, 2), axis=1)
    assert Layout.from_partitions((6, 10), (1, 1)) == Layout("div", (6,), axis=0)
    assert Layout.from_partitions((7,), (3,), "mod") == Layout("mod", (3, 2, 2))


progressions = st.tuples(st.integers(-5, 30), st.integers(1, 7), st.integers(0, 12))


@given(progressions, progressions)
def test_intersect_progressions_equals_the_set_intersection(a, b) -> None:
    def members(p):
        return {p[0] + p[1] * i for i in range(p[2])}

    start, step, count = intersect_progressions(a, b)
    got = [start + step * i for i in range(count)]
    assert got == sorted(members(a) & members(b))
    assert step >= 1
