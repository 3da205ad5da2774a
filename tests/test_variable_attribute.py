"""A ShardedVariable assigned as a plain module attribute is tracked as nn.Parameter attributes are (issue 22, part 1).

Generated over every way a module meets its parameters (``parameters``, ``named_parameters``,
``state_dict`` / ``load_state_dict``, ``.to``, an optimizer built from ``module.parameters()``,
shardvar's checkpoint) x shards that are Parameters or plain tensors x every layout; and over
every way to drop it (``del``, reassignment to None, to another variable, to an nn.Parameter).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import shardvar
from shardvar import Layout, ShardedVariable

LAYOUTS = {"div": Layout.div(7, 3), "mod": Layout.mod(7, 3), "one": Layout.div(7, 1)}


def variable(layout: str, trainable: bool = True, seed: int = 0) -> ShardedVariable:
    table = torch.randn(7, 4, generator=torch.Generator().manual_seed(seed))
    v = shardvar.shard_tensor(table, LAYOUTS[layout])
    shards = [nn.Parameter(s.detach().clone()) if trainable else s.detach().clone() for s in v.variables]
    return ShardedVariable(shards, partition_strategy=v.layout.strategy)


class Holder(nn.Module):
    def __init__(self, v: ShardedVariable) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 2)
        self.v = v

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lin(shardvar.embedding_lookup(self.v, ids))


@pytest.fixture(params=sorted(LAYOUTS))
def layout(request) -> str:
    return request.param


def test_parameters_and_named_parameters_see_the_shards(layout) -> None:
    v = variable(layout)
    m = Holder(v)
    shards = v.variables
    assert all(any(p is s for p in m.parameters()) for s in shards)
    names = dict(m.named_parameters())
    assert [names[f"v.shard_{i}"] is s for i, s in enumerate(shards)] == [True] * len(shards)
    assert m.v is v and dict(m.named_modules())["v"] is v


def test_plain_tensor_shards_are_buffers(layout) -> None:
    v = variable(layout, trainable=False)
    m = Holder(v)
    assert not any(n.startswith("v.") for n, _ in m.named_parameters())
    assert [n for n, _ in m.named_buffers()] == [f"v.shard_{i}" for i in range(len(v.variables))]


@pytest.mark.parametrize("trainable", [True, False])
def test_state_dict_holds_one_logical_key_and_loads_either_form(layout, trainable) -> None:
    m = Holder(variable(layout, trainable))
    state = m.state_dict()
    assert list(state) == ["lin.weight", "lin.bias", "v"]
    torch.testing.assert_close(state["v"], m.v.to_tensor().detach())
    other = Holder(variable(layout, trainable, seed=1))
    assert not other.load_state_dict(state).missing_keys
    torch.testing.assert_close(other.v.to_tensor(), m.v.to_tensor())
    shardvar.nn.set_state_dict_form(m, "sharded")
    sharded = m.state_dict()
    assert [k for k in sharded if k.startswith("v")] == [f"v.shard_{i}" for i in range(len(m.v.variables))]
    third = Holder(variable(layout, trainable, seed=2))
    third.load_state_dict(sharded)
    torch.testing.assert_close(third.v.to_tensor(), m.v.to_tensor())


def test_state_dict_errors_name_the_key_and_leave_the_shards() -> None:
    m = Holder(variable("mod"))
    before = m.v.to_tensor().clone()
    missing = m.load_state_dict({"lin.weight": m.lin.weight, "lin.bias": m.lin.bias}, strict=False)
    assert missing.missing_keys == ["v"]
    with pytest.raises(RuntimeError, match=r"size mismatch for v: .*\[3, 4\]"):
        m.load_state_dict({**m.state_dict(), "v": torch.zeros(3, 4)})
    with pytest.raises(
        shardvar.ShardvarValueError, match=r"assign=True\) cannot replace the shards of the sharded parameter v;"
    ):
        m.load_state_dict(m.state_dict(), assign=True)
    torch.testing.assert_close(m.v.to_tensor(), before)


@pytest.mark.parametrize("trainable", [True, False])
def test_to_moves_and_converts_the_shards_and_the_variable_follows(layout, trainable) -> None:
    m = Holder(variable(layout, trainable))
    before = m.v.to_tensor().detach().double()
    v = m.v
    m.to(torch.float64)
    assert m.v is v and v.dtype == torch.float64 and all(s.dtype == torch.float64 for s in v.variables)
    torch.testing.assert_close(v.to_tensor().detach(), before)
    registered = dict(m.named_parameters()) | dict(m.named_buffers())
    assert all(registered[f"v.shard_{i}"] is s for i, s in enumerate(v.variables))
    m.to("meta")
    assert v.device.type == "meta"


def test_an_optimizer_from_module_parameters_trains_the_variable(layout) -> None:
    torch.manual_seed(0)
    m = Holder(variable(layout))
    reference = nn.Embedding.from_pretrained(m.v.to_tensor().detach().clone(), freeze=False)
    lin = copy.deepcopy(m.lin)
    opt = torch.optim.SGD(m.parameters(), lr=0.5)
    ref_opt = torch.optim.SGD([*reference.parameters(), *lin.parameters()], lr=0.5)
    ids = torch.tensor([[0, 6], [3, 3]])
    for _ in range(2):
        opt.zero_grad(), ref_opt.zero_grad()
        m(ids).square().sum().backward()
        lin(reference(ids)).square().sum().backward()
        opt.step(), ref_opt.step()
    torch.testing.assert_close(m.v.to_tensor(), reference.weight)


def test_shardvar_checkpoint_and_table_optimizers_see_one_variable(tmp_path) -> None:
    m = Holder(variable("div"))
    assert set(shardvar.sharded_parameters(m)) == {"v"}
    assert "v/step" in shardvar.optim.SGD(m, lr=0.1).sharded_variables()  # one table, not one per shard
    shardvar.save({"model": m}, tmp_path / "ckpt")
    other = Holder(variable("mod", seed=3))
    shardvar.load({"model": other}, tmp_path / "ckpt")  # restored into another layout
    torch.testing.assert_close(other.v.to_tensor(), m.v.to_tensor())


@pytest.mark.parametrize(
    "drop",
    [
        pytest.param(lambda m: delattr(m, "v"), id="del"),
        pytest.param(lambda m: setattr(m, "v", None), id="None"),
        pytest.param(lambda m: setattr(m, "v", variable("mod", seed=5)), id="another variable"),
        pytest.param(lambda m: setattr(m, "v", nn.Parameter(torch.zeros(7, 4))), id="a Parameter"),
    ],
)
def test_del_and_reassignment_deregister_the_shards(drop) -> None:
    old = variable("div")
    m = Holder(old)
    drop(m)
    assert not any(p is s for p in m.parameters() for s in old.variables)
    assert all(not k.startswith("v.shard") for k in m.state_dict())
    if isinstance(getattr(m, "v", None), ShardedVariable):
        assert m.v is not old and list(m.state_dict()) == ["lin.weight", "lin.bias", "v"]


def test_a_plain_tensor_cannot_replace_it_as_it_cannot_replace_a_parameter() -> None:
    m = Holder(variable("div"))
    with pytest.raises(TypeError, match=r"cannot assign 'torch\.FloatTensor' as child module 'v'"):
        m.v = torch.zeros(7, 4)


def test_variables_made_by_modules_are_not_registered_anywhere() -> None:
    emb = shardvar.ShardedEmbedding(7, 4, partitioner=3)
    assert [n for n, _ in emb.named_parameters()] == ["shard_0", "shard_1", "shard_2"]
    assert list(emb.state_dict()) == ["weight"]


@pytest.mark.parametrize(
    "read",
    [
        lambda v: v.half(),
        lambda v: v.float(),
        lambda v: v.double(),
        lambda v: v.bfloat16(),
        lambda v: v.type(torch.float64),
        lambda v: v.to(torch.float64),
        lambda v: v.cpu(),
    ],
    ids=["half", "float", "double", "bfloat16", "type", "to", "cpu"],
)
def test_tensor_conversions_of_a_variable_read_and_never_convert_it(read) -> None:
    """A variable is also a module, but its tensor methods stay Tensor's: new tensors, the shards untouched."""
    v = variable("mod")
    m = Holder(v)
    shards = [s.detach().clone() for s in v.variables]
    out = read(v)
    assert isinstance(out, torch.Tensor) and not isinstance(out, ShardedVariable)
    torch.testing.assert_close(out.float(), v.to_tensor().detach().float(), atol=1e-2, rtol=1e-2)
    assert v.dtype == torch.float32 and all(torch.equal(a, b) for a, b in zip(shards, v.variables, strict=True))
    assert m.v is v
