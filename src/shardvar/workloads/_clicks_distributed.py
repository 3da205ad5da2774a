"""``shardvar demo --procs N``'s training: the demo model under torch.distributed, one rank per process (gloo)."""

from __future__ import annotations

import gc
import os
import socket
import statistics
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from ..checkpoint import Manifest
from ..distributed import DistributedEmbedding
from ..distributed import save as distributed_save
from ..variables import RowInitializer
from ._clicks import Clicks, DemoSettings, RecModel, StepBar, eval_batch, no_bar, restore_and_compare, train_step

__all__ = ["train_on_processes"]


def _worker(rank: int, args: DemoSettings, port: int, out: str, bar: StepBar) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.procs))
    dist.init_process_group("gloo", rank=rank, world_size=args.procs, timeout=timedelta(seconds=120))
    torch.manual_seed(args.seed)
    init = RowInitializer(seed=args.seed, std=0.1)
    users = DistributedEmbedding(args.users, args.dim, args.shards, args.strategy, initializer=init)
    items = DistributedEmbedding(args.items, args.dim, args.shards, args.strategy, initializer=init)
    model = RecModel(users, items, args.dim)
    mlp = nn.parallel.DistributedDataParallel(model.mlp)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    data = Clicks(args.users, args.items, args.seed)
    g = torch.Generator().manual_seed(args.seed + 1 + rank)
    losses, seconds = [], []
    with (bar if rank == 0 else no_bar)(f"rank {rank}/{args.procs}", args.steps) as advance:
        for _ in range(args.steps):
            batch = data.batch(args.batch, g)
            start = time.perf_counter()
            losses.append(train_step(model, opt, batch, mlp))
            seconds.append(time.perf_counter() - start)
            advance(sum(losses[-20:]) / len(losses[-20:]))
    per_step = statistics.median(seconds[3:] or seconds)
    with torch.no_grad():
        predictions = model(*eval_batch(data, args), mlp)
    distributed_save({"model": model, "opt": opt}, out)
    local = [p.numel() * p.element_size() for p in [*users.weight.variables, *items.weight.variables]]
    stats = {
        "rank": rank,
        "per_step": per_step,
        "losses": losses,
        "local_bytes": sum(local),
        "owned": users.variable.owned,
    }
    everyone: list = [None] * args.procs
    dist.all_gather_object(everyone, stats)
    if rank == 0:
        torch.save({"predictions": predictions, "stats": everyone}, Path(out) / "demo-results.pt")
    # DDP's reducer holds gloo work objects; freed at interpreter exit, after the group is gone, they
    # can abort the process ("terminate called without an active exception"): free it first.
    del mlp
    gc.collect()
    dist.destroy_process_group()


def train_on_processes(
    args: DemoSettings, out: Path, bar: StepBar = no_bar, progress: Any = None
) -> tuple[list[dict], Any, float]:
    """Train on ``args.procs`` processes, save to ``out`` from every rank, restore in this one.

    Returns each rank's stats (``rank``, ``per_step`` seconds, ``losses``, ``local_bytes``, ``owned``
    shards), the users table's saved layout, and the restored predictions' max |diff| from rank 0's.
    ``bar`` shows rank 0's steps; ``progress(done, total)`` the bytes restored.
    """
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(args, port, str(out), bar), nprocs=args.procs, join=True)
    results = torch.load(out / "demo-results.pt", weights_only=False)
    (out / "demo-results.pt").unlink()
    data = Clicks(args.users, args.items, args.seed)
    _, diff = restore_and_compare(args, out, results["predictions"], data, progress)
    layout = Manifest.read(out).variables["model/users.weight"].layout
    return results["stats"], layout, diff
