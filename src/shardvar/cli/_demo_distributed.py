"""``shardvar demo --procs N``: the demo under torch.distributed, one rank per process (gloo)."""

from __future__ import annotations

import argparse
import gc
import os
import socket
import statistics
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from .._errors import ShardvarError
from ..checkpoint import Manifest
from ..distributed import DistributedEmbedding
from ..distributed import save as distributed_save
from ..variables import RowInitializer
from ._console import format_bytes, format_sizes, print_table, step_progress
from ._demo_model import Clicks, RecModel, _eval_batch, _other, _restore_and_compare, checkpoint_dir, train_step, where

__all__ = ["run_distributed"]


def _worker(rank: int, args: argparse.Namespace, port: int, out: str) -> None:
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
    with step_progress(args.progress and rank == 0) as bar:
        task = bar.add_task(f"rank {rank}/{args.procs}", total=args.steps, status="")
        for _ in range(args.steps):
            batch = data.batch(args.batch, g)
            start = time.perf_counter()
            losses.append(train_step(model, opt, batch, mlp))
            seconds.append(time.perf_counter() - start)
            bar.update(task, advance=1, status=f"loss {sum(losses[-20:]) / len(losses[-20:]):.4f}")
    per_step = statistics.median(seconds[3:] or seconds)
    with torch.no_grad():
        predictions = model(*_eval_batch(data, args), mlp)
    distributed_save({"model": model, "opt": opt}, out)
    local = [p.numel() * p.element_size() for p in [*users.shards, *items.shards]]
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


def run_distributed(args: argparse.Namespace) -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    print(
        f"shardvar demo: {args.procs} processes (gloo on loopback), {args.users} users x {args.items} items, "
        f"dim {args.dim}, {args.shards} {args.strategy} shards per table, "
        f"{args.steps} steps of {args.batch} clicks per rank"
    )
    with checkpoint_dir(args) as out:
        mp.spawn(_worker, args=(args, port, str(out)), nprocs=args.procs, join=True)
        results = torch.load(out / "demo-results.pt", weights_only=False)
        (out / "demo-results.pt").unlink()
        data = Clicks(args.users, args.items, args.seed)
        try:
            restored, diff = _restore_and_compare(args, out, results["predictions"], data)
        except ShardvarError as e:
            raise SystemExit(f"shardvar demo: {e}") from None
        layout = Manifest.read(out).variables["model/users.weight"].layout
    stats = results["stats"]
    table = [
        [
            f"rank {s['rank']}",
            ", ".join(map(str, s["owned"])),
            format_bytes(s["local_bytes"]),
            f"{s['per_step'] * 1e3:.1f} ms",
        ]
        for s in stats
    ]
    print()
    print_table(["rank", "shards owned (per table)", "embedding bytes held", "time per step (median)"], table)
    losses = stats[0]["losses"]
    first, last = sum(losses[:20]) / min(20, len(losses)), sum(losses[-20:]) / min(20, len(losses))
    total = (args.users + args.items) * args.dim * 4
    rows = {
        "loss on rank 0 (first 20 -> last 20)": f"{first:.4f} -> {last:.4f}",
        "users table saved as": f"{layout.strategy}: {format_sizes(layout.sizes)} (from {args.procs} ranks)",
        "embedding bytes in all": format_bytes(total),
        "restored into (one process)": f"{args.restore_shards} {_other(args.strategy)} shards",
        "predictions after restore": f"match (max |diff| = {diff:.1e})" if diff <= 1e-5 else f"DIFFER by {diff:.3e}",
        "checkpoint": where(args, out),
    }
    print()
    print_table(["summary", ""], [[k, v] for k, v in rows.items()])
    del restored
    return 0 if diff <= 1e-5 and last < first else 1
