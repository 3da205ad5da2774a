"""A backing file's record reads and writes: the native kernel against the Python path (issue 38).

    python benchmarks/bench_tiered_io.py [--rows 4194304] [--counts 4096 16384] [--repeats 9] [--folder DIR] [--quick]

A file of ``--rows`` records of 264 bytes (64 float32 values and one state slot, the tiered
benchmark's table), written, synced and dropped from the page cache (``RowFile.settle``); each set of
ids is read once first, so the page cache holds its pages: the reads measured are what a training
step's misses cost when the disk is not the limit. For each count, random distinct ids
(ascending, as the cache asks for them) are read into a staging buffer with ``read_into`` and
written back with ``write_from``, once through the Python path (``os.preadv`` per run) and once
through the native kernel, interleaved, ``--repeats`` times; medians. Also the time of a first
compile of the kernel (into an empty cache folder).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _common import print_table

from shardvar.tiered import RecordLayout, RowFile, _native
from shardvar.tiered._file import HEADER


def first_compile() -> float:
    """Seconds to compile the kernel into an empty cache folder (what a user's first table waits)."""
    saved = os.environ.get("XDG_CACHE_HOME")
    with tempfile.TemporaryDirectory() as folder:
        os.environ["XDG_CACHE_HOME"] = folder
        try:
            start = time.perf_counter()
            _native.built()
            return time.perf_counter() - start
        finally:
            if saved is None:
                os.environ.pop("XDG_CACHE_HOME")
            else:
                os.environ["XDG_CACHE_HOME"] = saved


def timed(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=1 << 22)
    p.add_argument("--counts", type=int, nargs="+", default=[4096, 16384])
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--folder", type=Path, default=None)
    p.add_argument("--quick", action="store_true", help="a small file, 3 repeats (the test suite's run)")
    args = p.parse_args()
    if args.quick:
        args.rows, args.counts, args.repeats = 1 << 14, [256, 1024], 3
    kernel = _native.kernel()
    if kernel is None:
        sys.exit("no native kernel here (no C compiler, or SHARDVAR_NATIVE=0): nothing to compare")
    print(f"first compile of the kernel: {first_compile():.2f} s")
    layout = RecordLayout(args.rows, 64, "float32", 1)
    with tempfile.TemporaryDirectory(dir=args.folder) as folder:
        zeros = lambda ids: (torch.zeros(ids.numel(), 64), torch.zeros(ids.numel(), 1))  # noqa: E731
        f = RowFile.create(Path(folder) / "io.rows", layout, zeros)
        rows, g = [], torch.Generator().manual_seed(0)
        for count in args.counts:
            ids = torch.randperm(args.rows, generator=g)[:count].sort().values
            runs = 1 + int((ids.diff() != 1).sum())
            out = torch.empty((count, layout.record_bytes), dtype=torch.uint8)
            f.read_into(ids, out)  # into the page cache, page by page (create dropped the file: RowFile.settle)
            waited = kernel.transfer(f.fd, ids.numpy(), out.numpy(), layout.record_bytes, HEADER, False, True, 32)
            times = {}
            for kind, engine in (("python", None), ("native", kernel)):
                f._native = engine
                times[kind, "read"] = timed(lambda i=ids, o=out: f.read_into(i, o), args.repeats)
                times[kind, "write"] = timed(lambda i=ids, o=out: f.write_from(i, o), args.repeats)
            for op in ("read", "write"):
                py, nat = times["python", op], times["native", op]
                rows.append([f"{op} {count} ({runs} runs)", f"{py * 1e3:.2f} ms", f"{nat * 1e3:.3f} ms",
                             f"{py / nat:.1f}x", f"{nat / runs * 1e6:.2f} us"])  # fmt: skip
            assert waited == 0, f"{waited} runs were not in the page cache"
        f.close()
    print(f"{args.rows} records of {layout.record_bytes} B, page-cached; medians of {args.repeats}")
    print_table(["transfer", "python", "native", "python / native", "native per run"], rows)


if __name__ == "__main__":
    main()
