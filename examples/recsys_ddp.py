"""A small recommendation model: sharded embedding tables over ranks, dense layers data-parallel.

    torchrun --nproc-per-node 2 examples/recsys_ddp.py --steps 200

User and item tables are DistributedEmbeddings: each rank owns some of their rows and looks
up the rows its batch needs from their owners (all_to_all). The MLP on top is replicated and
wrapped in DistributedDataParallel. Each rank trains on its own batches of synthetic clicks
(Zipf-distributed users and items, labels drawn from hidden "true" factors), and the loss goes
down. With --save DIR the run ends with a checkpoint any world size can restore.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

import shardvar
from shardvar.cli import integer
from shardvar.distributed import DistributedEmbedding
from shardvar.workloads import Clicks  # the demo's synthetic clicks: Zipf ids, a hidden true model

LAUNCH = "torchrun --nproc-per-node 2 examples/recsys_ddp.py --steps 200"


class RecModel(nn.Module):
    def __init__(self, users: int, items: int, dim: int, shards: int, strategy: str) -> None:
        super().__init__()
        init = shardvar.RowInitializer(seed=1, std=0.1)
        self.users = DistributedEmbedding(users, dim, shards, strategy, initializer=init)
        self.items = DistributedEmbedding(items, dim, shards, strategy, initializer=init)
        self.mlp = nn.Sequential(nn.Linear(3 * dim, 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, users: torch.Tensor, items: torch.Tensor, mlp: nn.Module) -> torch.Tensor:
        u, i = self.users(users), self.items(items)
        return mlp(torch.cat([u, i, u * i], dim=1)).squeeze(1)


def main() -> None:
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")  # huge pages for large tensors, before the first one
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--users", type=integer(1), default=20000)
    p.add_argument("--items", type=integer(1), default=5000)
    p.add_argument("--dim", type=integer(1), default=16)
    p.add_argument("--shards", type=integer(1), default=None, help="shards per table (default: one per rank)")
    p.add_argument("--strategy", choices=["div", "mod"], default="mod")
    p.add_argument("--steps", type=integer(1), default=200)
    p.add_argument("--batch", type=integer(1), default=512)
    p.add_argument("--save", default=None, help="write a distributed checkpoint here at the end")
    args = p.parse_args()
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:  # torch's own error would be "environment variable RANK expected, but not set"
        sys.exit(f"recsys_ddp.py runs one process per rank under torchrun (no {', '.join(missing)} set): {LAUNCH}")
    backend = "nccl" if torch.cuda.is_available() and os.environ.get("SHARDVAR_BACKEND") != "gloo" else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # the same dense weights on every rank
    model = RecModel(args.users, args.items, args.dim, args.shards or world, args.strategy)
    device = model.users.variable.comm.device
    model.mlp.to(device)
    mlp = nn.parallel.DistributedDataParallel(model.mlp)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    data = Clicks(args.users, args.items, seed=0)
    g = torch.Generator().manual_seed(1000 + rank)
    start, losses = time.perf_counter(), []
    for step in range(args.steps):
        users, items, label = (t.to(device) for t in data.batch(args.batch, g))
        loss = nn.functional.binary_cross_entropy_with_logits(model(users, items, mlp), label)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
        if rank == 0 and (step % max(1, args.steps // 10) == 0 or step == args.steps - 1):
            window = losses[-max(1, args.steps // 10) :]
            print(f"step {step:5d}  loss {sum(window) / len(window):.4f}", flush=True)
    if rank == 0:
        owned = model.users.variable.local_bytes + model.items.variable.local_bytes
        total = (args.users + args.items) * args.dim * 4
        print(
            f"{world} ranks, {args.steps} steps in {time.perf_counter() - start:.1f} s; rank 0 holds "
            f"{owned / 1024:.0f} KiB of {total / 1024:.0f} KiB of embeddings; "
            f"loss {sum(losses[:10]) / 10:.4f} -> {sum(losses[-10:]) / 10:.4f}"
        )
    if args.save:
        shardvar.distributed.save({"model": model, "opt": opt}, args.save)
        if rank == 0:
            print(f"saved {args.save}")
    # DDP's reducer holds gloo work objects; freed at interpreter exit, after the group is gone, they
    # can abort the process ("terminate called without an active exception"): free it first.
    del mlp
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
