"""Converting a TensorFlow checkpoint against reading and writing its bytes, and the conversion's peak memory.

    python benchmarks/bench_tf_convert.py [--gib 1.0] [--shards 4] [--reps 3] [--dir /tmp/shardvar-bench-tf]

Writes one ``--gib`` float32 table as a TensorFlow bundle (3 slices, as a PartitionedVariable;
tests/tf_bundle.py, the writer the tests check against TensorFlow's own files), then, interleaved
in each repetition: the raw read (``readinto`` of the data file into new memory) with the page
cache warm and cold (the file dropped from it with ``posix_fadvise(DONTNEED)``), a raw write of
as many bytes (8 MiB at a time) + fsync, and ``shardvar.tf.convert`` into ``--shards`` div and
mod shards from a warm and a cold source (reads, crc32c checks, xxh3 sums, writes with fsync).
Goal (issue 23): convert <= 1.2x the raw read; peak RSS <= largest shard + 64 MiB. A conversion
also writes every byte, so it can take no less than max(read, write+fsync): both ratios are shown.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))
from _common import print_table

import shardvar.tf
from tf_bundle import write_bundle


def _status(field: str) -> int:
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith(field + ":"))
    return int(line.split()[1]) * 1024


def _drop(path: Path) -> None:
    """Evict ``path`` from the page cache (its pages are clean: written and fsynced before)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _raw_read(path: Path, cold: bool) -> float:
    """``readinto`` of the whole file into new memory (as any loader must: the page faults count)."""
    if cold:
        _drop(path)
    start = time.perf_counter()
    buffer = torch.empty(path.stat().st_size, dtype=torch.uint8)
    with open(path, "rb", buffering=0) as f:
        f.readinto(memoryview(buffer.numpy()))
    return time.perf_counter() - start


def _raw_write(path: Path, nbytes: int) -> float:
    """``nbytes`` written 8 MiB at a time to a new file, then fsync: the least a conversion writes."""
    buffer = memoryview(np.ones(2 << 20, np.float32).view(np.uint8))  # the bytes the table holds
    start = time.perf_counter()
    with open(path, "wb", buffering=0) as f:
        for offset in range(0, nbytes, len(buffer)):
            f.write(buffer[: min(len(buffer), nbytes - offset)])
        os.fsync(f.fileno())
    seconds = time.perf_counter() - start
    path.unlink()
    return seconds


def _convert(prefix: Path, data: Path, out: Path, shards: int, strategy: str, cold: bool) -> tuple[float, int]:
    shutil.rmtree(out, ignore_errors=True)
    if cold:
        _drop(data)
    Path("/proc/self/clear_refs").write_text("5")  # peak RSS (VmHWM) := current RSS
    base = _status("VmRSS")
    start = time.perf_counter()
    shardvar.tf.convert(prefix, out, {"emb": "emb"}, partitioner=shards, partition_strategy=strategy)
    return time.perf_counter() - start, _status("VmHWM") - base


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--dir", default="/tmp/shardvar-bench-tf")
    args = parser.parse_args()
    root = Path(args.dir)
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    cols = 256
    rows = int(args.gib * 2**30) // (4 * cols)
    write_bundle(
        root / "ck", {"emb": np.ones((rows, cols), np.float32)}, {"emb": [rows // 3, rows // 3, rows - 2 * (rows // 3)]}
    )
    data = root / "ck.data-00000-of-00001"
    with open(data, "rb+") as f:
        os.fsync(f.fileno())  # clean pages, which posix_fadvise can drop
    times: dict[str, list[float]] = {}
    peaks: dict[str, int] = {}
    for _ in range(args.reps):
        for cache in ("warm", "cold"):
            times.setdefault(f"raw read {cache}", []).append(_raw_read(data, cache == "cold"))
        times.setdefault("raw write+fsync", []).append(_raw_write(root / "raw", data.stat().st_size))
        for strategy in ("div", "mod"):
            for cache in ("warm", "cold"):
                name = f"convert {strategy} {cache}"
                seconds, peak = _convert(root / "ck", data, root / "out", args.shards, strategy, cache == "cold")
                times.setdefault(name, []).append(seconds)
                peaks[name] = max(peaks.get(name, 0), peak)
    _report(times, peaks, args, rows * cols * 4 / args.shards)
    shutil.rmtree(root, ignore_errors=True)


def _report(times: dict[str, list[float]], peaks: dict[str, int], args: argparse.Namespace, shard: float) -> None:
    med = {name: statistics.median(ts) for name, ts in times.items()}
    rows_out = []
    for name, ts in times.items():
        cache = name.split()[-1]
        read = med.get(f"raw read {cache}", med["raw read warm"])
        floor = max(read, med["raw write+fsync"])
        peak = f"{peaks[name] / 2**20:.0f}" if name in peaks else "-"
        rows_out.append([name, f"{med[name] * 1e3:.0f}", f"{min(ts) * 1e3:.0f}-{max(ts) * 1e3:.0f}",
                         f"{med[name] / read:.2f}x", f"{med[name] / floor:.2f}x", peak])  # fmt: skip
    print(f"{args.gib} GiB table, {args.shards} target shards of {shard / 2**20:.0f} MiB, {args.reps} repetitions, "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")  # fmt: skip
    print_table(
        ["what", "median ms", "min-max ms", "vs raw read (same cache)", "vs max(read, write+fsync)", "peak RSS MiB"],
        rows_out,
    )
    print(f"memory bound: largest shard + 64 MiB = {(shard + (64 << 20)) / 2**20:.0f} MiB")


if __name__ == "__main__":
    main()
