"""Checkpoint save/restore throughput against plain file I/O, and the peak RSS of a reshard-restore.

    python benchmarks/bench_checkpoint.py [--gib 1.0] [--dir /tmp/shardvar-bench]

Also torch's distributed checkpoint (DCP) loading the same bytes as one tensor, in the same run.

Goals (issue 4): save and restore at least 0.5x the throughput of writing/reading the same bytes
with plain file I/O (write + fsync, readinto), measured in the same run; an 8 -> 3 shard restore
peaks at most 64 MiB above the largest target shard. Reads are from the page cache, for both.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

sys.path.insert(0, str(Path(__file__).parent))
from _common import print_table

import shardvar
from shardvar import Layout

RSS_PROBE = textwrap.dedent(
    """
    import sys, torch, shardvar
    from shardvar import Layout
    path, rows, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    def status(key):
        return int(next(l for l in open("/proc/self/status") if l.startswith(key)).split()[1]) * 1024
    target = Layout.mod(rows, 3)
    open("/proc/self/clear_refs", "w").write("5")  # reset the peak (VmHWM) to the current RSS
    base = status("VmRSS")
    if mode == "read_shard":
        for s in range(3):
            shard = shardvar.read_shard(path, "table", target, s)
            del shard
    else:
        shardvar.reshard(path, path + "-resharded", 3, "mod")
    print(base, status("VmHWM"))
    """
)


def raw_write(path: Path, shards: list[torch.Tensor]) -> None:
    with open(path, "wb") as f:
        for s in shards:
            f.write(memoryview(s.reshape(-1).view(torch.uint8).numpy()))
        f.flush()
        os.fsync(f.fileno())


def raw_read(path: Path, shards: list[torch.Tensor]) -> None:
    with open(path, "rb") as f:
        for s in shards:
            f.readinto(memoryview(s.reshape(-1).view(torch.uint8).numpy()))


def drop_cache(root: Path) -> None:
    for path in root.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--dir", default="/tmp/shardvar-bench")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    root = Path(args.dir)
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    dim = 64
    rows = int(args.gib * (1 << 30)) // (dim * 4)
    nbytes = rows * dim * 4
    variable = shardvar.shard_tensor(torch.randn(rows, dim), Layout.div(rows, 8))
    target_same = shardvar.shard_tensor(torch.zeros(rows, dim), Layout.div(rows, 8))
    target_mod = shardvar.shard_tensor(torch.zeros(rows, dim), Layout.mod(rows, 3))
    ck = root / "ckpt"
    mod3 = Layout.mod(rows, 3)
    dcp_dir = root / "dcp"
    dcp.save({"table": variable.to_tensor()}, checkpoint_id=str(dcp_dir), no_dist=True)  # one tensor: no resharding
    dcp_target = torch.zeros(rows, dim)
    runs = {
        "raw write": lambda: raw_write(root / "raw.bin", variable.variables),
        "save": lambda: shardvar.save({"table": variable}, ck),
        "raw read": lambda: raw_read(root / "raw.bin", target_same.variables),
        "raw read new": lambda: raw_read(root / "raw.bin", [torch.empty_like(s) for s in target_same.variables]),
        "restore 8 div": lambda: shardvar.checkpoint.read_shards(ck, "table", Layout.div(rows, 8)),
        "restore 3 mod": lambda: shardvar.checkpoint.read_shards(ck, "table", mod3),
        "load 8 div": lambda: shardvar.load({"table": target_same}, ck, staging_bytes=0),
        "load 3 mod": lambda: shardvar.load({"table": target_mod}, ck, staging_bytes=0),
        "dcp load": lambda: dcp.load({"table": dcp_target}, checkpoint_id=str(dcp_dir), no_dist=True),
    }
    results: dict[str, list[float]] = {}
    for cache in ("warm", "cold"):
        for _ in range(args.repeats):
            for name, fn in runs.items():
                if cache == "cold" and "write" not in name and name != "save":
                    drop_cache(root)
                elif cache == "cold":
                    continue
                results.setdefault(f"{name} {cache}", []).append(timed(fn))
    assert torch.equal(target_mod.to_tensor(), variable.to_tensor()) and torch.equal(dcp_target, variable.to_tensor())
    best = {k: min(v) for k, v in results.items()}
    print(
        f"{nbytes / (1 << 30):.2f} GiB variable ({rows} x {dim} float32, saved as 8 div shards); best of {args.repeats}"
    )
    print("warm: files in the page cache; cold: evicted first (posix_fadvise DONTNEED), read from disk\n")
    table = [
        [
            "save (8 div shards)",
            "-",
            f"{best['save warm']:.2f}",
            f"{nbytes / best['save warm'] / 1e9:.2f}",
            f"{best['raw write warm'] / best['save warm']:.2f}x",
        ]
    ]
    table.append(
        [
            "plain write + fsync",
            "-",
            f"{best['raw write warm']:.2f}",
            f"{nbytes / best['raw write warm'] / 1e9:.2f}",
            "1.00x",
        ]
    )
    for cache in ("warm", "cold"):
        for name, label, baseline in (
            ("load 8 div", "load into 8 div shards (verify, then fill)", "raw read"),
            ("load 3 mod", "load into 3 mod shards (verify, then fill)", "raw read"),
            ("raw read", "plain readinto existing tensors", "raw read"),
            ("restore 8 div", "restore -> 8 new div shards (read_shards)", "raw read new"),
            ("restore 3 mod", "restore -> 3 new mod shards (read_shards)", "raw read new"),
            ("raw read new", "plain readinto new tensors", "raw read new"),
            ("dcp load", "torch DCP load, same layout (no resharding)", "raw read"),
        ):
            t, raw = best[f"{name} {cache}"], best[f"{baseline} {cache}"]
            table.append([label, cache, f"{t:.2f}", f"{nbytes / t / 1e9:.2f}", f"{raw / t:.2f}x"])
    print_table(["operation", "cache", "seconds", "GB/s", "vs plain file I/O"], table)
    largest = max(Layout.mod(rows, 3).sizes) * dim * 4
    print(f"\npeak RSS of an 8 -> 3 shard restore (largest target shard {largest / (1 << 20):.0f} MiB):\n")
    rss_rows = []
    for mode in ("read_shard", "reshard"):
        out = subprocess.run(
            [sys.executable, "-c", RSS_PROBE, str(ck), str(rows), mode], capture_output=True, text=True, check=True
        )
        base, peak = map(int, out.stdout.split())
        extra = (peak - base - largest) / (1 << 20)
        rss_rows.append(
            [mode, f"{(peak - base) / (1 << 20):.0f} MiB", f"{extra:+.0f} MiB", "yes" if extra <= 64 else "NO"]
        )
    print_table(["restore", "peak RSS growth", "above largest shard", "within +64 MiB"], rss_rows)
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
