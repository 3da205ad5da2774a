"""partition_model on a GPT-shaped model whose output head is tied to its embedding table.

One set of shards serves both users, whichever tied name the strategy uses; training, optimizer
rebuilding and logical checkpoints (into other layouts and the stock model) match the unsharded twin.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from torch import nn

import shardvar
from shardvar import Layout, ShardedVariable, sharded_parameters
from shardvar.transform import PartitionSpec, partition_model

VOCAB, DIM = 23, 8


class TinyGPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, DIM)
        self.fc = nn.Linear(DIM, DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.wte.weight  # tied, as GPT-2's lm_head and wte

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.fc(self.wte(ids))))


STRATEGIES = {
    "wte": {"wte.weight": 3},
    "head-mod": {"head.weight": PartitionSpec(4, "mod")},
    "both": {"wte.weight": "2,1", "head.weight": "2,1"},
    "axis1": {"head.weight": "1,2"},
    "with-fc": {"*.weight": PartitionSpec(2, "mod"), "fc.bias": 2},
}


def model_and_twin() -> tuple[TinyGPT, TinyGPT]:
    torch.manual_seed(0)
    model = TinyGPT()
    return model, copy.deepcopy(model)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randint(0, VOCAB, (4, 5), generator=g), torch.randint(0, VOCAB, (4, 5), generator=g)


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: range) -> None:
    for step in steps:
        ids, target = batch(step)
        loss = nn.functional.cross_entropy(model(ids).flatten(0, 1), target.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()


def logical_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_same_model(model: nn.Module, reference: nn.Module) -> None:
    ids = batch(99)[0]
    torch.testing.assert_close(model(ids), reference(ids), atol=1e-6, rtol=0)
    state, ref_state = logical_weights(model), logical_weights(reference)
    assert list(state) == list(ref_state)
    for k in state:
        torch.testing.assert_close(state[k], ref_state[k], atol=1e-6, rtol=0)


@pytest.mark.parametrize("strategy", STRATEGIES.values(), ids=STRATEGIES.keys())
def test_one_set_of_shards_serves_every_tied_user(strategy) -> None:
    model, reference = model_and_twin()
    part = partition_model(model, strategy)
    found = sharded_parameters(model)
    table, head = found["wte.weight"], found["head.weight"]
    assert table.variables == head.variables  # the same shard Parameters, not copies
    users = {id(p) for m in (model.wte, model.head) for p in m.parameters()}
    assert users == {id(t) for t in table.variables}  # and no other copy of the table
    record = next(iter(part.parameters.values()))
    assert sorted(record.users) == ["head.weight", "wte.weight"]
    assert_same_model(model, reference)
    with torch.no_grad():
        table[0] = 5.0  # a write through one user is seen by the other
    assert torch.all(head[0] == 5.0)


def test_the_shards_are_the_only_copy_of_the_table() -> None:
    model, _ = model_and_twin()
    partition_model(model, {"head.weight": 3})
    assert type(model.wte).__name__ == "ShardedEmbedding" and type(model.head).__name__ == "ShardedLinear"
    assert [tuple(p.shape) for p in model.parameters()] == [(8, DIM), (8, DIM), (7, DIM), (DIM, DIM), (DIM,)]


@pytest.mark.parametrize("optimizer", [
    lambda ps: torch.optim.Adam(ps, lr=0.02),
    lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    lambda ps: torch.optim.AdamW(ps, lr=0.02, weight_decay=0.1),
], ids=["adam", "sgd-momentum", "adamw"])  # fmt: skip
@pytest.mark.parametrize("strategy", [STRATEGIES["head-mod"], STRATEGIES["axis1"]], ids=["mod", "axis1"])
def test_training_continues_exactly_after_rebuilding_the_optimizer(strategy, optimizer) -> None:
    model, reference = model_and_twin()
    ref_opt = optimizer(reference.parameters())
    train(reference, ref_opt, range(6))
    opt = optimizer(model.parameters())
    train(model, opt, range(3))
    opt = partition_model(model, strategy).rebuild_optimizer(opt)
    assert type(opt) is type(ref_opt) and opt.defaults == ref_opt.defaults
    train(model, opt, range(3, 6))
    assert_same_model(model, reference)


def manifest_names(directory) -> list[str]:
    return list(json.loads((directory / "manifest.json").read_text())["variables"])


@pytest.mark.parametrize(
    "target",
    [{"head.weight": 5}, {"wte.weight": PartitionSpec(2, "mod")}, {"head.weight": "1,4"}, None],
    ids=["5-shards", "mod", "axis1", "stock"],
)
def test_logical_checkpoints_restore_into_any_layout_and_the_stock_model(tmp_path, target) -> None:
    model, reference = model_and_twin()
    opt, ref_opt = torch.optim.Adam(model.parameters(), lr=0.02), torch.optim.Adam(reference.parameters(), lr=0.02)
    opt = partition_model(model, {"wte.weight": 3, "fc.weight": "1,2"}).rebuild_optimizer(opt)
    train(model, opt, range(3))
    train(reference, ref_opt, range(3))
    shardvar.save({"model": model, "opt": opt}, tmp_path)
    names = manifest_names(tmp_path)
    assert not [n for n in names if "shard_" in n or "parametrizations" in n], names
    assert {"model/wte.weight", "model/head.weight", "model/fc.weight"} <= set(names)

    restored, _ = model_and_twin()
    restored_opt = torch.optim.Adam(restored.parameters(), lr=0.02)
    if target is not None:
        restored_opt = partition_model(restored, target).rebuild_optimizer(restored_opt)
    shardvar.load({"model": restored, "opt": restored_opt}, tmp_path)
    assert_same_model(restored, reference)
    train(restored, restored_opt, range(3, 5))  # optimizer state restored too: training goes on exactly
    train(reference, ref_opt, range(3, 5))
    assert_same_model(restored, reference)


def test_the_stock_model_checkpoint_restores_into_a_partitioned_model(tmp_path) -> None:
    _, reference = model_and_twin()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    train(reference, ref_opt, range(2))
    shardvar.save({"model": reference, "opt": ref_opt}, tmp_path)
    model, _ = model_and_twin()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt = partition_model(model, {"head.weight": PartitionSpec(3, "mod")}).rebuild_optimizer(opt)
    shardvar.load({"model": model, "opt": opt}, tmp_path)
    train(model, opt, range(2, 4))
    train(reference, ref_opt, range(2, 4))
    assert_same_model(model, reference)


def test_a_module_registered_twice_is_replaced_once() -> None:
    torch.manual_seed(0)
    shared = nn.Embedding(VOCAB, DIM)
    model = nn.ModuleDict({"a": shared, "b": shared})
    partition_model(model, {"b.weight": 2})
    assert model["a"] is model["b"] and isinstance(model["a"], shardvar.ShardedEmbedding)
    assert isinstance(sharded_parameters(model)["a.weight"], ShardedVariable)
    assert list(model.state_dict()) == ["a.weight", "b.weight"]


def test_tied_names_with_different_specs_are_refused_and_nothing_changes() -> None:
    model, reference = model_and_twin()
    with pytest.raises(
        ValueError, match=r"wte.weight, head.weight: one tied \(shared\) parameter named with different"
    ):
        partition_model(model, {"head.weight": 2, "wte.weight": Layout.div(VOCAB, 3)})
    assert type(model.wte) is nn.Embedding and model.head.weight is model.wte.weight
    assert_same_model(model, reference)
