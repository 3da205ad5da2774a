"""The two processes of ``bench_tiered.py --capacity`` (see ``_capacity.py``), one per table.

    python benchmarks/_tiered_child.py tiered|memory FOLDER

``FOLDER`` holds ``args.json`` (the run's sizes), the batches, ``zipf.npy`` and ``uniform.npy``
(``[steps, batch, bag]``: ``warmup`` steps, then ``repeats`` pairs of ``steps``-step chunks, one
without read-ahead and one through the ``Prefetcher``), and ``hot.npy`` (the ids from the most
likely down, under the Zipf law). The child writes ``tiered.json`` or ``memory.json`` there.

``tiered`` (started inside the memory cap): the tiered table, its disk's random-read rate measured
on the backing file itself, the cache filled with the hottest rows (a cache of 10% of the rows
takes many steps to fill: timed before it is full, the steps would miss more than they will),
then every chunk timed with the cache's, the file's and the disk's counts per step. ``memory``
(uncapped): the same table held in memory, timed on the same batches.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

import shardvar
from shardvar import optim
from shardvar.tiered import Prefetcher, RowFile

DISTRIBUTIONS = ("zipf", "uniform")
MODES = ("off", "on")  # read-ahead through the Prefetcher


def _proc(name: str, key: str) -> int:
    for line in Path(f"/proc/self/{name}").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * (1024 if name == "status" else 1)
    raise RuntimeError(f"/proc/self/{name} has no {key}")


def disk_bytes() -> tuple[int, int]:
    """Bytes this process (all its threads) made the kernel read from and write to storage.

    Page-cache hits are not reads; a write of part of a page that is not cached reads it first.
    """
    return _proc("io", "read_bytes"), _proc("io", "write_bytes")


def peak_rss() -> int:
    """The process's peak resident set so far (VmHWM)."""
    return _proc("status", "VmHWM")


PASSES = ("filling the backing file", "widening it for the optimizer's state")  # both call Tiered(progress=)
_passes_done = [0]


def _progress(done: int, rows: int) -> None:
    what = PASSES[min(_passes_done[0], len(PASSES) - 1)]
    last = done == rows
    print(f"\r{what}: {done}/{rows} rows ({done / rows:.0%})", end="\n" if last else "", file=sys.stderr, flush=True)
    _passes_done[0] += last


def _table(args: dict, storage: shardvar.Tiered | None, peaks: dict[str, int]) -> torch.nn.Module:
    """The table, trained by fused RowWiseAdagrad; ``peaks``: peak RSS once made, once its optimizer took it."""
    torch.manual_seed(0)
    table = shardvar.ShardedEmbeddingBag(args["rows"], args["dim"], mode="sum", sparse=True, storage=storage)
    peaks["made"] = peak_rss()
    optim.fuse(optim.RowWiseAdagrad(table, lr=0.01))  # a tiered table's file is widened for the state here
    peaks["optimizer"] = peak_rss()
    return table


def _prefill(table: torch.nn.Module, hot: np.ndarray, piece: int) -> None:
    """Bring the hottest rows in (as many as the cache holds), so the timed steps start from a full cache,
    each marked changed, as in the steady state (every row in the cache was trained since it was read):
    a row the timed steps give up is written back, as it would be."""
    hot = hot[: table.cache_stats()["capacity_rows"]]
    for first in range(0, hot.size, piece):
        table.cache.mark_dirty(table.cache.resolve(torch.from_numpy(np.array(hot[first : first + piece]))))


class Batches:
    """The batches of a ``.npy`` file, a slice at a time: each slice copied from a map of the file made for it
    and dropped at once (a map kept open would hold every page read so far in the process's RSS)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __getitem__(self, part: slice) -> np.ndarray:
        mapped = np.load(self.path, mmap_mode="r")
        try:
            return np.array(mapped[part])
        finally:
            del mapped


def _step(
    module: torch.nn.Module, batches: np.ndarray, prefetch: bool, first: Callable[[], None] | None = None
) -> float:
    """Seconds per step of ``batches`` (``[steps, batch, bag]``) after the first, read ahead or not.

    A pipeline's first batch has nothing read ahead (no step before it knew its rows), so every chunk's
    first step runs untimed, in both modes and for both tables; ``first()`` is called after it (the
    counts start there too). A chunk of one step is timed whole."""
    tensors = [torch.from_numpy(b) for b in batches]
    loop = Prefetcher(tensors, lambda ids: [(module.cache, ids)]) if prefetch else tensors
    start, timed = time.perf_counter(), len(tensors)
    for i, ids in enumerate(loop):
        module(ids).sum().backward()
        if i == 0 and len(tensors) > 1:
            if first is not None:
                first()
            start, timed = time.perf_counter(), len(tensors) - 1
    return (time.perf_counter() - start) / timed


def warmup(args: dict, dist: str) -> int:
    """Untimed steps first (after the hottest rows were brought in): uniform ids, run after Zipf's, need fewer
    (each misses ~7x as many rows: the backing file's log fills as many times faster)."""
    return args["warmup"] if dist == "zipf" else max(min(args["warmup"], 2), args["warmup"] // 8)


def chunks(args: dict, w: int) -> list[tuple[str, slice]]:
    """(mode, steps) of each timed chunk after ``w`` warm-up steps: off and on alternate, a change in load hits both."""
    s = args["steps"]
    return [(mode, slice(w + (2 * r + i) * s, w + (2 * r + i + 1) * s)) for r in range(args["repeats"])
            for i, mode in enumerate(MODES)]  # fmt: skip


def probe(file: RowFile, reads: int, depth: int, seed: int) -> dict[str, float]:
    """Random reads of whole records per second through ``RowFile.read`` with ``depth`` in flight.

    The tier's own read path (sorted ids, consecutive ones in one call, ``depth`` reads in flight) on
    its own file, after dropping that file from the page cache: what a miss costs on this disk.
    """
    os.fsync(file.fd)  # dirty pages cannot be dropped
    os.posix_fadvise(file.fd, 0, 0, os.POSIX_FADV_DONTNEED)
    g = torch.Generator().manual_seed(seed)
    ids = torch.unique(torch.randint(0, file.layout.rows, (reads,), generator=g))
    reader = RowFile(file.path, file.fd, file.layout, depth)  # the table's open file: no second lock
    disk = disk_bytes()[0]
    start = time.perf_counter()
    reader.read(ids)
    seconds = time.perf_counter() - start
    reader._pool.shutdown()  # not close(): the fd is the table's
    return {"queue_depth": depth, "reads": ids.numel(), "reads_per_s": ids.numel() / seconds,
            "disk_bytes_per_read": (disk_bytes()[0] - disk) / ids.numel()}  # fmt: skip


WARMUP_PIECE = 16  # untimed steps whose batches are copied at once
COUNTS = ("hits", "misses", "written_back", "relocated", "bytes_read", "bytes_written", "disk_bytes_read",
          "disk_bytes_written")  # fmt: skip


def _train(table: torch.nn.Module, batches: Batches, args: dict, warmup: int) -> dict[str, dict]:
    """Per mode: the step time of each chunk, and the cache's, file's and disk's counts over them."""
    for first in range(0, warmup, WARMUP_PIECE):  # a piece at a time, each copied into RAM
        _step(table, batches[first : min(warmup, first + WARMUP_PIECE)], False)
    out = {m: {"seconds": [], "steps": 0, **dict.fromkeys(COUNTS, 0)} for m in MODES}
    for mode, part in chunks(args, warmup):
        before: dict = {}

        def counts(into: dict = before) -> None:  # (again after the chunk's first step: the timed steps' counts)
            into.update(table.cache_stats())
            into["disk_bytes_read"], into["disk_bytes_written"] = disk_bytes()

        counts()
        out[mode]["seconds"].append(_step(table, batches[part], mode == "on", counts))
        after: dict = {}
        counts(after)
        out[mode]["steps"] += max(1, part.stop - part.start - 1)
        for key in COUNTS:
            out[mode][key] += int(after[key] - before[key])
    return out


def tiered(folder: Path, args: dict) -> dict:
    # the backing file in the run's folder: removed by the parent even when the cap kills this process
    start = time.perf_counter()
    show = _progress if sys.stderr.isatty() else None
    storage = shardvar.Tiered(
        folder / "table.rows", cache_bytes=args["cache_bytes"], spare=args["spare"], progress=show
    )
    peaks: dict[str, int] = {}
    table = _table(args, storage, peaks)
    made = time.perf_counter() - start
    file = table.tier.file
    depths = sorted({1, storage.queue_depth})
    # more reads where more are in flight: each probe lasts about as long
    disk = [probe(file, args["probe_reads"] * (1 if d == 1 else 4), d, seed=d) for d in depths]
    start = time.perf_counter()
    _prefill(table, np.load(folder / "hot.npy", mmap_mode="r"), args["batch"] * args["bag"])
    prefill = time.perf_counter() - start
    runs = {}
    for d in DISTRIBUTIONS:
        runs[d] = _train(table, Batches(folder / f"{d}.npy"), args, warmup(args, d))
        peaks[d] = peak_rss()
    # and again after the steps: this disk's rate swings from run to run (the floor takes the faster one)
    after = [probe(file, args["probe_reads"] * (1 if d == 1 else 4), d, seed=100 + d) for d in depths]
    for before, later in zip(disk, after, strict=True):
        before["reads_per_s_after"] = later["reads_per_s"]
    stats = table.cache_stats()
    table.close()  # the changed rows written back: part of the process's peak too
    peaks["closed"] = peak_rss()
    return {"made_s": made, "prefill_s": prefill, "record_bytes": file.layout.record_bytes, "disk": disk,
            "queue_depth": storage.queue_depth, "runs": runs, "capacity_rows": stats["capacity_rows"],
            "bookkeeping_bytes": stats["bookkeeping_bytes"],
            "peak_rss": peak_rss(), "peak_rss_after": peaks}  # fmt: skip


def memory(folder: Path, args: dict) -> dict:
    table = _table(args, None, {})
    out = {}
    for d in DISTRIBUTIONS:
        batches = Batches(folder / f"{d}.npy")
        w = warmup(args, d)
        _step(table, batches[: min(w, 2)], False)
        out[d] = statistics.median(_step(table, batches[part], False) for _, part in chunks(args, w))
    return {"step_s": out, "peak_rss": peak_rss()}


MAIN: dict[str, Callable[[Path, dict], dict]] = {"tiered": tiered, "memory": memory}

if __name__ == "__main__":
    which, where = sys.argv[1], Path(sys.argv[2])
    result = MAIN[which](where, json.loads((where / "args.json").read_text()))
    (where / f"{which}.json").write_text(json.dumps(result))
