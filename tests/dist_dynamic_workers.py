"""Workers for the distributed dynamic-table tests (run by dist_workers.main)."""

from __future__ import annotations

import torch

import shardvar
from shardvar.distributed import DistributedDynamicEmbedding
from shardvar.dynamic import CountAdmission

DIM, CAPACITY = 4, 192
POOL = torch.randint(-(2**63), 2**63 - 1, (120,), generator=torch.Generator().manual_seed(7))


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return POOL[torch.randint(0, 60 + 3 * step, (10,), generator=g)], torch.randn(10, DIM, generator=g)


def make(admission: int | None) -> DistributedDynamicEmbedding:
    return DistributedDynamicEmbedding(DIM, CAPACITY, admission=CountAdmission(admission) if admission else None)


def train(rank: int, world: int, steps: int, admission: int | None = None, path: str | None = None) -> dict:
    emb = make(admission)
    opt = torch.optim.Adam(emb.parameters(), lr=0.05)
    emb.attach_optimizer(opt)
    comm = emb.table.store.exchange.comm
    outs, calls = [], []
    for step in range(steps):
        ids, target = batch(rank, step)
        before = comm.calls["all_to_all"] + emb.comm.calls["all_to_all"]
        opt.zero_grad()
        out = emb(ids)
        ((out - target) ** 2).sum().backward()  # every rank's loss: the gradient is their sum
        opt.step()
        calls.append(comm.calls["all_to_all"] + emb.comm.calls["all_to_all"] - before)
        outs.append(out.detach())
    rows, keys = emb.to_fixed()
    if path is not None:
        shardvar.distributed.save({"emb": emb, "opt": opt}, path)
    return {"outs": outs, "rows": rows, "keys": keys, "calls": calls}


def restore(rank: int, world: int, path: str, admission: int | None = None) -> dict:
    emb = make(admission)
    opt = torch.optim.Adam(emb.parameters(), lr=0.05)
    emb.attach_optimizer(opt)
    shardvar.distributed.load({"emb": emb, "opt": opt}, path)
    rows, keys = emb.to_fixed()
    emb.eval()
    looked_up = emb(POOL)
    contains = emb.contains(POOL)
    emb.train()
    outs = []
    for step in range(5, 8):
        ids, target = batch(rank, step)
        opt.zero_grad()
        out = emb(ids)
        ((out - target) ** 2).sum().backward()
        opt.step()
        outs.append(out.detach())
    evicted = emb.evict(POOL[rank * 7 : rank * 7 + 20])  # collective: owners free the rows of these ids
    return {
        "rows": rows, "keys": keys, "lookup": looked_up, "contains": contains, "outs": outs,
        "evicted": evicted, "after": emb.contains(POOL),
    }  # fmt: skip
