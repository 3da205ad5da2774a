"""Worker functions for the multi-process tests, run by distributed.run_ranks (one process per rank)."""

from __future__ import annotations

import gc
import importlib
import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import shardvar
from shardvar.distributed import DistributedEmbedding
from shardvar.variables import RowInitializer

ROWS, DIM = 30, 4


def batch(rank: int, step: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed * 1000 + step * 10 + rank)
    return torch.randint(0, ROWS, (6, 3), generator=g), torch.randn(6, generator=g)


def train(rank: int, world: int, strategy: str, shards: int, steps: int, seed: int) -> dict:
    torch.manual_seed(seed)
    head = nn.Linear(DIM, 1)  # the same initial weights on every rank (same seed)
    emb = DistributedEmbedding(ROWS, DIM, shards, strategy, initializer=RowInitializer(seed))
    dense = nn.parallel.DistributedDataParallel(head)
    opt = torch.optim.SGD([*emb.parameters(), *dense.parameters()], lr=0.1, momentum=0.9)
    first = None
    calls = []
    for step in range(steps):
        ids, target = batch(rank, step, seed)
        before = dict(emb.variable.comm.calls)
        rows = emb(ids)
        if first is None:
            first = rows.detach().clone()
        loss = (dense(rows.mean(1)).squeeze(1) - target).pow(2).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        calls.append({k: n - before.get(k, 0) for k, n in emb.variable.comm.calls.items() if n - before.get(k, 0)})
    return {
        "first": first,
        "shards": {s: p.detach().clone() for s, p in emb.variable.local_shards().items()},
        "head": {k: v.detach().clone() for k, v in head.state_dict().items()},
        "local_bytes": emb.variable.local_bytes,
        "owned": emb.variable.owned,
        "calls": calls,
    }


def bad_ids(rank: int, world: int) -> dict:
    emb = DistributedEmbedding(ROWS, DIM, 4, "mod")
    ids = torch.tensor([1, 2, ROWS + 5 if rank == 1 else 3])
    try:
        emb(ids)
    except shardvar.ShardvarIndexError as e:
        return {"error": str(e)}
    return {"error": None}


def mismatched(rank: int, world: int) -> dict:
    try:
        DistributedEmbedding(ROWS, DIM, 4 if rank == 0 else 5, "div")
    except shardvar.ShardvarDistributedError as e:
        return {"error": str(e)}
    return {"error": None}


def dead_rank(rank: int, world: int, collective_timeout: float) -> dict:
    emb = DistributedEmbedding(ROWS, DIM, 3, "div", timeout=collective_timeout)
    emb(torch.tensor([0, 1]))  # everyone alive: works
    if rank == world - 1:
        os._exit(17)  # dies without a word, mid-training
    start = time.monotonic()
    try:
        for _ in range(3):
            emb(torch.tensor([0, 1, 29])).sum().backward()
    except shardvar.ShardvarDistributedError as e:
        return {"error": str(e), "seconds": time.monotonic() - start}
    return {"error": None, "seconds": time.monotonic() - start}


def hung_rank(rank: int, world: int, collective_timeout: float) -> dict:
    emb = DistributedEmbedding(ROWS, DIM, 3, "div", timeout=collective_timeout)
    if rank == world - 1:
        time.sleep(collective_timeout * 3)  # alive but stuck: the others must not wait for it
        os._exit(18)
    start = time.monotonic()
    try:
        emb(torch.tensor([0, 1]))
    except shardvar.ShardvarDistributedError as e:
        return {"error": str(e), "seconds": time.monotonic() - start}
    return {"error": None, "seconds": time.monotonic() - start}


class Model(nn.Module):
    def __init__(self, emb: nn.Module) -> None:
        super().__init__()
        self.emb = emb
        self.head = nn.Linear(DIM, 1)


def local_state(model: Model, opt: torch.optim.Optimizer) -> dict:
    shards = model.emb.variable.local_shards()
    return {
        "shards": {s: p.detach().clone() for s, p in shards.items()},
        "exp_avg": {s: opt.state[p]["exp_avg"].clone() for s, p in shards.items()},
        "step": float(opt.state[next(iter(shards.values()))]["step"]),
        "head": model.head.weight.detach().clone(),
    }


def ckpt_train_save(rank: int, world: int, path: str, shards: int, strategy: str) -> dict:
    torch.manual_seed(0)
    model = Model(DistributedEmbedding(ROWS, DIM, shards, strategy, initializer=RowInitializer(5)))
    dense = nn.parallel.DistributedDataParallel(model.head)
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    for step in range(3):
        ids, target = batch(rank, step, 9)
        loss = (dense(model.emb(ids).mean(1)).squeeze(1) - target).pow(2).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    shardvar.distributed.save({"model": model, "opt": opt}, path)
    return local_state(model, opt)


def ckpt_load(rank: int, world: int, path: str, shards: int, strategy: str) -> dict:
    torch.manual_seed(123)  # other initial values: all must come from the checkpoint
    model = Model(DistributedEmbedding(ROWS, DIM, shards, strategy, initializer=RowInitializer(77)))
    opt = torch.optim.Adam(model.parameters(), lr=1.0)
    shardvar.distributed.load({"model": model, "opt": opt}, path)
    return {**local_state(model, opt), "lr": opt.param_groups[0]["lr"]}


def resolve(worker: str):
    if ":" in worker:  # "module:function": a worker kept in another test module
        module, name = worker.split(":")
        return getattr(importlib.import_module(module), name)
    return globals()[worker]


def many(rank: int, world: int, jobs: list) -> dict:
    """Several workers in turn in one process group: one interpreter start per rank for them all."""
    return {"jobs": [resolve(worker)(rank, world, **kwargs) for worker, kwargs in jobs]}


def main() -> None:
    worker, kwargs, out_dir = sys.argv[1], json.loads(sys.argv[2]), Path(sys.argv[3])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    result = resolve(worker)(rank, world, **kwargs)
    torch.save(result, out_dir / f"rank{rank}.pt")
    if not (result or {}).get("error"):
        gc.collect()  # gloo work held by garbage cycles goes while the group is alive
        dist.destroy_process_group()
    # After a failed collective the group may hold work that never completes, and tearing it down
    # can abort the process; and gloo objects freed during interpreter shutdown can abort it too
    # ("terminate called without an active exception", pytorch#179291). The result is saved:
    # leave without destructors.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
