"""shard_parameter and ShardedLinear against nn.Linear: outputs, gradients, state_dict, ties, errors."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import shardvar
from shardvar import Layout, ShardedVariable
from shardvar.nn import ShardedLinear, set_state_dict_form, shard_parameter, sharded_parameters

OUT, IN = 7, 5


@st.composite
def layouts(draw) -> Layout:
    axis = draw(st.sampled_from([0, 1]))
    rows = (OUT, IN)[axis]
    n = draw(st.integers(1, 5))
    return Layout.balanced(draw(st.sampled_from(["div", "mod"])), rows, min(n, rows), axis)


def sharded_twin(kind: str, layout: Layout) -> tuple[nn.Linear, nn.Module]:
    torch.manual_seed(0)
    ref = nn.Linear(IN, OUT)
    if kind == "linear":
        return ref, ShardedLinear.from_linear(copy.deepcopy(ref), layout, layout.strategy)
    model = copy.deepcopy(ref)
    shard_parameter(model, "weight", layout)
    return ref, model


def shard_grads(variable: ShardedVariable) -> torch.Tensor:
    return variable.layout.join([t.grad for t in variable.variables])


@settings(max_examples=30, deadline=None)
@given(layouts(), st.sampled_from(["param", "linear"]))
def test_outputs_grads_and_state_dict_equal_nn_linear(layout, kind) -> None:
    if kind == "linear" and layout.axis == 1:
        layout = Layout(layout.strategy, Layout.balanced(layout.strategy, OUT, layout.num_shards).sizes, 0)
    ref, model = sharded_twin(kind, layout)
    x = torch.randn(3, 2, IN)
    torch.testing.assert_close(model(x), ref(x))
    (model(x) * torch.arange(OUT.__float__())).sum().backward()
    (ref(x) * torch.arange(OUT.__float__())).sum().backward()
    torch.testing.assert_close(shard_grads(sharded_parameters(model)["weight"]), ref.weight.grad)
    torch.testing.assert_close(model.bias.grad, ref.bias.grad)
    state, ref_state = model.state_dict(), ref.state_dict()
    assert list(state) == list(ref_state) == ["weight", "bias"]
    for k in state:
        torch.testing.assert_close(state[k], ref_state[k])


@settings(max_examples=20, deadline=None)
@given(layouts(), layouts())
def test_load_state_dict_in_every_direction(a, b) -> None:
    ref, first = sharded_twin("param", a)
    _, second = sharded_twin("param", b)
    with torch.no_grad():
        second.weight = torch.zeros(OUT, IN)
    second.load_state_dict(first.state_dict())  # sharded -> sharded, another layout
    torch.testing.assert_close(second.weight, ref.weight)
    stock = nn.Linear(IN, OUT)
    stock.load_state_dict(second.state_dict())  # sharded -> stock
    torch.testing.assert_close(stock.weight, ref.weight)
    first.weight = torch.ones(OUT, IN)
    first.load_state_dict(stock.state_dict())  # stock -> sharded
    torch.testing.assert_close(first(torch.ones(2, IN)), ref(torch.ones(2, IN)))


@pytest.mark.parametrize("kind", ["param", "linear"])
def test_per_shard_form_is_opt_in_and_loads_either_way(kind) -> None:
    ref, model = sharded_twin(kind, Layout.mod(OUT, 3))
    set_state_dict_form(model, "sharded")
    state = model.state_dict()
    assert "weight" not in state and len([k for k in state if k != "bias"]) == 3
    _, other = sharded_twin(kind, Layout.mod(OUT, 3))
    other.weight = torch.zeros(OUT, IN) if kind == "param" else other.weight
    other.load_state_dict(state)
    torch.testing.assert_close(sharded_parameters(other)["weight"].to_tensor(), ref.weight)
    set_state_dict_form(model, "logical")
    assert list(model.state_dict()) == ["weight", "bias"]
    with pytest.raises(ValueError, match=r"form must be one of.*got 'whole'"):
        set_state_dict_form(model, "whole")


@pytest.mark.parametrize("kind", ["param", "linear"])
def test_state_dict_loads_with_weights_only(kind) -> None:
    ref, model = sharded_twin(kind, Layout.mod(OUT, 2))
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    stock = nn.Linear(IN, OUT)
    stock.load_state_dict(loaded)
    torch.testing.assert_close(stock.weight, ref.weight)


@pytest.mark.parametrize("kind", ["param", "linear"])
def test_load_errors_are_clear(kind) -> None:
    _, model = sharded_twin(kind, Layout.div(OUT, 2))
    with pytest.raises(RuntimeError, match=r"size mismatch for weight: copying a param with shape \[3, 5\]"):
        model.load_state_dict({"weight": torch.zeros(3, IN), "bias": torch.zeros(OUT)})
    with pytest.raises(RuntimeError, match=r"Missing key\(s\) in state_dict: \"weight\""):
        model.load_state_dict({"bias": torch.zeros(OUT)})
    with pytest.raises(ValueError, match=r"assign=True\) cannot replace the shards of the sharded parameter weight"):
        model.load_state_dict(nn.Linear(IN, OUT).state_dict(), assign=True)


def test_an_embedding_refuses_assign_too_so_its_ties_hold() -> None:
    emb = shardvar.ShardedEmbedding(OUT, IN, partitioner=2)
    head = ShardedLinear(IN, OUT, bias=False, weight=emb.weight)
    with pytest.raises(ValueError, match=r"assign=True\) cannot replace the shards of the sharded parameter weight"):
        emb.load_state_dict(nn.Embedding(OUT, IN).state_dict(), assign=True)
    assert list(emb.parameters()) == list(head.parameters())


def test_shard_parameter_refusals_are_pinned() -> None:
    fc = nn.Linear(IN, OUT)
    with pytest.raises(ValueError, match=r"Linear has no parameter 'scale'; expected one of \['bias', 'weight'\]"):
        shard_parameter(fc, "scale", 2)
    with pytest.raises(ValueError, match=r"name must be a parameter of the module itself.*got '0.weight'"):
        shard_parameter(nn.Sequential(fc), "0.weight", 2)
    shard_parameter(fc, "weight", 2)
    with pytest.raises(ValueError, match=r"Linear.weight is already partitioned"):
        shard_parameter(fc, "weight", 2)
    with pytest.raises(ValueError, match=r"cannot tie Linear.weight of shape \[3, 5\].*shape \[7, 5\]"):
        shard_parameter(nn.Linear(IN, 3), "weight", sharded_parameters(fc)["weight"])
    with pytest.raises(ValueError, match=r"does not fit shape \[7, 5\]"):
        fc.weight = torch.zeros(2, 2)


@pytest.mark.parametrize("layout", [Layout.div(OUT, 3), Layout.mod(OUT, 2), Layout.div(IN, 2, axis=1)])
def test_tied_users_train_as_one(layout) -> None:
    torch.manual_seed(0)
    ref_a, ref_b = nn.Linear(IN, OUT), nn.Linear(IN, OUT)
    ref_b.weight = ref_a.weight
    a, b = copy.deepcopy(ref_a), copy.deepcopy(ref_b)
    b.weight = a.weight
    variable = shard_parameter(a, "weight", layout)
    shard_parameter(b, "weight", variable)
    assert sharded_parameters(b)["weight"].variables == variable.variables
    params = [*variable.variables, a.bias, b.bias]
    opt, ref_opt = torch.optim.SGD(params, lr=0.1), torch.optim.SGD([*ref_a.parameters(), ref_b.bias], lr=0.1)
    for step in range(3):
        x = torch.randn(4, IN, generator=torch.Generator().manual_seed(step))
        for m1, m2, o in ((a, b, opt), (ref_a, ref_b, ref_opt)):
            o.zero_grad()
            (m1(x) * m2(x)).sum().backward()
            o.step()
    torch.testing.assert_close(a.weight, ref_a.weight)
    torch.testing.assert_close(b.weight, ref_a.weight)
    a.weight = torch.zeros(OUT, IN)  # assignment writes through to every tied user
    assert b.weight.abs().sum() == 0


def test_sharded_linear_ties_an_embedding_table_and_keeps_the_bias_object() -> None:
    emb = shardvar.ShardedEmbedding(OUT, IN, partitioner=3, partition_strategy="mod")
    head = ShardedLinear(IN, OUT, bias=False, weight=emb.weight)
    assert list(head.parameters()) == list(emb.parameters())
    x = torch.randn(2, IN)
    torch.testing.assert_close(head(x), x @ emb.weight.to_tensor().T)
    linear = nn.Linear(IN, OUT)
    assert ShardedLinear.from_linear(linear, 2).bias is linear.bias
    with pytest.raises(TypeError, match=r"cannot replace the sharded weight of ShardedLinear with Tensor"):
        head.weight = torch.zeros(OUT, IN)
    with pytest.raises(ValueError, match=r"split by output features \(axis 0\)"):
        ShardedLinear(IN, OUT, weight=shardvar.shard_tensor(torch.zeros(OUT, IN), Layout.div(IN, 2, axis=1)))


def test_initial_values_are_drawn_as_nn_linear_draws_them() -> None:
    for bias in (True, False):
        torch.manual_seed(3)
        ref = nn.Linear(IN, OUT, bias=bias)
        after = torch.rand(1)
        torch.manual_seed(3)
        model = ShardedLinear(IN, OUT, bias=bias, partitioner=3, partition_strategy="mod")
        assert torch.equal(torch.rand(1), after)
        torch.testing.assert_close(model.weight.to_tensor(), ref.weight.detach())
        assert list(model.state_dict()) == list(ref.state_dict())


def test_storage_order_slab_and_unslabbed_shards_give_nn_linear_outputs() -> None:
    torch.manual_seed(0)
    ref = nn.Linear(IN, OUT)
    layout = Layout.mod(OUT, 3)
    storage = torch.cat(layout.split(ref.weight.detach())).clone()  # mod shards one after another
    shards = [nn.Parameter(p) for p in storage.split(list(layout.sizes))]
    variable = ShardedVariable(shards, "mod")
    assert variable.store.full_slab is not None and not variable.store.logical_slab
    head = ShardedLinear(IN, OUT, bias=ref.bias, weight=variable)
    x = torch.randn(4, IN)
    torch.testing.assert_close(head(x), ref(x))
    apart = [nn.Parameter(p.clone()) for p in layout.split(ref.weight.detach())]
    loose = ShardedVariable.from_store(
        shardvar.variables.ShardStore(layout, (OUT, IN), dict(enumerate(apart)), adopt=False)
    )
    assert loose.store.full_slab is None
    head = ShardedLinear(IN, OUT, bias=ref.bias, weight=loose)
    torch.testing.assert_close(head(x), ref(x))
    head(x).sum().backward()
    ref(x).sum().backward()
    torch.testing.assert_close(shard_grads(loose), ref.weight.grad)


@pytest.mark.parametrize("kind", ["param", "linear"])
def test_deepcopy_and_dtype_conversions_keep_the_shards_working(kind) -> None:
    ref, model = sharded_twin(kind, Layout.div(OUT, 3))
    clone = copy.deepcopy(model)
    x = torch.randn(2, IN)
    torch.testing.assert_close(clone(x), ref(x))
    clone.weight = torch.zeros(OUT, IN) if kind == "param" else clone.weight
    torch.testing.assert_close(model(x), ref(x))  # the copy's shards are its own
    model.double()
    torch.testing.assert_close(model(x.double()), ref.double()(x.double()))
    assert sharded_parameters(model)["weight"].dtype == torch.float64
    model.half()
    assert model.state_dict()["weight"].dtype == torch.float16


def test_a_variable_built_outside_a_module_becomes_its_parameter_under_a_new_name() -> None:
    v = shardvar.ShardedVariable([nn.Parameter(torch.randn(3, 2)), nn.Parameter(torch.randn(2, 2))], partition_strategy="mod")
    m = nn.Module()
    shardvar.shard_parameter(m, "table", v)
    assert [id(p) for p in m.parameters()] == [id(p) for p in v.variables]
    assert list(m.state_dict()) == ["table"] and torch.equal(m.table, v.to_tensor())
    m.table.pow(2).sum().backward()
    torch.testing.assert_close(v.variables[0].grad, 2 * v.variables[0].detach())
    with pytest.raises(TypeError, match=r"must be nn\.Parameters"):
        shardvar.shard_parameter(nn.Module(), "x", shardvar.ShardedVariable([torch.randn(3, 2)]))
    taken = nn.Module()
    taken.x = 3
    with pytest.raises(ValueError, match="already has an attribute 'x'"):
        shardvar.shard_parameter(taken, "x", v)
