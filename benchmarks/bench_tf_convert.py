"""Converting a TensorFlow checkpoint against reading its bytes, and the conversion's peak memory.

    python benchmarks/bench_tf_convert.py [--gib 1.0] [--shards 4] [--reps 3] [--dir /tmp/shardvar-bench-tf]

Writes one ``--gib`` float32 table as a TensorFlow bundle (3 slices, as a PartitionedVariable;
tests/tf_bundle.py, the writer the tests check against TensorFlow's own files), then, interleaved
in each repetition: the raw read (``readinto`` of the data file into new memory, page cache
warm), and
``shardvar.tf.convert`` into ``--shards`` div and mod shards (reads, crc32c checks, writes with
fsync), and their reading half alone (every target shard read and crc-checked, nothing written)
beside a raw write + fsync of the same bytes. Goal (issue 23): convert <= 1.2x the raw read (the
reading half is what can meet it: a conversion also writes every byte); peak RSS <= largest
shard + 64 MiB.
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
from shardvar import Layout
from tf_bundle import write_bundle


def _status(field: str) -> int:
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith(field + ":"))
    return int(line.split()[1]) * 1024


def _raw_read(path: Path) -> float:
    """``readinto`` of the whole file into new memory (as any loader must: the page faults count)."""
    start = time.perf_counter()
    buffer = torch.empty(path.stat().st_size, dtype=torch.uint8)
    with open(path, "rb", buffering=0) as f:
        f.readinto(memoryview(buffer.numpy()))
    return time.perf_counter() - start


def _raw_write(path: Path, nbytes: int) -> float:
    buffer = bytearray(nbytes)
    start = time.perf_counter()
    with open(path, "wb", buffering=0) as f:
        f.write(buffer)
        os.fsync(f.fileno())
    seconds = time.perf_counter() - start
    path.unlink()
    return seconds


def _read_shards(prefix: Path, shards: int, strategy: str) -> float:
    """The reading half of a conversion: every target shard read (and crc-checked), nothing written."""
    start = time.perf_counter()
    reader = shardvar.tf.TFCheckpoint(prefix)
    v = reader.variable("emb")
    layout = Layout.balanced(strategy, v.shape[0], shards)
    for s in range(shards):
        first, step, count = layout.shard_progression(s)
        reader.read_rows(v, first, first + step * count, step)
    reader.verify(v)
    return time.perf_counter() - start


def _convert(prefix: Path, out: Path, shards: int, strategy: str) -> tuple[float, int]:
    shutil.rmtree(out, ignore_errors=True)
    Path("/proc/self/clear_refs").write_text("5")  # peak RSS (VmHWM) := current RSS
    base = _status("VmRSS")
    start = time.perf_counter()
    shardvar.tf.convert(prefix, out, {"emb": "emb"}, num_shards=shards, strategy=strategy)
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
    names = ["raw read", "raw write+fsync", "read div", "read mod", "convert div", "convert mod"]
    times: dict[str, list[float]] = {name: [] for name in names}
    peaks: dict[str, int] = {}
    _raw_read(data)  # warm the page cache
    for _ in range(args.reps):
        times["raw read"].append(_raw_read(data))
        times["raw write+fsync"].append(_raw_write(root / "raw", data.stat().st_size))
        for strategy in ("div", "mod"):
            times[f"read {strategy}"].append(_read_shards(root / "ck", args.shards, strategy))
            seconds, peak = _convert(root / "ck", root / f"out-{strategy}", args.shards, strategy)
            times[f"convert {strategy}"].append(seconds)
            peaks[strategy] = max(peaks.get(strategy, 0), peak)
    base = statistics.median(times["raw read"])
    shard_mib = rows * cols * 4 / args.shards / 2**20
    rows_out = []
    for name, ts in times.items():
        strategy = name.split()[-1]
        peak = f"{peaks[strategy] / 2**20:.0f} MiB" if name.startswith("convert") else "-"
        rows_out.append([name, f"{statistics.median(ts) * 1e3:.0f}", f"{min(ts) * 1e3:.0f}-{max(ts) * 1e3:.0f}",
                         f"{statistics.median(ts) / base:.2f}x", peak])  # fmt: skip
    print(f"{args.gib} GiB table, {args.shards} target shards of {shard_mib:.0f} MiB, {args.reps} repetitions")
    print_table(["what", "median ms", "min-max ms", "vs raw read", "peak RSS growth"], rows_out)
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
