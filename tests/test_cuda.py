"""The same paths on CUDA: slabs on the GPU, shards split between the GPU and the CPU, training.

Skipped with a reason on machines without a GPU (CI has none); run them where one is lent.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardvar
from shardvar import Layout, ShardedVariable

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none on this machine)")


@pytest.mark.parametrize("strategy", ["div", "mod"])
def test_slab_lookups_bags_and_scatter_on_the_gpu(strategy) -> None:
    table = torch.randn(1000, 16, device="cuda")
    v = shardvar.shard_tensor(table, Layout.balanced(strategy, 1000, 8))
    assert v.store.full_slab is not None and v.store.full_slab.is_cuda
    ids = torch.randint(0, 1000, (4096,), device="cuda")
    torch.testing.assert_close(shardvar.embedding_lookup(v, ids), F.embedding(ids, table))
    offsets = torch.arange(0, 4096, 16, device="cuda")
    got = shardvar.variables.functional.embedding_bag(v.store, ids, offsets, mode="sum")
    torch.testing.assert_close(got, F.embedding_bag(ids, table, offsets, mode="sum"))
    v.scatter_add(ids, torch.ones(4096, 16, device="cuda"))
    torch.testing.assert_close(v.to_tensor(), table.index_add(0, ids, torch.ones(4096, 16, device="cuda")))


def test_user_shards_on_the_gpu_are_moved_into_one_slab() -> None:
    shards = [torch.randn(100, 8, device="cuda") for _ in range(4)]
    v = ShardedVariable(shards, partition_strategy="div")
    assert v.store.full_slab is not None and all(a is b for a, b in zip(v.variables, shards, strict=True))


def test_shards_on_the_gpu_and_the_cpu_read_by_device() -> None:
    table = torch.randn(90, 4)
    v = shardvar.shard_tensor(table, Layout.mod(90, 3), devices=["cuda", "cpu", "cuda"])
    assert len(v.store.groups) == 2 and v.store.full_slab is None
    ids = torch.randint(0, 90, (500,), device="cuda")
    torch.testing.assert_close(shardvar.embedding_lookup(v, ids).cpu(), F.embedding(ids.cpu(), table))


@pytest.mark.parametrize("sparse", [False, True])
def test_training_on_the_gpu_matches_nn_embedding_bag(sparse) -> None:
    torch.manual_seed(0)
    ref = nn.EmbeddingBag(500, 8, mode="mean", sparse=sparse).cuda()
    sharded = shardvar.ShardedEmbeddingBag.from_pretrained(
        ref.weight.detach().clone(), freeze=False, partitioner=4, partition_strategy="mod", mode="mean", sparse=sparse
    )
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.5)
    opt = torch.optim.SGD(sharded.parameters(), lr=0.5)
    for _ in range(5):
        ids = torch.randint(0, 500, (64, 5), device="cuda")
        for module, o in ((ref, opt_ref), (sharded, opt)):
            o.zero_grad()
            module(ids).pow(2).sum().backward()
            o.step()
    torch.testing.assert_close(sharded.weight.to_tensor(), ref.weight)
