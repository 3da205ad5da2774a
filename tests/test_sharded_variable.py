"""ShardedVariable against the unsharded tensor it stands for."""

from __future__ import annotations

from typing import ClassVar

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import shardvar
from shardvar import Layout, ShardedVariable, ShardvarError


@st.composite
def variables(draw, min_rows: int = 0):
    kind = draw(st.sampled_from(["div", "mod", "explicit", "ceil"]))
    axis = draw(st.integers(0, 2))
    n = draw(st.integers(1, 6))
    if kind == "explicit":
        sizes = draw(st.lists(st.integers(0, 6), min_size=1, max_size=6).filter(lambda s: sum(s) >= min_rows))
        layout = Layout.explicit(sizes, axis)
    else:
        layout = getattr(Layout, kind)(draw(st.integers(min_rows, 20)), n, axis)
    shape = [3, 2, 4]
    shape[axis] = layout.num_rows
    full = torch.arange(float(np.prod(shape))).reshape(shape)
    separate = draw(st.booleans())  # separately allocated shards, or one slab
    if separate:
        shards = [full.index_select(axis, layout.shard_ids(s)).clone() for s in range(layout.num_shards)]
        v = ShardedVariable(shards, partition_strategy=layout.strategy, axis=axis)
    else:
        v = shardvar.shard_tensor(full, layout)
    return v, full


def entry(size: int):
    return st.one_of(
        st.integers(-size, size - 1) if size else st.just(slice(None)),
        st.builds(
            slice,
            st.none() | st.integers(-30, 30),
            st.none() | st.integers(-30, 30),
            st.none() | st.sampled_from([-3, -2, -1, 1, 2, 5]),
        ),
        st.lists(st.integers(-size, size - 1), max_size=5) if size else st.just(slice(None)),
        st.lists(st.booleans(), min_size=size, max_size=size),
    )


@st.composite
def keys(draw, shape):
    parts = [draw(entry(d)) for d in shape]
    n_adv = sum(isinstance(p, list) for p in parts)
    if n_adv > 1:  # several index arrays must broadcast together; keep at most one
        first = next(i for i, p in enumerate(parts) if isinstance(p, list))
        parts = [p if i == first or not isinstance(p, list) else slice(None) for i, p in enumerate(parts)]
    form = draw(st.sampled_from(["full", "prefix", "ellipsis", "newaxis"]))
    if form == "prefix":
        parts = parts[: draw(st.integers(1, len(parts)))]
    elif form == "ellipsis":
        k = draw(st.integers(0, len(parts)))
        parts = [*parts[:k], Ellipsis, *parts[k + 1 :]] if k < len(parts) else [*parts, Ellipsis]
    elif form == "newaxis":
        parts.insert(draw(st.integers(0, len(parts))), None)
    return tuple(parts) if len(parts) > 1 or draw(st.booleans()) else parts[0]


def to_numpy_key(key):
    if isinstance(key, tuple):
        return tuple(to_numpy_key(k) for k in key)
    if isinstance(key, list):
        return np.asarray(key, dtype=bool if key and isinstance(key[0], bool) else np.int64)
    return key


@given(st.data())
@settings(max_examples=400, deadline=None)
def test_getitem_equals_numpy(data) -> None:
    v, full = data.draw(variables())
    key = data.draw(keys(tuple(full.shape)))
    try:
        expected = full.numpy()[to_numpy_key(key)]
    except IndexError:
        with pytest.raises(IndexError):
            v[key]
        return
    got = v[key]
    np.testing.assert_array_equal(np.asarray(got), expected)


@given(st.data())
@settings(max_examples=300, deadline=None)
def test_setitem_equals_numpy(data) -> None:
    v, full = data.draw(variables())
    axis = v.layout.axis
    shape = tuple(full.shape)
    # Assignment keys: on the sharded axis an int, slice, id list or mask; slices (or ints, without ids) elsewhere.
    axis_entry = data.draw(entry(shape[axis]))
    others_ints = not isinstance(axis_entry, list)
    parts = []
    for d, size in enumerate(shape):
        if d == axis:
            parts.append(axis_entry)
        else:
            choices = [
                st.builds(
                    slice,
                    st.none() | st.integers(-5, 5),
                    st.none() | st.integers(-5, 5),
                    st.sampled_from([None, -2, -1, 1, 2]),
                )
            ]
            if others_ints:
                choices.append(st.integers(-size, size - 1))
            parts.append(data.draw(st.one_of(*choices)))
    key = tuple(parts)
    reference = full.numpy().copy()
    try:
        target_shape = reference[to_numpy_key(key)].shape
    except IndexError:
        with pytest.raises(IndexError):
            v[key] = 0.0
        return
    value = np.arange(1000.0, 1000.0 + np.prod(target_shape)).reshape(target_shape)
    if isinstance(axis_entry, list) and len(set(np.arange(shape[axis])[axis_entry].tolist())) < len(axis_entry):
        return  # numpy leaves the winner of a duplicated write unspecified
    reference[to_numpy_key(key)] = value
    v[key] = torch.tensor(value, dtype=torch.float32)
    np.testing.assert_array_equal(v.numpy(), reference)


def reference_scatter(full: torch.Tensor, axis: int, op: str, ids: torch.Tensor, updates: torch.Tensor) -> torch.Tensor:
    out = full.movedim(axis, 0).clone()
    for i, u in zip(ids.tolist(), updates, strict=True):
        if op == "scatter_add":
            out[i] += u
        elif op == "scatter_sub":
            out[i] -= u
        elif op == "scatter_mul":
            out[i] *= u
        elif op == "scatter_div":
            out[i] /= u
        elif op == "scatter_min":
            out[i] = torch.minimum(out[i], u)
        elif op == "scatter_max":
            out[i] = torch.maximum(out[i], u)
        else:
            out[i] = u
    return out.movedim(0, axis)


OPS = ["scatter_add", "scatter_sub", "scatter_mul", "scatter_div", "scatter_min", "scatter_max", "scatter_update"]


@given(st.data(), st.sampled_from(OPS))
@settings(max_examples=300, deadline=None)
def test_scatter_ops_equal_the_unsharded_op(data, op) -> None:
    v, full = data.draw(variables(min_rows=1))
    axis, rows = v.layout.axis, v.layout.num_rows
    ids = torch.tensor(data.draw(st.lists(st.integers(0, rows - 1), max_size=8)), dtype=torch.int64)
    row_shape = [d for i, d in enumerate(full.shape) if i != axis]
    updates = torch.tensor(
        data.draw(
            st.lists(
                st.sampled_from([-2.0, 0.5, 1.5, 3.0, 4.0]),
                min_size=len(ids) * int(np.prod(row_shape)),
                max_size=len(ids) * int(np.prod(row_shape)),
            )
        )
    ).reshape(len(ids), *row_shape)
    getattr(v, op)(ids, updates)
    torch.testing.assert_close(v.to_tensor(), reference_scatter(full, axis, op, ids, updates))
    read = ids.flip(0)
    torch.testing.assert_close(v.sparse_read(read), v.to_tensor().movedim(axis, 0)[read])


@given(variables(), st.sampled_from(["assign", "assign_add", "assign_sub"]))
@settings(deadline=None)
def test_assign_ops(pair, op) -> None:
    v, full = pair
    value = torch.full(full.shape, 2.5)
    assert getattr(v, op)(value) is v
    expected = {"assign": value, "assign_add": full + value, "assign_sub": full - value}[op]
    torch.testing.assert_close(v.to_tensor(), expected)
    v.assign(7)  # broadcasting, as Tensor.copy_
    assert bool((v.to_tensor() == 7).all())


def test_acts_as_a_tensor() -> None:
    full = torch.arange(12.0).reshape(6, 2)
    v = shardvar.shard_tensor(full, Layout.mod(6, 4))
    torch.testing.assert_close(torch.sum(v), full.sum())
    torch.testing.assert_close(torch.matmul(v, torch.ones(2)), full @ torch.ones(2))
    torch.testing.assert_close(torch.ones(3, 6) @ v, torch.ones(3, 6) @ full)
    torch.testing.assert_close(v + 1, full + 1)
    torch.testing.assert_close(2 * v - v / 2, 2 * full - full / 2)
    assert torch.equal(v == full, torch.ones(6, 2, dtype=torch.bool))
    assert torch.equal(-v, -full) and torch.equal(v > 5, full > 5)
    torch.testing.assert_close(torch.nn.functional.linear(torch.ones(1, 2), v), torch.ones(1, 2) @ full.T)
    np.testing.assert_array_equal(np.asarray(v), full.numpy())
    np.testing.assert_array_equal(v.numpy(), full.numpy())
    assert v.shape == torch.Size([6, 2]) and v.dtype == torch.float32 and v.ndim == 2 and v.numel() == 12
    assert len(v.variables) == 4 and [s.shape[0] for s in v.variables] == [2, 2, 1, 1]  # len(v) is rows (issue 12)
    assert (
        repr(v) == "ShardedVariable(shape=[6, 2], dtype=torch.float32, layout=mod[2, 2, 1, 1]@axis0, devices=['cpu'])"
    )


def test_materialising_is_differentiable() -> None:
    shards = [torch.ones(2, 2, requires_grad=True), torch.ones(3, 2, requires_grad=True)]
    v = ShardedVariable(shards, partition_strategy="div")
    (v.to_tensor() * torch.arange(5.0).unsqueeze(1)).sum().backward()
    assert shards[1].grad[:, 0].tolist() == [2.0, 3.0, 4.0]
    v[torch.tensor([4, 0])].sum().backward()
    assert shards[0].grad[0, 0] == 1.0


class Poisoned(torch.Tensor):
    """A shard that fails on any read of its data: proves a key did not touch it."""

    ALLOWED: ClassVar[set[str]] = {
        "__get__",
        "dim",
        "size",
        "untyped_storage",
        "storage_offset",
        "is_contiguous",
        "__repr__",
        "__format__",
    }

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") not in cls.ALLOWED:
            raise AssertionError(f"shard was read: {func}")
        return super().__torch_function__(func, types, args, kwargs or {})


@pytest.mark.parametrize(
    "key",
    [
        slice(0, 4),
        3,
        -10,
        [1, 0, 3],
        slice(4, None, -1),
        (slice(0, 3), 1),
        (2, Ellipsis),
        (slice(1, 2), Ellipsis, None),
        torch.tensor([True, True, False, False, True] + [False] * 5),
    ],
)
def test_only_touched_shards_are_read(key) -> None:
    shards = [torch.arange(10.0).reshape(5, 2), torch.zeros(5, 2).as_subclass(Poisoned)]
    v = ShardedVariable(shards)
    np_key = key.numpy() if isinstance(key, torch.Tensor) else key
    expected = np.concatenate([np.arange(10.0).reshape(5, 2), np.zeros((5, 2))])[np_key]
    np.testing.assert_array_equal(v[key].as_subclass(torch.Tensor).numpy(), expected)
    v.scatter_add(torch.tensor([0, 4]), torch.ones(2, 2))
    v.sparse_read(torch.tensor([1]))


@pytest.mark.parametrize(
    "make, exc, match",
    [
        (lambda: ShardedVariable([]), TypeError, "non-empty list of tensors"),
        (lambda: ShardedVariable(torch.ones(2)), TypeError, "non-empty list of tensors"),
        (lambda: ShardedVariable([torch.ones(2), [1.0]]), TypeError, "got list at position 1"),
        (lambda: ShardedVariable([torch.ones(2), torch.ones(2, dtype=torch.int64)]), ValueError, "same dtype"),
        (lambda: ShardedVariable([torch.ones(2, 3), torch.ones(2, 4)]), ValueError, "same shape except along axis 0"),
        (lambda: ShardedVariable([torch.ones(2, 3), torch.ones(3)]), ValueError, "same number"),
        (
            lambda: ShardedVariable([torch.ones(2), torch.ones(3)], partition_strategy="mod"),
            ValueError,
            r"must have sizes \[3, 2\]",
        ),
        (lambda: ShardedVariable([torch.ones(2)], partition_strategy="round-robin"), ValueError, "unknown partition strategy"),
        (lambda: ShardedVariable([torch.ones(2)], axis=1), ValueError, "axis 1 is out of range"),
    ],
)
def test_constructor_errors(make, exc, match) -> None:
    with pytest.raises(exc, match=match):
        make()


def snapshot(v: ShardedVariable) -> list[torch.Tensor]:
    return [s.detach().clone() for s in v.variables]


@pytest.mark.parametrize(
    "act, exc, match",
    [
        (
            lambda v: v.scatter_add(torch.tensor([0, 10]), torch.ones(2, 2)),
            IndexError,
            r"ids must be in \[0, 10\); got 10 at position 1",
        ),
        (lambda v: v.scatter_update(torch.tensor([0, -1]), torch.ones(2, 2)), IndexError, "got -1"),
        (
            lambda v: v.scatter_max(torch.tensor([0, 1]), torch.ones(3, 2)),
            ValueError,
            r"updates of shape \[3, 2\] does not fit shape \[2, 2\]",
        ),
        (lambda v: v.scatter_add(torch.tensor([0.0]), torch.ones(1, 2)), TypeError, "integer tensor"),
        (
            lambda v: v.scatter_add(torch.tensor([0]), torch.ones(1, 2, dtype=torch.complex64)),
            TypeError,
            "cannot be cast",
        ),
        (lambda v: v.assign(torch.ones(9, 2)), ValueError, r"value of shape \[9, 2\] does not fit shape \[10, 2\]"),
        (lambda v: v.assign_add(torch.ones(10, 3)), ValueError, "does not fit"),
        (
            lambda v: v.__setitem__(slice(0, 3), torch.ones(2, 2)),
            ValueError,
            r"\[2, 2\] cannot be assigned to a selection of shape \[3, 2\]",
        ),
        (lambda v: v.__setitem__(12, 1.0), IndexError, "index 12 is out of bounds for axis 0 with size 10"),
        (lambda v: v.__setitem__([1, 11], 1.0), IndexError, "index 11 is out of bounds"),
        (lambda v: v.__setitem__((None, 1), 1.0), TypeError, "None"),
        (lambda v: v.__setitem__(slice(0, 2), torch.ones(2, 2, dtype=torch.float64) * 1j), TypeError, "lossy cast"),
        (lambda v: v[10], IndexError, "index 10 is out of bounds for axis 0 with size 10"),
        (lambda v: v[0, 0, 0], IndexError, "too many indices"),
        (lambda v: v[..., ...], IndexError, "single ellipsis"),
        (lambda v: v[1.5], TypeError, "unsupported index"),
        (lambda v: v.sparse_read([3, 10]), IndexError, "got 10 at position 1"),
        (lambda v: v.batch_scatter_update(torch.tensor([[0]]), torch.ones(1, 1, 2)), ValueError, "batched indices"),
    ],
)
@pytest.mark.parametrize("layout", [Layout.div(10, 3), Layout.mod(10, 4), Layout.explicit([0, 7, 3])])
def test_bad_input_changes_nothing(act, exc, match, layout) -> None:
    v = shardvar.shard_tensor(torch.arange(20.0).reshape(10, 2), layout)
    before = snapshot(v)
    with pytest.raises(exc, match=match) as info:
        act(v)
    assert isinstance(info.value, ShardvarError)
    for a, b in zip(before, v.variables, strict=True):
        assert torch.equal(a, b)


def test_duplicate_scatter_update_is_last_wins() -> None:
    v = shardvar.shard_tensor(torch.zeros(6, 1), Layout.mod(6, 4))
    v.scatter_update(torch.tensor([5, 1, 5, 5]), torch.tensor([[1.0], [2.0], [3.0], [4.0]]))
    assert v.numpy().reshape(-1).tolist() == [0, 2, 0, 0, 0, 4]


def test_batch_scatter_update() -> None:
    full = torch.zeros(2, 7, 3)
    v = shardvar.shard_tensor(full, Layout.mod(7, 3, axis=1))
    ids = torch.tensor([[0, 6], [3, 3]])
    updates = torch.arange(12.0).reshape(2, 2, 3)
    v.batch_scatter_update(ids, updates)
    full[0, 0], full[0, 6], full[1, 3] = updates[0, 0], updates[0, 1], updates[1, 1]
    torch.testing.assert_close(v.to_tensor(), full)
    w = shardvar.shard_tensor(torch.zeros(5, 2), Layout.div(5, 2))
    w.batch_scatter_update(torch.tensor([4, 0]), torch.ones(2, 2))
    assert w.numpy()[:, 0].tolist() == [1, 0, 0, 0, 1]


def test_shards_on_the_slab_share_memory_and_fall_back_when_not() -> None:
    # shardvar's own shards are one slab; shards the user allocated one by one are moved into one
    # (keeping their identity and values); views of someone else's tensor are left where they are.
    v = shardvar.shard_tensor(torch.arange(10.0).reshape(5, 2), Layout.mod(5, 2))
    assert v.store.full_slab is not None
    clones = [s.clone() for s in v.variables]
    w = ShardedVariable(clones, partition_strategy="mod")
    assert w.store.full_slab is not None and all(a is b for a, b in zip(w.variables, clones, strict=True))
    base = torch.arange(10.0).reshape(5, 2)
    tiled = ShardedVariable([base[0::2], base[1::2]], partition_strategy="mod")  # views tiling base row by row: base is the slab
    assert tiled.store.full_slab is not None and tiled.store.full_slab.data_ptr() == base.data_ptr()
    other = torch.arange(10.0).reshape(5, 2)
    x = ShardedVariable([base[0::2], other[1::2]], partition_strategy="mod")  # views of two tensors: read shard by shard
    assert x.store.full_slab is None
    ids = torch.tensor([4, 0, 3])
    torch.testing.assert_close(v.sparse_read(ids), w.sparse_read(ids))
    torch.testing.assert_close(v.sparse_read(ids), x.sparse_read(ids))
