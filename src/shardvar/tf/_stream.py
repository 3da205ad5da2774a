"""One pass over a TensorFlow variable feeding every target shard: read ahead in a thread, split, write.

A thread reads chunks of logical rows (``readinto`` a reused buffer, crc32c as they pass) at
most two chunks ahead of the checkpoint writer, which hashes (xxh3), writes and fsyncs them, so
reading and writing overlap, and memory stays at three chunk buffers plus one split buffer
whatever the table's size. In a div layout a chunk is a run of one shard's rows (chunks are cut
at shard boundaries) and goes to the writer as read, with no copy. In a mod layout over n shards
a chunk of rows [a, b), with a a multiple of n, is a run of local rows from a // n of EVERY
shard (row r is local row r // n of shard r % n): one transposing copy splits it, so the table
is read once, not once per shard.
"""

from __future__ import annotations

import math
import queue
import threading
from collections.abc import Callable, Iterable, Iterator

import numpy as np
import torch

from ..layout import Layout
from ._reader import CHUNK_BYTES, TFCheckpoint, TFVariable

__all__ = ["streams", "stream_rows"]

AHEAD = 2  # chunks read ahead of the writer


def streams(layout: Layout) -> bool:
    """Whether ``layout``'s shards are contiguous runs (div) or every n-th row (mod): what one pass can feed."""
    n = layout.num_shards
    progressions = [layout.shard_progression(s) for s in range(n)]
    return all(step == 1 for _, step, _ in progressions) or all(
        (start, step) == (s, n) for s, (start, step, _) in enumerate(progressions)
    )


def stream_rows(reader: TFCheckpoint, v: TFVariable, layout: Layout) -> Iterator[tuple[int, int, torch.Tensor]]:
    """(shard, first local row, rows) pieces of ``v`` in ``layout``, each shard's in order; every crc checked."""
    n = layout.num_shards
    progressions = [layout.shard_progression(s) for s in range(n)]
    mod = n > 1 and progressions[0][1] == n
    rest = v.shape[1:]
    per = max(1, CHUNK_BYTES // max(1, math.prod(rest) * reader.dtype(v).itemsize))
    if mod:
        per = max(n, per - per % n)  # every chunk but the last starts at a multiple of n
        jobs = [(-1, a, min(a + per, v.shape[0])) for a in range(0, v.shape[0], per)]
    else:
        jobs = [(s, a, min(a + per, start + count)) for s, (start, _, count) in enumerate(progressions)
                for a in range(start, start + count, per)]  # fmt: skip
    dtype = reader.dtype(v)
    buffers = [torch.empty((per, *rest), dtype=dtype) for _ in range(AHEAD + 1)]
    split = torch.empty((n, per // n, math.prod(rest) * dtype.itemsize), dtype=torch.uint8) if mod else None

    def fill(job: tuple[int, int, int], buffer: torch.Tensor) -> torch.Tensor:
        _, a, b = job
        return reader.read_rows(v, a, b, out=buffer[: b - a])

    for (shard, a, _), rows in ahead(fill, jobs, buffers):
        if split is None:
            yield shard, a - progressions[shard][0], rows
            continue
        k, r = divmod(len(rows), n)
        # numpy's single-threaded copy: torch's pool of threads is 20-30x slower on a busy machine
        src, dst = _bytes(rows), split.numpy()
        np.copyto(dst[:, :k], src[: k * n].reshape(k, n, dst.shape[2]).transpose(1, 0, 2))
        if r:  # the last chunk's tail: one row more for shards 0..r-1
            np.copyto(dst[:r, k], src[k * n :])
        for s in range(n):  # one write per shard and chunk, never per row
            if k + (s < r):
                yield s, a // n, split[s, : k + (s < r)].view(dtype).view(k + (s < r), *rest)
    reader.verify(v)  # every byte of v has passed its crc32c before the writer commits


def _bytes(rows: torch.Tensor) -> np.ndarray:
    """Rows as a (rows, bytes per row) uint8 array, for any dtype (numpy has no bfloat16)."""
    return rows.view(len(rows), -1 if rows.numel() else 0).view(torch.uint8).numpy()


def ahead(
    fill: Callable[[object, torch.Tensor], torch.Tensor], jobs: Iterable, buffers: list[torch.Tensor]
) -> Iterator[tuple[object, torch.Tensor]]:
    """``(job, fill(job, buffer))`` for each job, filled in a thread at most ``len(buffers) - 1`` ahead.

    A buffer goes back to the thread when the consumer asks for the next job, so what it was
    handed stays intact until then. An error in the thread is raised here; closing early stops it.
    """
    free: queue.Queue = queue.Queue()
    ready: queue.Queue = queue.Queue()
    for b in buffers:
        free.put(b)
    stop = threading.Event()

    def run() -> None:
        try:
            for job in jobs:
                buffer = free.get()
                if stop.is_set():
                    return
                ready.put((job, buffer, fill(job, buffer)))
            ready.put(None)
        except BaseException as e:  # handed to the consumer, which raises it
            ready.put(e)

    thread = threading.Thread(target=run, name="shardvar-tf-read", daemon=True)
    thread.start()
    try:
        while (item := ready.get()) is not None:
            if isinstance(item, BaseException):
                raise item
            job, buffer, filled = item
            yield job, filled
            free.put(buffer)
    finally:
        stop.set()
        free.put(None)  # wakes the thread if it waits for a buffer
        thread.join()
