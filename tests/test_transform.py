"""partition_model: same outputs, same training, optimizer state carried over, clear refusals."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import shardvar
from shardvar import FixedShardsPartitioner, MaxSizePartitioner, PartitionerConfig
from shardvar.transform import PartitionSpec, partition_model, strategy_from_json, strategy_to_json


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(30, 8, padding_idx=0)
        self.bag = nn.EmbeddingBag(20, 8, mode="sum")
        self.fc1 = nn.Linear(16, 12)
        self.fc2 = nn.Linear(12, 1)
        self.scale = nn.Parameter(torch.tensor(1.5))

    def forward(self, ids: torch.Tensor, bags: torch.Tensor) -> torch.Tensor:
        x = torch.cat([self.emb(ids).mean(1), self.bag(bags)], dim=1)
        return self.fc2(torch.relu(self.fc1(x))).squeeze(1) * self.scale


STRATEGIES = [
    {"emb.weight": 4, "fc1.weight": "1,3", "fc2.weight": FixedShardsPartitioner(1)},
    {"emb.weight": PartitionSpec(3, "mod"), "bag.weight": "2,1", "fc1.weight": PartitionerConfig([3, 1])},
    {"*.weight": PartitionSpec(2, "mod"), "fc1.bias": MaxSizePartitioner(16)},
]


def data(step: int):
    g = torch.Generator().manual_seed(step)
    return (
        torch.randint(0, 30, (5, 3), generator=g),
        torch.randint(0, 20, (5, 4), generator=g),
        torch.randn(5, generator=g),
    )


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: range) -> None:
    for step in steps:
        ids, bags, y = data(step)
        loss = (model(ids, bags) - y).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


def logical(model: nn.Module, name: str) -> torch.Tensor:
    owner = model.get_submodule(name.rpartition(".")[0])
    attr = name.rpartition(".")[2]
    value = getattr(owner, attr)
    return (value.to_tensor() if isinstance(value, shardvar.ShardedVariable) else value).detach()


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_same_outputs_after_the_transform(strategy) -> None:
    torch.manual_seed(0)
    model = Net()
    reference = copy.deepcopy(model)
    part = partition_model(model, strategy)
    assert type(model.emb).__name__ == "ShardedEmbedding"
    ids, bags, _ = data(0)
    torch.testing.assert_close(model(ids, bags), reference(ids, bags))
    for name, p in part.parameters.items():
        assert len(p.variables) == p.layout.num_shards
        torch.testing.assert_close(logical(model, name), dict(reference.named_parameters())[name].detach())


@pytest.mark.parametrize("optimizer", [
    lambda ps: torch.optim.Adam(ps, lr=0.02),
    lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
    lambda ps: torch.optim.Adagrad(ps, lr=0.05),
])  # fmt: skip
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_training_continues_exactly_after_transforming_model_and_optimizer(strategy, optimizer) -> None:
    torch.manual_seed(0)
    model = Net()
    reference = copy.deepcopy(model)
    ref_opt = optimizer(reference.parameters())
    train(reference, ref_opt, range(10))
    opt = optimizer(model.parameters())
    train(model, opt, range(5))
    part = partition_model(model, strategy)
    opt = part.rebuild_optimizer(opt)
    assert type(opt) is type(ref_opt) and opt.defaults == ref_opt.defaults
    train(model, opt, range(5, 10))
    for name, p in reference.named_parameters():
        torch.testing.assert_close(logical(model, name), p.detach(), atol=1e-6, rtol=0)


def test_transformed_model_trains_like_the_original() -> None:
    torch.manual_seed(1)
    model = Net()
    reference = copy.deepcopy(model)
    partition_model(model, STRATEGIES[1])
    for m, o in (
        (model, torch.optim.Adam(model.parameters(), lr=0.01)),
        (reference, torch.optim.Adam(reference.parameters(), lr=0.01)),
    ):
        train(m, o, range(8))
    for name, p in reference.named_parameters():
        torch.testing.assert_close(logical(model, name), p.detach(), atol=1e-6, rtol=0)


def test_refusals_are_listed_together_and_change_nothing() -> None:
    model = Net()
    model.fc2.weight = model.fc1.weight  # a tied (shared) weight, under two names
    before = {k: v.clone() for k, v in model.state_dict().items()}
    strategy = {
        "fc2.weight": 2,
        "fc1.weight": "1,2",
        "scale": 2,
        "fc1.bias": "1,2",
        "missing.*": 2,
        "emb.weight": "1,1,2",
        "bag.weight": "100,1",
    }
    with pytest.raises(ValueError) as info:
        partition_model(model, strategy)
    message = str(info.value)
    for expected in (
        "fc1.weight, fc2.weight: one tied (shared) parameter named with different specs",
        "scale: a 0-d parameter cannot be partitioned",
        "fc1.bias: partition list [1, 2] has 2 entries but shape [12] has 1",
        "missing.*: matches no parameter",
        "emb.weight: partition list [1, 1, 2]",
        "bag.weight: cannot split axis 0 of size 20 into 100 shards",
    ):
        assert expected in message, message
    assert type(model.emb) is nn.Embedding and not hasattr(model.fc1, "parametrizations")
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_strategies_round_trip_through_json() -> None:
    strategy = {
        "emb.weight": PartitionSpec(FixedShardsPartitioner(4), "mod"),
        "fc*.weight": "1,2",
        "bag.weight": shardvar.MinSizePartitioner(64, 4),
        "x": shardvar.Layout.explicit([3, 0, 5]),
        "y": 3,
    }
    text = strategy_to_json(strategy)
    back = strategy_from_json(text)
    assert strategy_to_json(back) == text
    assert back["emb.weight"] == PartitionSpec(FixedShardsPartitioner(4), "mod")
    assert back["x"].layout((8, 2)) == shardvar.Layout.explicit([3, 0, 5])
    with pytest.raises(ValueError, match="unknown partitioner 'Hash'"):
        strategy_from_json('{"a": {"partitioner": "Hash"}}')


def test_devices_round_robin() -> None:
    model = Net()
    part = partition_model(model, {"fc1.weight": "3,1"}, devices=["cpu", torch.device("cpu")])
    assert [p.device.type for p in part.parameters["fc1.weight"].variables] == ["cpu"] * 3
