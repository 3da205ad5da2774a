"""Worker functions for the multi-process tests, run by distributed.run_ranks (one process per rank)."""

from __future__ import annotations

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


def main() -> None:
    worker, kwargs, out_dir = sys.argv[1], json.loads(sys.argv[2]), Path(sys.argv[3])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    result = globals()[worker](rank, world, **kwargs)
    torch.save(result, out_dir / f"rank{rank}.pt")
    if not (result or {}).get("error"):
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
