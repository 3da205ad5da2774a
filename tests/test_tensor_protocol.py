"""A ShardedVariable acts as its logical tensor to torch: reads, in-place writes, init, conversions."""

from __future__ import annotations

import inspect
import warnings

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import shardvar
from shardvar import Layout, ShardedVariable
from shardvar.variables import _values
from test_sharded_variable import to_numpy_key, variables

LAYOUTS = [Layout.div(10, 3), Layout.mod(10, 4), Layout.explicit([0, 6, 4]), Layout.div(10, 1)]


def pair(layout: Layout, shape=(10, 4), seed=0) -> tuple[ShardedVariable, torch.Tensor]:
    torch.manual_seed(seed)
    full = torch.randn(shape)
    return shardvar.shard_tensor(full.clone(), layout), full


# Every in-place initialiser in torch.nn.init, with arguments and a shape it accepts.
INITS = {
    "constant_": ((0.5,), (10, 4)),
    "dirac_": ((), (10, 4, 3)),
    "eye_": ((), (10, 4)),
    "kaiming_normal_": ((), (10, 4)),
    "kaiming_uniform_": ((), (10, 4)),
    "normal_": ((), (10, 4)),
    "ones_": ((), (10, 4)),
    "orthogonal_": ((), (10, 4)),
    "sparse_": ((0.5,), (10, 4)),
    "trunc_normal_": ((), (10, 4)),
    "uniform_": ((), (10, 4)),
    "xavier_normal_": ((), (10, 4)),
    "xavier_uniform_": ((), (10, 4)),
    "zeros_": ((), (10, 4)),
}


def test_the_init_table_lists_every_in_place_initialiser() -> None:
    public = {
        n for n, f in vars(nn.init).items() if n.endswith("_") and not n.startswith("_") and inspect.isfunction(f)
    }
    assert public == set(INITS)


@pytest.mark.parametrize("name", sorted(INITS))
@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_every_nn_init_writes_the_same_values_as_on_the_unsharded_tensor(name, layout) -> None:
    args, shape = INITS[name]
    v, full = pair(layout, shape)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # some initialisers read through ops with no shard-local form
        torch.manual_seed(7)
        returned = getattr(nn.init, name)(v, *args)
    torch.manual_seed(7)
    getattr(nn.init, name)(full, *args)
    assert returned is v
    torch.testing.assert_close(v.to_tensor(), full, atol=0, rtol=0)


IN_PLACE = {
    "add_": (1.5,),
    "sub_": (torch.ones(4),),
    "mul_": (2,),
    "div_": (4.0,),
    "clamp_": (-0.5, 0.5),
    "zero_": (),
    "fill_": (3.0,),
    "copy_": (torch.arange(40.0).reshape(10, 4),),
    "normal_": (),
    "uniform_": (-2, 2),
    "exp_": (),
    "abs_": (),
    "neg_": (),
    "pow_": (2,),
    "masked_fill_": (torch.arange(40).reshape(10, 4) % 3 == 0, -1.0),
    "lerp_": (torch.zeros(10, 4), 0.25),
    "sigmoid_": (),
    "tanh_": (),
    "nan_to_num_": (),
    "erfinv_": (),
}


@pytest.mark.parametrize("name", sorted(IN_PLACE))
@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_in_place_tensor_methods_write_through(name, layout) -> None:
    v, full = pair(layout)
    full = full.tanh()  # inside (-1, 1) so erfinv_ stays finite
    v.copy_(full)
    torch.manual_seed(3)
    assert getattr(v, name)(*IN_PLACE[name]) is v
    torch.manual_seed(3)
    getattr(full, name)(*IN_PLACE[name])
    torch.testing.assert_close(v.to_tensor(), full, atol=0, rtol=0, equal_nan=True)


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_in_place_functions_out_and_augmented_assignment_write_through(layout) -> None:
    v, full = pair(layout)
    torch.clamp_(v, max=0.1)
    torch.testing.assert_close(v.to_tensor(), full.clamp(max=0.1))
    assert torch.add(full, 1, out=v) is v
    torch.testing.assert_close(v.to_tensor(), full + 1)
    alias = v
    v += 1
    v *= 2
    assert v is alias
    torch.testing.assert_close(v.to_tensor(), (full + 2) * 2)
    v.data = full
    torch.testing.assert_close(v.to_tensor(), full)
    v.data.mul_(3)
    torch.testing.assert_close(v.to_tensor(), full * 3)


def test_a_failing_in_place_write_changes_nothing() -> None:
    v, _ = pair(Layout.mod(10, 4))
    ints = shardvar.shard_tensor(torch.arange(10), Layout.div(10, 3))
    before = v.to_tensor()
    small = shardvar.shard_tensor(torch.zeros(10, dtype=torch.uint8), Layout.div(10, 2))
    with pytest.raises(shardvar.ShardvarValueError, match=r"copy_ failed.*size of tensor.*nothing was written"):
        v.copy_(torch.ones(9, 4))
    with pytest.raises(
        shardvar.ShardvarValueError, match=r"value 300 is out of range for torch.uint8: expected \[0, 255\]"
    ):
        small.copy_(torch.full((10,), 300))
    with pytest.raises(shardvar.ShardvarTypeError, match="cannot be cast"):
        torch.add(torch.full((10,), 3.5), 0, out=small)
    with pytest.raises(shardvar.ShardvarValueError, match="add_ failed"):
        ints.add_(torch.ones(3))
    assert small.to_tensor().tolist() == [0] * 10
    torch.testing.assert_close(v.to_tensor(), before, atol=0, rtol=0)
    assert ints.to_tensor().tolist() == list(range(10))


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_shard_local_ops_never_build_the_table(layout, monkeypatch) -> None:
    v, full = pair(layout)

    def refuse(*args, **kwargs):
        raise AssertionError("the whole table was built")

    monkeypatch.setattr(_values, "materialise", refuse)
    x = torch.randn(3, 10)
    checks = [
        (torch.sum(v), full.sum()),
        (v.sum(0), full.sum(0)),
        (v.mean(dim=1, keepdim=True), full.mean(1, keepdim=True)),
        (torch.amax(v, 0), full.amax(0)),
        (v.max(), full.max()),
        (v.norm(), full.norm()),
        (torch.linalg.vector_norm(v, 1, dim=0), torch.linalg.vector_norm(full, 1, dim=0)),
        (x @ v, x @ full),
        (v @ torch.ones(4, 2), full @ torch.ones(4, 2)),
        (torch.nn.functional.linear(torch.randn(2, 4), v), None),
        (v * 2 + 1, full * 2 + 1),
        (torch.where(v > 0, v, torch.zeros(())), full.clamp(min=0)),
        ((v > 0).sum(), (full > 0).sum()),
    ]
    for got, want in checks:
        if want is not None:
            torch.testing.assert_close(got, want)


def test_other_ops_build_the_table_with_one_warning_per_op() -> None:
    v, full = pair(Layout.mod(10, 3))
    with pytest.warns(shardvar.ShardvarMaterializeWarning, match=r"cumsum .* to_tensor\(\)"):
        torch.testing.assert_close(torch.cumsum(v, 0), full.cumsum(0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.cumsum(v, 1)  # the same op again: no second warning


def test_conversions_give_the_logical_tensor() -> None:
    v, full = pair(Layout.mod(10, 3))
    assert torch.equal(torch.as_tensor(v), full) and torch.equal(torch.tensor(v), full)
    np.testing.assert_array_equal(np.asarray(v), full.numpy())
    assert len(v) == 10 and [r.tolist() for r in v] == full.tolist()
    assert torch.equal(v.to(torch.float64), full.double()) and v.float().dtype == torch.float32
    assert torch.equal(v.cpu(), full) and torch.equal(v.clone(), full) and torch.equal(v.detach(), full)
    assert torch.equal(v.T, full.T) and v.tolist() == full.tolist()
    d, _ = pair(Layout.div(10, 2))
    assert d.detach().data_ptr() == d.variables[0].data_ptr()  # a div slab is the table: no copy


def test_logical_gradient() -> None:
    layout = Layout.mod(10, 3)
    v = ShardedVariable([torch.zeros(n, 2, requires_grad=True) for n in layout.sizes], partition_strategy="mod")
    assert v.grad is None
    shardvar.embedding_lookup(v, torch.tensor([1, 1, 7])).sum().backward()
    want = torch.zeros(10, 2)
    want[1], want[7] = 2, 1
    torch.testing.assert_close(v.grad, want)


def test_from_pretrained_freeze_is_honoured() -> None:
    frozen = shardvar.ShardedEmbedding.from_pretrained(torch.randn(6, 2), partitioner=2)
    assert not any(p.requires_grad for p in frozen.parameters())
    trainable = shardvar.ShardedEmbedding.from_pretrained(torch.randn(6, 2), freeze=False, partitioner=2)
    assert all(p.requires_grad for p in trainable.parameters())
    emb = shardvar.ShardedEmbedding(6, 2, partitioner=3, partition_strategy="mod")
    new = torch.arange(12.0).reshape(6, 2)
    emb.weight.data = new
    torch.testing.assert_close(emb.weight.to_tensor(), new)
    nn.init.zeros_(emb.weight)
    assert emb.weight.to_tensor().abs().sum() == 0


@given(st.data())
@settings(max_examples=200, deadline=None)
def test_setitem_with_advanced_indices_on_several_axes_equals_numpy(data) -> None:
    # Ids on the sharded axis combined with ints or id lists on other axes (as nn.init.sparse_ writes).
    v, full = data.draw(variables(min_rows=1))
    shape = tuple(full.shape)
    parts = []
    for size in shape:
        parts.append(
            data.draw(
                st.one_of(
                    st.integers(-size, size - 1),
                    st.lists(st.integers(-size, size - 1), min_size=2, max_size=2),
                    st.just(slice(None)),
                )
            )
        )
    axis = v.layout.axis
    if not isinstance(parts[axis], list) or not any(
        isinstance(p, (int, list)) for j, p in enumerate(parts) if j != axis
    ):
        parts[axis] = data.draw(st.lists(st.integers(-shape[axis], shape[axis] - 1), min_size=2, max_size=2))
        parts[(axis + 1) % 3] = data.draw(st.integers(-shape[(axis + 1) % 3], shape[(axis + 1) % 3] - 1))
    key = tuple(parts)
    reference = full.numpy().copy()
    target_shape = reference[to_numpy_key(key)].shape
    locations = np.arange(reference.size).reshape(reference.shape)[to_numpy_key(key)]
    if len(set(locations.reshape(-1).tolist())) < locations.size:
        return  # numpy leaves the winner of a duplicated write unspecified
    value = np.arange(1000.0, 1000.0 + np.prod(target_shape)).reshape(target_shape)
    reference[to_numpy_key(key)] = value
    v[key] = torch.tensor(value, dtype=torch.float32)
    np.testing.assert_array_equal(v.numpy(), reference)
