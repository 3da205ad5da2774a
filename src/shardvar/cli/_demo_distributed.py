"""``shardvar demo --procs N``: the demo under torch.distributed, one rank per process (gloo), and its summary."""

from __future__ import annotations

import argparse
import functools

from ..workloads import checkpoint_dir, other_strategy, train_on_processes
from ._console import byte_progress, format_bytes, format_sizes, loss_bar, print_table
from ._demo_settings import settings_of, where

__all__ = ["run_distributed"]


def run_distributed(args: argparse.Namespace) -> int:
    print(
        f"shardvar demo: {args.procs} processes (gloo on loopback), {args.users} users x {args.items} items, "
        f"dim {args.dim}, {args.shards} {args.strategy} shards per table, "
        f"{args.steps} steps of {args.batch} clicks per rank"
    )
    bar = functools.partial(loss_bar, enabled=args.progress)
    with checkpoint_dir(args.checkpoint) as out, byte_progress("restore", args.progress) as progress:
        stats, layout, diff = train_on_processes(settings_of(args), out, bar, progress)
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
        "restored into (one process)": f"{args.restore_shards} {other_strategy(args.strategy)} shards",
        "predictions after restore": f"match (max |diff| = {diff:.1e})" if diff <= 1e-5 else f"DIFFER by {diff:.3e}",
        "checkpoint": where(args, out),
    }
    print()
    print_table(["summary", ""], [[k, v] for k, v in rows.items()])
    return 0 if diff <= 1e-5 and last < first else 1
