"""``shardvar demo``: train a sharded recommendation model, checkpoint it, restore it resharded.

Synthetic clicks: Zipf-distributed users and items drawn from a seed, labels from hidden "true"
factors. The model has sharded user and item tables and an MLP on top. It trains with a
progress bar, saves a checkpoint, restores it into another shard count and strategy, checks
that the predictions match, and prints a summary. ``--procs N`` runs the same under
torch.distributed on this machine (gloo on loopback), one rank per process.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

from .._errors import ShardvarError
from ..checkpoint import save
from ..layout import STRATEGIES
from ._console import byte_progress, format_bytes, format_sizes, print_table
from ._demo_model import (
    Clicks,
    RecModel,
    _eval_batch,
    _other,
    _restore_and_compare,
    _tables,
    checkpoint_dir,
    step_summary,
    train_twins,
    where,
)
from ._demo_quantized import logloss_of, print_quantized, serve_quantized

__all__ = ["add_demo_parser"]


def _summary(model: RecModel, restored: RecModel, rows: dict[str, str]) -> None:
    table = []
    for name in ("users", "items"):
        for label, m in (("trained", model), ("restored", restored)):
            emb = getattr(m, name)
            sizes = [p.numel() * p.element_size() for p in emb.shards]
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
        from ._demo_tables import run_tables_demo

        return run_tables_demo(args)
    if args.procs > 1:
        if args.quantize:
            raise SystemExit("shardvar demo: --quantize serves the one-process model; use --tables N or --procs 1")
        from ._demo_distributed import run_distributed

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
    torch.manual_seed(args.seed)
    data = Clicks(args.users, args.items, args.seed)
    users, items = _tables(args, args.shards, args.strategy)
    model = RecModel(users, items, args.dim)
    plain = RecModel(nn.Embedding(args.users, args.dim), nn.Embedding(args.items, args.dim), args.dim)
    tables = {"users.weight": users.weight.to_tensor().detach(), "items.weight": items.weight.to_tensor().detach()}
    plain.load_state_dict({**{k: v for k, v in model.state_dict().items() if k.startswith("mlp")}, **tables})
    print(
        f"shardvar demo: {args.users} users x {args.items} items, dim {args.dim}, "
        f"{args.shards} {args.strategy} shards per table, {args.steps} steps of {args.batch} clicks"
    )
    losses, seconds = train_twins((model, plain), data, args)
    with torch.no_grad():
        reference = model(*_eval_batch(data, args))
    with checkpoint_dir(args) as path:
        try:
            start = time.perf_counter()
            with byte_progress("save", args.progress) as bar:
                save({"model": model, "opt": model.optimizer}, path, progress=bar)
            save_s = time.perf_counter() - start
            size = sum(f.stat().st_size for f in path.iterdir())
            start = time.perf_counter()
            restored, diff = _restore_and_compare(args, path, reference, data)
            restore_s = time.perf_counter() - start
        except ShardvarError as e:
            raise SystemExit(f"shardvar demo: {e}") from None
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
            "restored into": f"{args.restore_shards} {_other(args.strategy)} shards in {restore_s:.2f} s",
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


def add_demo_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="train, checkpoint and reshard a sharded recommendation model")
    p.add_argument("--users", type=int, default=100_000, help="rows of the user table")
    p.add_argument("--items", type=int, default=20_000, help="rows of the item table")
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--shards", type=int, default=4, help="shards per table")
    p.add_argument("--strategy", choices=sorted(STRATEGIES), default="mod")
    p.add_argument("--restore-shards", type=int, default=3, help="shards to restore into (with the other strategy)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--procs", type=int, default=1, help="run distributed over this many processes (gloo)")
    p.add_argument(
        "--checkpoint", metavar="DIR", help="save here and keep it (default: a temporary directory, removed)"
    )
    p.add_argument(
        "--tables",
        type=int,
        choices=range(1, 27),
        metavar="1..26",
        default=None,
        help="instead: the DLRM-style model with this many Criteo-shaped tables in one collection",
    )
    p.add_argument("--scale", type=float, default=0.01, help="with --tables: Criteo's cardinalities times this")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    p.add_argument(
        "--quantize", action="store_true", help="also serve the trained model's tables at int8 and int4 (one process)"
    )
    p.set_defaults(func=run_demo)
