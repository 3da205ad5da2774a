"""A small model trained sharded and unsharded with torch.optim ends with the same weights."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import shardvar
from helpers import logical

ROWS, DIM, STEPS = 50, 8, 20

OPTIMIZERS = {
    "SGD": (False, lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=0.01)),
    "Adagrad": (False, lambda p: torch.optim.Adagrad(p, lr=0.1)),
    "Adam": (False, lambda p: torch.optim.Adam(p, lr=0.01, weight_decay=0.01)),
    "SparseAdam": (True, lambda p: torch.optim.SparseAdam(p, lr=0.01)),
    "SGD-sparse": (True, lambda p: torch.optim.SGD(p, lr=0.1)),
}


class Model(nn.Module):
    def __init__(self, embedding: nn.Module) -> None:
        super().__init__()
        self.embedding = embedding
        self.head = nn.Linear(DIM, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embedding(ids).mean(1)).squeeze(1)


def train(model: Model, optimizer_name: str, sparse: bool) -> None:
    make = OPTIMIZERS[optimizer_name][1]
    table = list(model.embedding.parameters())
    optimizers = (
        [make(table), torch.optim.Adam(model.head.parameters(), lr=0.01)]
        if sparse
        else [make(list(model.parameters()))]
    )
    g = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        ids = torch.randint(0, ROWS // 2, (16, 3), generator=g)  # the upper rows (and shards) go untouched
        target = torch.randn(16, generator=g)
        loss = nn.functional.mse_loss(model(ids), target)
        for o in optimizers:
            o.zero_grad()
        loss.backward()
        for o in optimizers:
            o.step()


@pytest.mark.parametrize("optimizer_name", list(OPTIMIZERS))
@pytest.mark.parametrize("strategy", ["div", "mod"])
@pytest.mark.parametrize("num_shards", [1, 2, 3, 5, 8])
def test_sharded_training_matches_unsharded(optimizer_name: str, strategy: str, num_shards: int) -> None:
    sparse = OPTIMIZERS[optimizer_name][0]
    torch.manual_seed(0)
    reference = Model(nn.Embedding(ROWS, DIM, sparse=sparse))
    sharded = Model(
        shardvar.ShardedEmbedding.from_pretrained(
            reference.embedding.weight, freeze=False, partitioner=num_shards, partition_strategy=strategy, sparse=sparse
        )
    )
    sharded.head.load_state_dict(reference.head.state_dict())
    train(reference, optimizer_name, sparse)
    train(sharded, optimizer_name, sparse)
    weights = logical(list(sharded.embedding.weight.variables), sharded.embedding.layout)
    assert not torch.equal(reference.embedding.weight, weights.new_zeros(weights.shape))
    torch.testing.assert_close(weights, reference.embedding.weight.detach(), atol=1e-5, rtol=0)
    torch.testing.assert_close(sharded.head.weight, reference.head.weight, atol=1e-5, rtol=0)


SPARSE_STEPS = {
    "SGD": lambda p: torch.optim.SGD(p, lr=0.1),
    "Adagrad": lambda p: torch.optim.Adagrad(p, lr=0.1),
    "SparseAdam": lambda p: torch.optim.SparseAdam(p, lr=0.01),
}


@pytest.mark.filterwarnings("ignore:Sparse invariant checks:UserWarning")  # raised inside torch.optim.Adagrad
@pytest.mark.parametrize("optimizer_name", list(SPARSE_STEPS))
@pytest.mark.parametrize(("num_shards", "strategy"), [(1, "div"), (3, "mod"), (8, "mod"), (8, "div")])
def test_sparse_optimizers_update_large_tables_of_every_layout(optimizer_name, num_shards, strategy) -> None:
    # torch's sparse add_ refuses strided leaf parameters once a gradient has more than a few
    # hundred rows: the shards shardvar allocates must be contiguous for every layout.
    rows = 4096
    torch.manual_seed(0)
    reference = nn.Embedding(rows, DIM, sparse=True)
    sharded = shardvar.ShardedEmbedding.from_pretrained(
        reference.weight, freeze=False, partitioner=num_shards, partition_strategy=strategy, sparse=True
    )
    assert all(s.is_contiguous() for s in sharded.weight.variables)
    for module in (reference, sharded):
        opt = SPARSE_STEPS[optimizer_name](list(module.parameters()))
        g = torch.Generator().manual_seed(3)
        for _ in range(3):
            module(torch.randint(0, rows, (rows,), generator=g)).pow(2).sum().backward()
            opt.step()
            opt.zero_grad()
    torch.testing.assert_close(sharded.weight.to_tensor(), reference.weight.detach(), atol=1e-5, rtol=0)
