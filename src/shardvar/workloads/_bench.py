"""``shardvar bench``'s suites: lookup, scatter, training step, checkpoint and distributed lookup.

Each row is a sharded operation timed against its unsharded baseline in the same run (see
``_timing``). Nothing here prints: the command line shows the rows, benchmarks/ reuse the suites.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import tempfile
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from .._errors import ShardvarValueError
from .._format import format_bytes
from .._pages import SWITCH, torch_advises
from ..checkpoint import load, save
from ..layout import Layout
from ..nn import ShardedEmbedding
from ..variables import embedding_lookup, shard_tensor
from ._timing import compare, time_ms, zipf_ids

__all__ = [
    "BENCH_SUITES",
    "HUGE_PAGE_SETTINGS",
    "BenchSettings",
    "bench_checkpoint",
    "bench_distributed",
    "bench_lookup_and_scatter",
    "bench_training_step",
    "measure_distributed_lookup",
    "use_huge_page_setting",
]

HUGE_PAGE_SETTINGS = {"off": "0", "on": "1"}  # torch's switch (THP_MEM_ALLOC_ENABLE) under each setting


@dataclass(frozen=True)
class BenchSettings:
    """Sizes of ``shardvar bench``: a ``rows`` x ``dim`` float32 table, ``ids`` Zipf ids, ``shards`` shards."""

    rows: int = 1 << 19
    dim: int = 64
    ids: int = 1 << 19
    shards: int = 8
    procs: int = 2
    checkpoint_mib: float = 256.0
    repeats: int = 7


def _row(name: str, sharded_ms: float, baseline_ms: float, baseline: str) -> dict:
    return {
        "benchmark": name,
        "sharded_ms": sharded_ms,
        "baseline_ms": baseline_ms,
        "ratio": sharded_ms / baseline_ms,
        "baseline": baseline,
    }


def bench_lookup_and_scatter(args: BenchSettings) -> list[dict]:
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


def bench_training_step(args: BenchSettings) -> list[dict]:
    torch.manual_seed(0)
    plain = nn.Embedding(args.rows, args.dim)
    sharded = ShardedEmbedding.from_pretrained(
        plain.weight, freeze=False, partitioner=args.shards, partition_strategy="mod"
    )
    ids = zipf_ids(max(1, args.ids // 16) * 4, args.rows).reshape(-1, 4)  # a quarter of the ids, in bags of 4
    target = torch.randn(ids.shape[0], args.dim)

    def step(module: nn.Module, opt: torch.optim.Optimizer) -> None:
        loss = (module(ids).mean(1) - target).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()

    opts = torch.optim.Adam(sharded.parameters()), torch.optim.Adam(plain.parameters())
    t, b = compare(lambda: step(sharded, opts[0]), lambda: step(plain, opts[1]), args.repeats)
    return [_row(f"training step, Adam ({args.shards} mod shards)", t, b, "nn.Embedding + Adam")]


def bench_checkpoint(args: BenchSettings) -> list[dict]:
    rows = max(args.shards, int(args.checkpoint_mib * 2**20) // (args.dim * 4))  # a row per shard at least
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
        size = format_bytes(rows * args.dim * 4)  # what was written, not the MiB asked for (rounded to rows)
        return [
            _row(f"checkpoint save ({size}, {args.shards} shards)", t_save, b_save, "write + fsync"),
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


def _dist_worker(rank: int, world: int, port: int, args: BenchSettings, out: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=120))
    stats = measure_distributed_lookup(args.rows, args.dim, args.ids // world, args.repeats)
    if rank == 0:
        Path(out).write_text(json.dumps(stats))
    dist.destroy_process_group()


def bench_distributed(args: BenchSettings) -> list[dict]:
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


BENCH_SUITES = {
    "lookup": bench_lookup_and_scatter,
    "train": bench_training_step,
    "checkpoint": bench_checkpoint,
    "distributed": bench_distributed,
}


def use_huge_page_setting(setting: str) -> None:
    """Set torch's switch for this process's benchmarks; refused once torch has read another value."""
    os.environ[SWITCH] = HUGE_PAGE_SETTINGS[setting]
    if torch_advises() != (setting == "on"):
        raise ShardvarValueError(
            f"--huge-pages {setting}: torch read {SWITCH} at its first allocation, before this command; "
            "run `shardvar bench` as a program (or with --huge-pages both) to choose the setting"
        )
