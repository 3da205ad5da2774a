"""Distributed lookups: throughput with 1, 2 and 4 processes, and bytes sent against the lower bound.

    python benchmarks/bench_distributed.py [--rows 262144] [--dim 64] [--batch 65536]

Each configuration runs under torchrun on this machine (gloo over loopback). Every rank looks
up its own batch of Zipf(1.05) ids. The lower bound on bytes sent per lookup is the number of
distinct ids a rank needs from other ranks times the row size (those rows must cross); goal
(issue 5): at most 1.1x the bound. Throughput is ids looked up per second, all ranks together,
against one process doing the same total lookups on an unsharded table with F.embedding.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _common import print_table, zipf_ids


def worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    from shardvar.cli._bench import measure_distributed_lookup

    dist.init_process_group("gloo")
    stats = measure_distributed_lookup(args.rows, args.dim, args.batch, args.repeats)
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(stats))
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=1 << 18)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=1 << 16)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--procs", default="1,2,4")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default="/tmp/shardvar-bench-dist.json", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    table = torch.randn(args.rows, args.dim)
    rows = []
    baseline = None
    for procs in map(int, args.procs.split(",")):
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(procs), __file__, "--worker",
            "--rows", str(args.rows), "--dim", str(args.dim), "--batch", str(args.batch),
            "--repeats", str(args.repeats), "--out", args.out,
        ]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // procs))}
        subprocess.run(cmd, check=True, env=env, capture_output=True)
        stats = json.loads(Path(args.out).read_text())
        seconds = max(s["ms"] for s in stats) / 1e3  # per lookup
        rate = procs * args.batch / seconds
        ids = [zipf_ids(args.batch, args.rows, seed=100 + r) for r in range(procs)]
        start = time.perf_counter()
        for _ in range(args.repeats):
            for i in ids:
                torch.nn.functional.embedding(i, table)
        single = procs * args.batch * args.repeats / (time.perf_counter() - start)
        baseline = baseline or rate
        sent, bound = sum(s["sent"] for s in stats), sum(s["bound"] for s in stats)
        ratio = f"{sent / bound:.3f}x" if bound else "-"
        rows.append([
            procs, f"{rate / 1e6:.2f} M", f"{rate / single:.2f}x", f"{rate / baseline:.2f}x",
            f"{sent / procs / 1024:.0f} KiB", f"{bound / procs / 1024:.0f} KiB", ratio,
        ])  # fmt: skip
    print(
        f"table {args.rows} x {args.dim} float32 (mod, one shard per rank), {args.batch} Zipf ids per rank per lookup\n"
    )
    print_table(
        ["procs", "ids/s", "vs F.embedding", "vs 1 proc", "sent/rank/lookup", "bound/rank", "sent / bound"], rows
    )


if __name__ == "__main__":
    main()
