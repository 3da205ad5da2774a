"""Workers for tests/test_distributed_modules.py: every option of the modules, distributed."""

from __future__ import annotations

import time

import torch
from torch import nn

from dist_workers import DIM, ROWS
from shardvar.distributed import DistributedEmbedding, DistributedEmbeddingBag
from shardvar.variables import RowInitializer

CASES = {
    "padding": ("embedding", {"padding_idx": 3}),
    "max_norm": ("embedding", {"max_norm": 1.5}),
    "sparse": ("embedding", {"sparse": True}),
    "freq": ("embedding", {"scale_grad_by_freq": True}),
    "bag_sum_weights": ("bag", {"mode": "sum"}),
    "bag_mean_padding": ("bag", {"mode": "mean", "padding_idx": 0}),
    "bag_max_sparse": ("bag", {"mode": "max", "sparse": True}),
}


def batch(case: str, rank: int, step: int) -> tuple[dict, torch.Tensor]:
    g = torch.Generator().manual_seed(step * 100 + rank)
    ids = torch.randint(0, ROWS, (12,), generator=g)
    ids[:3] = torch.tensor([0, 3, 3])  # padding ids and duplicates on every rank
    kind = CASES[case][0]
    if kind == "embedding":
        return {"input": ids.reshape(4, 3)}, torch.randn(4, generator=g)
    inputs = {"input": ids, "offsets": torch.tensor([0, 2, 2, 7])}  # an empty bag too
    if case == "bag_sum_weights":
        inputs["per_sample_weights"] = torch.rand(12, generator=g)
    return inputs, torch.randn(4, generator=g)


def pooled(out: torch.Tensor, kind: str) -> torch.Tensor:
    return out.mean(1) if kind == "embedding" else out


def module_train(rank: int, world: int, case: str, shards: int, strategy: str, steps: int) -> dict:
    kind, options = CASES[case]
    cls = DistributedEmbedding if kind == "embedding" else DistributedEmbeddingBag
    torch.manual_seed(0)
    head = nn.Linear(DIM, 1)
    emb = cls(ROWS, DIM, shards, strategy, initializer=RowInitializer(4), **options)
    dense = nn.parallel.DistributedDataParallel(head)
    opt = torch.optim.SGD([*emb.parameters(), *dense.parameters()], lr=0.1)
    outs, calls = [], []
    for step in range(steps):
        inputs, target = batch(case, rank, step)
        before = dict(emb.variable.comm.calls)
        out = emb(**inputs)
        outs.append(out.detach().clone())
        loss = (dense(pooled(out, kind)).squeeze(1) - target).pow(2).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        calls.append({k: n - before.get(k, 0) for k, n in emb.variable.comm.calls.items() if n - before.get(k, 0)})
    return {
        "outs": outs,
        "shards": {s: p.detach().clone() for s, p in emb.variable.local_shards().items()},
        "sparse_grads": all(p.grad is None or p.grad.is_sparse for p in emb.parameters()),
        "calls": calls,
    }


def ddp_sparse(rank: int, world: int) -> dict:
    """ShardedEmbedding(sparse=True) replicated under DDP trains as nn.Embedding(sparse=True) does."""
    import shardvar

    torch.manual_seed(0)
    plain = nn.Embedding(ROWS, DIM, sparse=True)
    sharded = shardvar.ShardedEmbedding.from_pretrained(
        plain.weight.detach().clone(), freeze=False, partitioner=3, partition_strategy="mod", sparse=True
    )
    results = {}
    for name, module in (("plain", plain), ("sharded", sharded)):
        model = nn.parallel.DistributedDataParallel(module)
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        for step in range(3):
            ids = torch.randint(0, ROWS, (5,), generator=torch.Generator().manual_seed(step * 10 + rank))
            opt.zero_grad()
            model(ids).pow(2).sum().backward()
            opt.step()
        results[name] = module.weight.detach().clone() if name == "plain" else module.weight.to_tensor().detach()
    return results


def dies_before_construction(rank: int, world: int) -> dict:
    """The last rank dies before creating its table: the others name it."""
    import os

    import shardvar

    # every rank connected first: a rank gone while gloo still builds its mesh fails the others' setup
    # ("connection closed by peer"), a different failure from the one named here
    torch.distributed.barrier()
    if rank == world - 1:
        os._exit(19)
    try:
        DistributedEmbedding(ROWS, DIM, 3, "div", timeout=10)
    except shardvar.ShardvarDistributedError as e:
        if rank == 0:  # rank 0 hosts the store the others read to name the dead rank: stay until they have
            time.sleep(3)
        return {"error": str(e)}
    return {"error": None}


def save_with_a_bad_dtype(rank: int, world: int, path: str) -> dict:
    """Rank 1 holds a tensor no checkpoint can store: every rank must raise, promptly."""
    import shardvar

    state = {"ok": torch.ones(3)}
    if rank == 1:
        state["z"] = torch.ones(2, dtype=torch.complex128)
    try:
        shardvar.distributed.save(state, path, timeout=30)
    except shardvar.ShardvarError as e:
        return {"error": str(e)}
    return {"error": None}
