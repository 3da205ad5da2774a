"""``bench_tiered.py --capacity``: a table larger than the memory cap, trained under that cap.

Issue 38's capacity run: a ``2**25 x 64`` tiered table (8 GiB of rows) with a 1 GiB cache, trained
by fused ``RowWiseAdagrad`` in a process held in a cgroup v1 memory cgroup capped at 2 GiB. The
cgroup (a child of this process's own memory cgroup, so every limit above still holds) is made
when run as root with cgroup v1's memory controller mounted, and removed at the end; otherwise (or
with ``--no-cgroup``) the run goes on uncapped and says so. The cap counts the page cache too, so
most of the file stays out of it: misses are read from the disk.

Three processes (``_tiered_child.py``): this one makes the batches (Zipf(1.05) and uniform ids,
so neither child holds a sampler's table-sized buffers); the in-memory table of the same shape runs
them uncapped (it cannot fit under the cap); the tiered table runs them inside the cap, after
measuring its disk: random reads of one record through the tier's own read path (``RowFile.read``)
on its backing file, dropped from the page cache first, at queue depth 1 and at the tier's.

Reported: peak RSS against ``cache + 512 MiB``, the cgroup's peak (page cache included), the disk's
read rates, and per distribution with and without the ``Prefetcher``: the step, the in-memory
step, the floor ``max(in-memory step, misses per step / reads per second at the tier's depth)``
and the step's ratio to it (goal <= 1.3x), hit rate, misses, bytes the tier read and wrote, and
bytes the kernel read from the disk, per step.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import _tiered_child
import numpy as np
import torch
from _tiered_report import report

MEMORY = Path("/sys/fs/cgroup/memory")
CHILD = Path(__file__).parent / "_tiered_child.py"


def _own_cgroup() -> Path | None:
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            return MEMORY / path.lstrip("/")
    return None


@contextlib.contextmanager
def capped(cap: int, enabled: bool) -> Iterator[Path | None]:
    """A new memory cgroup of ``cap`` bytes to start a process in (None: no cgroup, with a message why)."""
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
        except OSError as e:
            print(f"capacity run: memory cap skipped ({e}): the run is not capped")
            with contextlib.suppress(OSError):
                group.rmdir()
            group = None
    try:
        yield group
    finally:
        if group is not None:
            group.rmdir()  # its process has exited; v1 moves what it still charges to the parent


def zipf(n: int, rows: int, exponent: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` ids whose ranks follow a truncated Zipf law, hot ids scattered over the table; the ids by rank.

    The distribution of ``shardvar.workloads.zipf_ids`` by its inverse CDF, which (unlike
    ``torch.multinomial``) takes more than 2**24 rows.
    """
    g = torch.Generator().manual_seed(seed)
    cdf = torch.cumsum(torch.arange(1, rows + 1, dtype=torch.float64) ** -exponent, 0)
    ranks = torch.searchsorted(cdf, torch.rand(n, dtype=torch.float64, generator=g) * cdf[-1])
    order = torch.randperm(rows, generator=g)
    return order[ranks.clamp_(max=rows - 1)], order


def _batches(args: argparse.Namespace, folder: Path) -> None:
    """The ids of every step, warm-up first (``_tiered_child.chunks``), one file per distribution."""
    for name in _tiered_child.DISTRIBUTIONS:
        steps = _tiered_child.warmup(vars(args), name) + 2 * args.repeats * args.steps
        n = steps * args.batch * args.bag
        if name == "zipf":
            ids, order = zipf(n, args.rows, 1.05, seed=0)
            np.save(folder / "hot.npy", order.numpy())
        else:
            ids = torch.randint(0, args.rows, (n,), generator=torch.Generator().manual_seed(1))
        np.save(folder / f"{name}.npy", ids.view(steps, args.batch, args.bag).numpy())


# glibc's allocator, as a process under a hard cap should run it (README, "Sizing the cache"): its mmap
# threshold fixed (by default it rises to 32 MiB as large arrays are freed, and every later array under
# that stays in its heap when freed) and two arenas (not one per thread). Measured at 2^25 rows and a
# 1 GiB cache, uncapped: peak RSS 1631 MiB with glibc's defaults, 1491 MiB with these.
CAPPED_MALLOC = {"MALLOC_MMAP_THRESHOLD_": "262144", "MALLOC_TRIM_THRESHOLD_": "1048576", "MALLOC_ARENA_MAX": "2"}


def _child(which: str, folder: Path, group: Path | None, malloc: dict[str, str]) -> int:
    """Run one child to its end (inside ``group`` from its first instruction, when given): its exit status."""
    command = [sys.executable, str(CHILD), which, str(folder)]
    if group is not None:  # the shell joins the cgroup, then becomes Python: nothing runs uncapped
        procs = shlex.quote(str(group / "cgroup.procs"))
        command = ["sh", "-c", f'echo $$ > {procs} && exec "$@"', "sh", *command]
    env = {**os.environ, **malloc, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    return subprocess.run(command, env=env, check=False).returncode


def _group_counts(group: Path | None) -> dict[str, int] | None:
    """The cgroup's peak usage (page cache included), how often it reached the cap, OOM kills in it."""
    if group is None:
        return None
    read = {k: int((group / f"memory.{k}").read_text()) for k in ("max_usage_in_bytes", "failcnt")}
    oom = (group / "memory.oom_control").read_text().split()
    kills = int(oom[oom.index("oom_kill") + 1]) if "oom_kill" in oom else 0
    return {"peak": read["max_usage_in_bytes"], "failcnt": read["failcnt"], "oom_kills": kills}


def run(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory(dir=args.folder) as where:
        folder = Path(where)
        names = ("rows", "dim", "batch", "bag", "steps", "repeats", "warmup", "cache_bytes", "cap_bytes", "probe_reads",
                 "glibc_defaults", "spare")  # fmt: skip
        config = {k: getattr(args, k) for k in names}
        (folder / "args.json").write_text(json.dumps(config))
        _batches(args, folder)
        if (status := _child("memory", folder, None, {})) != 0:
            raise SystemExit(f"capacity run: the in-memory process failed with exit status {status}")
        with capped(args.cap_bytes, not args.no_cgroup) as group:
            status = _child("tiered", folder, group, {} if args.glibc_defaults else CAPPED_MALLOC)
            counts = _group_counts(group)
        if status != 0:
            raise SystemExit(f"capacity run: the tiered process failed with exit status {status}"
                             + (f"; its cgroup: {counts}" if counts else ""))  # fmt: skip
        memory, tiered = (json.loads((folder / f"{w}.json").read_text()) for w in ("memory", "tiered"))
    result = report(config, memory, tiered, counts)
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
