"""``shardvar demo``: train a sharded recommendation model, checkpoint it, restore it resharded.

Synthetic clicks: Zipf-distributed users and items drawn from a seed, labels from hidden "true"
factors. The model has sharded user and item tables and an MLP on top. It trains with a
progress bar, saves a checkpoint, restores it into another shard count and strategy, checks
that the predictions match, and prints a summary. ``--procs N`` runs the same under
torch.distributed on this machine (gloo on loopback), one rank per process. The models and loops
are ``shardvar.workloads``'; this module parses, prints and calls them.
"""

from __future__ import annotations

import argparse
import functools
import time

import torch
from torch import nn

from ..checkpoint import save
from ..layout import STRATEGIES
from ..workloads import (
    Clicks,
    RecModel,
    checkpoint_dir,
    eval_batch,
    logloss_of,
    other_strategy,
    rec_tables,
    restore_and_compare,
    serve_quantized,
    step_summary,
    train_twins,
)
from ._args import integer, output_dir, real
from ._console import byte_progress, format_bytes, format_sizes, loss_bar, print_table
from ._demo_distributed import run_distributed
from ._demo_quantized import print_quantized
from ._demo_settings import settings_of, where
from ._demo_tables import run_tables_demo

__all__ = ["add_demo_parser"]


def _summary(model: RecModel, restored: RecModel, rows: dict[str, str]) -> None:
    table = []
    for name in ("users", "items"):
        for label, m in (("trained", model), ("restored", restored)):
            emb = getattr(m, name)
            sizes = [p.numel() * p.element_size() for p in emb.weight.variables]
            table.append(
                [
                    f"{name} ({label})",
                    f"{emb.layout.strategy}: {format_sizes(emb.layout.sizes)}",
                    format_bytes(min(sizes)) + (" - " + format_bytes(max(sizes)) if max(sizes) != min(sizes) else ""),
                ]
            )
    print()
    print_table(["table", "layout (rows per shard)", "bytes per shard"], table)
    print()
    print_table(["summary", ""], [[k, v] for k, v in rows.items()])


def run_demo(args: argparse.Namespace) -> int:
    if args.tables:
        return run_tables_demo(args)
    if args.procs > 1:
        return run_distributed(args)
    return _run_local(args)


def _run_local(args: argparse.Namespace) -> int:
    # One intra-op thread, as each rank of `--procs N` has: the demo's kernels are small (a shard
    # is < 4 MiB), and with two threads on a busy 2-core machine every kernel waits at OpenMP's
    # barrier for a descheduled worker. That cost is per kernel, and the sharded step runs
    # twice as many (Adam steps each shard), so it was 1.6x slower under load and 0.84x with one thread.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _train_and_restore(args)
    finally:
        torch.set_num_threads(threads)


def _train_and_restore(args: argparse.Namespace) -> int:
    settings = settings_of(args)
    torch.manual_seed(args.seed)
    data = Clicks(args.users, args.items, args.seed)
    users, items = rec_tables(settings, args.shards, args.strategy)
    model = RecModel(users, items, args.dim)
    plain = RecModel(nn.Embedding(args.users, args.dim), nn.Embedding(args.items, args.dim), args.dim)
    tables = {"users.weight": users.weight.to_tensor().detach(), "items.weight": items.weight.to_tensor().detach()}
    plain.load_state_dict({**{k: v for k, v in model.state_dict().items() if k.startswith("mlp")}, **tables})
    print(
        f"shardvar demo: {args.users} users x {args.items} items, dim {args.dim}, "
        f"{args.shards} {args.strategy} shards per table, {args.steps} steps of {args.batch} clicks"
    )
    losses, seconds = train_twins((model, plain), data, settings, functools.partial(loss_bar, enabled=args.progress))
    with torch.no_grad():
        reference = model(*eval_batch(data, settings))
    with checkpoint_dir(args.checkpoint) as path:
        start = time.perf_counter()
        with byte_progress("save", args.progress) as bar:
            save({"model": model, "opt": model.optimizer}, path, progress=bar)
        save_s = time.perf_counter() - start
        size = sum(f.stat().st_size for f in path.iterdir())
        start = time.perf_counter()
        with byte_progress("restore", args.progress) as bar:
            restored, diff = restore_and_compare(settings, path, reference, data, bar)
        restore_s = time.perf_counter() - start
    first, last = sum(losses[:20]) / min(20, len(losses)), sum(losses[-20:]) / min(20, len(losses))
    with torch.no_grad():
        same = max(
            float((model.users.weight.to_tensor() - plain.users.weight).abs().max()),
            float((model.items.weight.to_tensor() - plain.items.weight).abs().max()),
        )
    _summary(
        model,
        restored,
        {
            "loss (first 20 steps -> last 20)": f"{first:.4f} -> {last:.4f}",
            **step_summary(seconds),
            "tables after training, sharded vs unsharded": f"max |diff| = {same:.1e}",
            "checkpoint": f"{format_bytes(size)} in {save_s:.2f} s; {where(args, path)}",
            "restored into": f"{args.restore_shards} {other_strategy(args.strategy)} shards in {restore_s:.2f} s",
            "predictions after restore": f"match (max |diff| = {diff:.1e})"
            if diff <= 1e-6
            else f"DIFFER by {diff:.3e}",
        },
    )
    if args.quantize:
        u, i, clicks = data.batch(4096, torch.Generator().manual_seed(args.seed + 99))
        print_quantized(serve_quantized(model, ["users", "items"], logloss_of(lambda m: (m(u, i), clicks))))
    if diff > 1e-6 or not last < first:
        print("shardvar demo: FAILED (predictions differ or the loss did not go down)")
        return 1
    return 0


def check_demo(args: argparse.Namespace) -> str | None:
    """What the flags cannot do together (each alone is checked by its type)."""
    if args.quantize and args.procs > 1 and not args.tables:
        return "--quantize serves the one-process model; use --tables N or --procs 1"
    if args.tables and args.batch % args.procs:
        return (
            f"--batch {args.batch} must divide by --procs {args.procs} with --tables: each process takes an "
            "equal slice of every global batch"
        )
    return None


def add_demo_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="train, checkpoint and reshard a sharded recommendation model")
    p.add_argument("--users", type=integer(1), default=100_000, help="rows of the user table")
    p.add_argument("--items", type=integer(1), default=20_000, help="rows of the item table")
    p.add_argument("--dim", type=integer(1), default=32)
    p.add_argument("--shards", type=integer(1), default=4, help="shards per table")
    p.add_argument("--strategy", choices=sorted(STRATEGIES), default="mod")
    p.add_argument(
        "--restore-shards", type=integer(1), default=3, help="shards to restore into (with the other strategy)"
    )
    p.add_argument("--steps", type=integer(1), default=300)
    p.add_argument("--batch", type=integer(1), default=512)
    p.add_argument("--lr", type=real(positive=True), default=0.01)
    p.add_argument("--seed", type=integer(0), default=0)
    p.add_argument("--procs", type=integer(1, 64), default=1, help="run distributed over this many processes (gloo)")
    p.add_argument(
        "--checkpoint",
        type=output_dir,
        metavar="DIR",
        help="save here and keep it (default: a temporary directory, removed)",
    )
    p.add_argument(
        "--tables",
        type=integer(1, 26),
        metavar="1..26",
        default=None,
        help="instead: the DLRM-style model with this many Criteo-shaped tables in one collection",
    )
    p.add_argument(
        "--scale", type=real(positive=True), default=0.01, help="with --tables: Criteo's cardinalities times this"
    )
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    p.add_argument(
        "--quantize", action="store_true", help="also serve the trained model's tables at int8 and int4 (one process)"
    )
    p.set_defaults(func=run_demo, check=check_demo)
