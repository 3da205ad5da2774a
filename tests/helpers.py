"""Small helpers shared by the tests."""

from __future__ import annotations

import torch

import shardvar


def logical(shards: list[torch.Tensor], layout: shardvar.Layout) -> torch.Tensor:
    """The logical tensor the (possibly sparse) shard tensors describe."""
    dense = [s.to_dense() if s.is_sparse else s for s in shards]
    return shardvar.ShardedVariable([d.detach() for d in dense], partition_strategy=layout.strategy, axis=layout.axis).to_tensor()


def grad_of(module) -> torch.Tensor:
    return logical([p.grad for p in module.weight.variables], module.layout)


TIERED_ROWS, TIERED_DIM = 50, 4


def tiered_bag(folder, name: str = "t.rows", seed: int = 0, cache_rows: int = 10, partitions: tuple = ()):
    """A sum ``ShardedEmbeddingBag`` of ``TIERED_ROWS x TIERED_DIM`` over a backing file in ``folder``, its cache
    ``cache_rows`` rows with row-wise state, initialised from ``seed``."""
    from shardvar.tiered import cache_bytes_for

    torch.manual_seed(seed)
    cache = cache_bytes_for(cache_rows, TIERED_DIM, rows=TIERED_ROWS, state_width=1)
    storage = shardvar.Tiered(folder / name, cache_bytes=cache)
    return shardvar.ShardedEmbeddingBag(TIERED_ROWS, TIERED_DIM, *partitions, mode="sum", sparse=True, storage=storage)


def train_bags(module, steps: int, seed: int) -> None:
    """``steps`` steps of three bags of skewed ids (a loss of squares), each backward run."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        ids = (torch.rand(8, generator=g) ** 2 * TIERED_ROWS).long()
        module(ids, torch.tensor([0, 3, 5])).square().sum().backward()
