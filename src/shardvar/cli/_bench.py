"""``shardvar bench``: lookup, scatter, training step, checkpoint and distributed lookup benchmarks.

Each row is a sharded operation timed against its unsharded baseline in the same run; the
ratios print as a table, go to a JSON file, and (with matplotlib) to a PNG chart. The
benchmarks/ scripts are the longer, more detailed versions.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.benchmark import Timer

from .._errors import ShardvarValueError
from ..checkpoint import load, save
from ..layout import Layout
from ..nn import ShardedEmbedding
from ..variables import embedding_lookup, shard_tensor
from ._bench_pages import SETTINGS, run_both_settings, use_setting
from ._console import print_table, step_progress

__all__ = ["add_bench_parser", "compare", "time_ms", "zipf_ids"]


def zipf_ids(num_ids: int, num_rows: int, exponent: float = 1.05, seed: int = 0) -> torch.Tensor:
    """Ids whose ranks follow a truncated Zipf law; hot ids are scattered over the table."""
    g = torch.Generator().manual_seed(seed)
    ranks = torch.arange(1, num_rows + 1, dtype=torch.float64)
    weights = (ranks**-exponent).float()
    sampled = torch.multinomial(weights, num_ids, replacement=True, generator=g)
    return torch.randperm(num_rows, generator=g)[sampled]


def _timer(fn: Callable[[], object]) -> Timer:
    # The caller's thread count, not Timer's default of one: the benchmarks time what a user runs.
    return Timer(stmt="fn()", globals={"fn": fn}, num_threads=torch.get_num_threads())


def time_ms(fn: Callable[[], object], repeats: int = 7) -> float:
    """Median time (ms) of one call of ``fn`` over ``repeats`` measurements (after Timer's warm-up)."""
    timer = _timer(fn)
    return statistics.median(timer.timeit(1).median for _ in range(repeats)) * 1e3


def compare(fn: Callable[[], object], baseline: Callable[[], object], repeats: int = 7) -> tuple[float, float]:
    """Median times (ms) of ``fn`` and ``baseline``, measured alternately in the same run.

    Each repetition times one call of each (``Timer.timeit(1)``, which warms up first) in turn, so a
    change in the machine's load lands on both; ``blocked_autorange`` would time one, then the other.
    """
    timers = _timer(fn), _timer(baseline)
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(repeats):
        for timer, out in zip(timers[::-1], times[::-1], strict=True):
            out.append(timer.timeit(1).median)
    return statistics.median(times[0]) * 1e3, statistics.median(times[1]) * 1e3


def _row(name: str, sharded_ms: float, baseline_ms: float, baseline: str) -> dict:
    return {
        "benchmark": name,
        "sharded_ms": sharded_ms,
        "baseline_ms": baseline_ms,
        "ratio": sharded_ms / baseline_ms,
        "baseline": baseline,
    }


def bench_lookup_and_scatter(args: argparse.Namespace) -> list[dict]:
    table = torch.randn(args.rows, args.dim)
    ids = zipf_ids(args.ids, args.rows)
    updates = torch.randn(args.ids, args.dim)
    rows = []
    for strategy in ("div", "mod"):
        v = shard_tensor(table, getattr(Layout, strategy)(args.rows, args.shards))
        t, b = compare(lambda v=v: embedding_lookup(v, ids), lambda: F.embedding(ids, table), args.repeats)
        rows.append(_row(f"embedding_lookup ({args.shards} {strategy} shards)", t, b, "F.embedding"))
        target = table.clone()
        t, b = compare(
            lambda v=v: v.scatter_add(ids, updates), lambda t=target: t.index_add_(0, ids, updates), args.repeats
        )
        rows.append(_row(f"scatter_add ({args.shards} {strategy} shards)", t, b, "Tensor.index_add_"))
    return rows


def bench_training_step(args: argparse.Namespace) -> list[dict]:
    torch.manual_seed(0)
    plain = nn.Embedding(args.rows, args.dim)
    sharded = ShardedEmbedding.from_pretrained(
        plain.weight, freeze=False, partitioner=args.shards, partition_strategy="mod"
    )
    ids = zipf_ids(args.ids // 4, args.rows).reshape(-1, 4)
    target = torch.randn(ids.shape[0], args.dim)

    def step(module: nn.Module, opt: torch.optim.Optimizer) -> None:
        loss = (module(ids).mean(1) - target).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()

    opts = torch.optim.Adam(sharded.parameters()), torch.optim.Adam(plain.parameters())
    t, b = compare(lambda: step(sharded, opts[0]), lambda: step(plain, opts[1]), args.repeats)
    return [_row(f"training step, Adam ({args.shards} mod shards)", t, b, "nn.Embedding + Adam")]


def bench_checkpoint(args: argparse.Namespace) -> list[dict]:
    rows = max(1, int(args.checkpoint_mib * 2**20) // (args.dim * 4))
    root = Path(tempfile.mkdtemp(prefix="shardvar-bench-"))
    try:
        v = shard_tensor(torch.randn(rows, args.dim), Layout.div(rows, args.shards))
        target = shard_tensor(torch.zeros(rows, args.dim), Layout.mod(rows, max(2, args.shards - 1)))
        raw = root / "raw.bin"

        def raw_write() -> None:
            with open(raw, "wb") as f:
                for s in v.variables:
                    f.write(memoryview(s.reshape(-1).view(torch.uint8).numpy()))
                f.flush()
                os.fsync(f.fileno())

        def raw_read() -> None:
            with open(raw, "rb") as f:
                for s in target.variables:
                    f.readinto(memoryview(s.reshape(-1).view(torch.uint8).numpy()))

        repeats = max(2, args.repeats // 2)
        t_save, b_save = compare(lambda: save({"t": v}, root / "ck"), raw_write, repeats)
        t_load, b_load = compare(lambda: load({"t": target}, root / "ck", staging_bytes=0), raw_read, repeats)
        if not torch.equal(target.to_tensor(), v.to_tensor()):
            raise ShardvarValueError("benchmark restore does not equal the saved variable")
        mib = rows * args.dim * 4 / 2**20
        return [
            _row(f"checkpoint save ({mib:.0f} MiB, {args.shards} shards)", t_save, b_save, "write + fsync"),
            _row(
                f"checkpoint restore into {max(2, args.shards - 1)} mod shards", t_load, b_load, "readinto (page cache)"
            ),
        ]
    finally:
        shutil.rmtree(root, ignore_errors=True)


def measure_distributed_lookup(rows: int, dim: int, batch: int, repeats: int) -> list[dict]:
    """Time lookups of ``batch`` Zipf ids per rank in a mod-sharded table (one shard per rank).

    Every rank of the initialised default group calls it; each gets every rank's
    ``{"ms": per lookup, "sent": bytes to other ranks per lookup, "bound": distinct remote ids x row bytes}``.
    """
    import torch.distributed as dist

    from ..distributed import DistributedEmbedding

    rank, world = dist.get_rank(), dist.get_world_size()
    emb = DistributedEmbedding(rows, dim, world, "mod")
    ids = zipf_ids(batch, rows, seed=100 + rank)
    comm = emb.variable.comm
    with torch.no_grad():
        emb(ids)
        dist.barrier()
        sent = comm.bytes_sent
        start = time.perf_counter()
        for _ in range(repeats):
            emb(ids)
        dist.barrier()
        seconds = (time.perf_counter() - start) / repeats
    unique = torch.unique(ids)
    remote = int((torch.tensor(emb.variable.placement)[emb.layout.locate(unique)[0]] != rank).sum())
    stats: list = [None] * world
    dist.all_gather_object(
        stats, {"ms": seconds * 1e3, "sent": (comm.bytes_sent - sent) / repeats, "bound": remote * dim * 4}
    )
    return stats


def _dist_worker(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=120))
    stats = measure_distributed_lookup(args.rows, args.dim, args.ids // world, args.repeats)
    if rank == 0:
        Path(out).write_text(json.dumps(stats))
    dist.destroy_process_group()


def bench_distributed(args: argparse.Namespace) -> list[dict]:
    import torch.multiprocessing as mp

    out = Path(tempfile.mkdtemp(prefix="shardvar-bench-")) / "dist.json"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    world = args.procs
    mp.spawn(_dist_worker, args=(world, port, args, str(out)), nprocs=world, join=True)
    stats = json.loads(out.read_text())
    shutil.rmtree(out.parent, ignore_errors=True)
    table = torch.randn(args.rows, args.dim)
    all_ids = zipf_ids(args.ids, args.rows)
    baseline = time_ms(lambda: F.embedding(all_ids, table), args.repeats)
    sharded = max(s["ms"] for s in stats)
    sent, bound = sum(s["sent"] for s in stats), sum(s["bound"] for s in stats)
    row = _row(f"distributed lookup ({world} procs, gloo)", sharded, baseline, "F.embedding, one process")
    row["bytes_sent_vs_bound"] = sent / bound if bound else None
    return [row]


def run_bench(args: argparse.Namespace) -> int:
    if args.huge_pages == "both":
        return run_both_settings(args, _chart)
    use_setting(args.huge_pages)
    suites = {
        "lookup": bench_lookup_and_scatter,
        "train": bench_training_step,
        "checkpoint": bench_checkpoint,
        "distributed": bench_distributed,
    }
    chosen = args.only or list(suites)
    print(
        f"shardvar bench: table {args.rows} x {args.dim} float32, {args.ids} Zipf(1.05) ids, "
        f"{args.shards} shards, {torch.get_num_threads()} threads; ratio = sharded / unsharded time\n"
    )
    results = []
    with step_progress(args.progress) as bar:
        task = bar.add_task("bench", total=len(chosen), status="")
        for name in chosen:
            bar.update(task, status=name)
            results += suites[name](args)
            bar.advance(task)
    table = []
    for r in results:
        extra = f"  (bytes sent {r['bytes_sent_vs_bound']:.3f}x the bound)" if r.get("bytes_sent_vs_bound") else ""
        table.append(
            [
                r["benchmark"],
                f"{r['sharded_ms']:.1f}",
                f"{r['baseline_ms']:.1f}",
                f"{r['ratio']:.2f}x{extra}",
                r["baseline"],
            ]
        )
    print_table(["benchmark", "sharded ms", "baseline ms", "ratio", "baseline"], table)
    Path(args.json).write_text(
        json.dumps({"settings": {k: v for k, v in vars(args).items() if k != "func"}, "results": results}, indent=1)
    )
    print(f"\nresults written to {args.json}")
    if args.png:
        _chart(results, args.png)
        print(f"chart written to {args.png}")
    return 0


def _chart(results: list[dict], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("shardvar bench: --png needs matplotlib: pip install 'shardvar[plot]'") from None
    fig, ax = plt.subplots(figsize=(8, 0.45 * len(results) + 1.2))
    names = [r["benchmark"] for r in results][::-1]
    ratios = [r["ratio"] for r in results][::-1]
    ax.barh(names, ratios, color=["tab:green" if x <= 1.1 else "tab:orange" for x in ratios])
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_xlabel("sharded time / unsharded time (lower is better)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmark sharded operations against their unsharded baselines")
    p.add_argument("--rows", type=int, default=1 << 19)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--ids", type=int, default=1 << 19)
    p.add_argument("--shards", type=int, default=8)
    p.add_argument("--procs", type=int, default=2, help="processes for the distributed lookup")
    p.add_argument("--checkpoint-mib", type=float, default=256.0)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--only", action="append", choices=["lookup", "train", "checkpoint", "distributed"])
    p.add_argument("--json", default="bench-results.json", help="where to write the results")
    p.add_argument("--png", help="also draw the ratios to this PNG (needs matplotlib)")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    p.add_argument(
        "--huge-pages",
        choices=["both", *SETTINGS],
        default="both",
        help="torch's THP_MEM_ALLOC_ENABLE off, on, or both",
    )
    p.set_defaults(func=run_bench)
