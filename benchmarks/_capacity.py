"""``bench_tiered.py --capacity``: a table larger than the memory cap, trained under that cap.

Issue 38's capacity run: a ``2**25 x 64`` tiered table (8 GiB of rows) with a 1 GiB cache, trained
by fused ``RowWiseAdagrad`` through the ``Prefetcher`` on Zipf(1.05) ids while this process sits
in a cgroup v1 memory cgroup capped at 2 GiB. The cgroup (a child of the process's own memory
cgroup, so every limit above still holds) is made when run as root with cgroup v1's memory
controller mounted, and removed at the end; otherwise (or with ``--no-cgroup``) the run goes on
uncapped and says so. Reported: peak RSS against ``cache + 512 MiB``, the cgroup's peak usage
(page cache included), hit rate, misses, and bytes read and written per step.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import resource
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from _common import print_table, zipf_ids

import shardvar
from shardvar import optim
from shardvar.tiered import Prefetcher

MEMORY = Path("/sys/fs/cgroup/memory")
SLACK = 512 << 20  # what the process may hold besides the cache: Python, torch, a batch


def _own_cgroup() -> Path | None:
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            return MEMORY / path.lstrip("/")
    return None


@contextlib.contextmanager
def capped(cap: int, enabled: bool) -> Iterator[Path | None]:
    """This process in a new memory cgroup of ``cap`` bytes (None: no cgroup, with a message why)."""
    parent = _own_cgroup() if enabled and MEMORY.is_dir() else None
    if not enabled:
        print("capacity run: memory cap skipped (--no-cgroup): the run is not capped")
    elif os.geteuid() != 0 or parent is None:
        print("capacity run: memory cap skipped (needs root and cgroup v1's memory controller): the run is not capped")
        parent = None
    group = None
    if parent is not None:
        group = parent / f"shardvar-bench-{os.getpid()}"
        try:
            group.mkdir()
            (group / "memory.limit_in_bytes").write_text(str(cap))
            (group / "cgroup.procs").write_text(str(os.getpid()))
        except OSError as e:
            print(f"capacity run: memory cap skipped ({e}): the run is not capped")
            with contextlib.suppress(OSError):
                group.rmdir()
            group = None
    try:
        yield group
    finally:
        if group is not None:
            (parent / "cgroup.procs").write_text(str(os.getpid()))  # back where it was, then the group goes
            group.rmdir()


def run(args: argparse.Namespace) -> None:
    rows, cache_bytes, cap = args.rows, args.cache_bytes, args.cap_bytes
    with capped(cap, not args.no_cgroup) as group, tempfile.TemporaryDirectory(dir=args.folder) as folder:
        start = time.perf_counter()
        storage = shardvar.Tiered(Path(folder) / "table.rows", cache_bytes=cache_bytes)
        table = shardvar.ShardedEmbeddingBag(rows, args.dim, mode="sum", sparse=True, storage=storage)
        optim.fuse(optim.RowWiseAdagrad(table, lr=0.01))
        made = time.perf_counter() - start
        ids = zipf_ids(args.batch * args.bag * args.steps, rows, 1.05).view(-1, args.batch, args.bag)
        before = table.cache_stats()
        start = time.perf_counter()
        for batch in Prefetcher(list(ids), lambda b: [(table.cache, b)]):
            table(batch).sum().backward()
        step = (time.perf_counter() - start) / args.steps
        after = table.cache_stats()
        peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        group_peak = int((group / "memory.max_usage_in_bytes").read_text()) if group is not None else None
        table.close()
    per = {k: (after[k] - before[k]) / args.steps for k in ("misses", "bytes_read", "bytes_written")}
    looked = (after["hits"] - before["hits"]) + (after["misses"] - before["misses"])
    bound = cache_bytes + SLACK
    mib = 1 << 20
    print_table(
        ["capacity run", "value"],
        [
            ("table", f"{rows} x {args.dim} ({rows * args.dim * 4 / mib:.0f} MiB of rows)"),
            ("cache / cap", f"{cache_bytes / mib:.0f} MiB / " + (f"{cap / mib:.0f} MiB" if group else "none")),
            ("made (file filled, widened)", f"{made:.1f} s"),
            ("peak RSS / (cache + 512 MiB)", f"{peak_rss / mib:.0f} / {bound / mib:.0f} MiB: "
             + ("within" if peak_rss <= bound else "OVER")),
            ("cgroup peak (page cache too)", f"{group_peak / mib:.0f} MiB" if group_peak is not None else "no cgroup"),
            ("step", f"{step * 1e3:.1f} ms"),
            ("hit rate", f"{(after['hits'] - before['hits']) / looked if looked else 0.0:.3f}"),
            ("misses per step", f"{per['misses']:.0f}"),
            ("bytes read / written per step", f"{per['bytes_read']:.0f} / {per['bytes_written']:.0f}"),
        ],
        title="tables larger than memory: capped-memory run",
    )  # fmt: skip
