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
