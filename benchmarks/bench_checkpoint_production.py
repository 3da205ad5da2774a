"""Checkpoints for production: asynchronous saves, delta saves, serving reads.

    python benchmarks/bench_checkpoint_production.py [--gib 1.0] [--repeats 3] [--quick]

Goals (issue 17):
- async: the training loop is blocked per save (the call until it returns) at most 1/10 of a
  synchronous save of the same table; both measured in this run, interleaved, medians.
- delta: after steps touching 1% of the rows, the delta is at most 2% of the full checkpoint.
- serving: lookups from ``shardvar.open`` against lookups in the loaded table (lookups/s), and
  the memory each approach adds to a fresh process (RSS, in a subprocess).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import torch
from torch.utils import benchmark

sys.path.insert(0, str(Path(__file__).parent))
from _common import print_table

import shardvar

DIM = 64

MEMORY = textwrap.dedent(
    """
    import json, sys, torch, shardvar
    def rss(key):
        return int(next(l for l in open("/proc/self/status") if l.startswith(key)).split()[1]) * 1024
    path, mode, rows = sys.argv[1], sys.argv[2], int(sys.argv[3])
    ids = torch.randint(0, rows, (100_000,), generator=torch.Generator().manual_seed(0))
    before = rss("RssAnon"), rss("RssFile")
    if mode == "served":
        table = shardvar.open(path)["t/weight"]
        out = table.lookup(ids[:4096])
    else:
        t = shardvar.read_shard(path, "t/weight")
        out = t[ids[:4096]]
    print(json.dumps({"private": rss("RssAnon") - before[0], "file": rss("RssFile") - before[1]}))
    """
)


def files_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.iterdir() if not p.name.startswith("spare-"))


def bench_async(root: Path, rows: int, repeats: int) -> list[list[object]]:
    emb = shardvar.ShardedEmbedding(rows, DIM, 8, "div")
    sync_s, blocked_s, total_s = [], [], []
    for _ in range(repeats):  # interleaved: a synchronous save, then an asynchronous one
        start = time.perf_counter()
        shardvar.save({"t": emb}, root / "sync", keep_spare=False)
        sync_s.append(time.perf_counter() - start)
        start = time.perf_counter()
        handle = shardvar.save({"t": emb}, root / "async", keep_spare=False, asynchronous=True)
        blocked_s.append(time.perf_counter() - start)
        handle.wait()
        total_s.append(time.perf_counter() - start)
    sync, blocked = statistics.median(sync_s), statistics.median(blocked_s)
    return [
        ["save, synchronous (s)", f"{sync:.3f}", f"{min(sync_s):.3f}-{max(sync_s):.3f}", ""],
        ["async: loop blocked, first save (s)", f"{blocked_s[0]:.3f}", "", ""],
        ["async: loop blocked (s)", f"{blocked:.3f}", f"{min(blocked_s):.3f}-{max(blocked_s):.3f}", ""],
        ["async: until committed (s)", f"{statistics.median(total_s):.3f}", "", ""],
        ["async blocked / sync", f"{blocked / sync:.3f}", "", "<= 0.1"],
    ]


def bench_delta(root: Path, rows: int) -> list[list[object]]:
    emb = shardvar.ShardedEmbedding(rows, DIM, 8, "mod", sparse=True)
    opt = torch.optim.SGD(emb.parameters(), lr=0.1)
    shardvar.save({"t": emb}, root / "base", keep_spare=False)
    hot = torch.randperm(rows)[: rows // 100]
    for _ in range(3):
        emb(hot[torch.randint(0, hot.numel(), (hot.numel(),))]).sum().backward()
        opt.step()
        opt.zero_grad()
    start = time.perf_counter()
    shardvar.save({"t": emb}, root / "delta", delta_of=root / "base", keep_spare=False)
    delta_s = time.perf_counter() - start
    start = time.perf_counter()
    shardvar.save({"t": emb}, root / "full", keep_spare=False)
    full_s = time.perf_counter() - start
    ratio = files_size(root / "delta") / files_size(root / "full")
    return [
        ["delta size / full size (1% rows)", f"{ratio:.4f}", "", "<= 0.02"],
        ["delta save / full save (time)", f"{delta_s / full_s:.2f}", f"{delta_s:.3f} s / {full_s:.3f} s", ""],
    ]


def bench_serving(root: Path, rows: int) -> list[list[object]]:
    ids = torch.randint(0, rows, (4096,), generator=torch.Generator().manual_seed(1))
    table = shardvar.read_shard(root / "full", "t/weight")
    served = shardvar.open(root / "full")["t/weight"]
    served.lookup(torch.arange(rows))  # verify every chunk once, as a long-running server has
    t_served = benchmark.Timer("served.lookup(ids)", globals={"served": served, "ids": ids}).blocked_autorange()
    t_loaded = benchmark.Timer("table[ids]", globals={"table": table, "ids": ids}).blocked_autorange()
    script = root / "memory.py"
    script.write_text(MEMORY)
    grew = {}
    for mode in ("served", "loaded"):
        out = subprocess.run([sys.executable, str(script), str(root / "full"), mode, str(rows)], capture_output=True)
        grew[mode] = {k: v / 2**20 for k, v in json.loads(out.stdout).items()}
    return [
        ["served lookups/s (4096 ids)", f"{4096 / t_served.median:,.0f}", "", ""],
        ["loaded-table lookups/s", f"{4096 / t_loaded.median:,.0f}", "", ""],
        ["served / loaded time", f"{t_served.median / t_loaded.median:.2f}", "", ""],
        ["private memory added: open + 4096 ids (MiB)", f"{grew['served']['private']:.1f}", "", ""],
        ["shared page cache mapped: open + 4096 ids (MiB)", f"{grew['served']['file']:.1f}", "", ""],
        ["private memory added: load + 4096 ids (MiB)", f"{grew['loaded']['private']:.1f}", "", ""],
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=1.0, help="table size")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="a 16 MiB table, 1 repeat (a smoke test)")
    args = parser.parse_args()
    gib, repeats = (1 / 64, 1) if args.quick else (args.gib, args.repeats)
    rows = int(gib * 2**30) // (DIM * 4)
    root = Path(tempfile.mkdtemp(prefix="shardvar-bench-"))
    try:
        print(f"table {rows} x {DIM} float32 ({rows * DIM * 4 / 2**30:.3f} GiB), {repeats} repeats, {root}")
        rows_out = bench_async(root, rows, repeats) + bench_delta(root, rows) + bench_serving(root, rows)
        print_table(["measure", "median", "range", "goal"], rows_out)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
