"""RowFile's transfers in Python: the fallback of the native kernel (``_native_io.c``), its steps one by one.

Used where no C compiler is there or ``SHARDVAR_NATIVE=0``: the same bytes and the same errors,
a system call per run of consecutive records (3-4x slower on page-cache reads).
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from . import _native

__all__ = ["python_transfer", "run_parts", "runs"]


def runs(ids: np.ndarray) -> list[tuple[int, int, int]]:
    """(first position, first id, count) of each run of consecutive ids in ascending ``ids``."""
    if ids.size == 0:
        return []
    cuts = np.flatnonzero(np.diff(ids) != 1) + 1
    starts = np.concatenate(([0], cuts))
    counts = np.diff(np.concatenate((starts, [ids.size])))
    return list(zip(starts.tolist(), ids[starts].tolist(), counts.tolist(), strict=True))


def python_transfer(file: Any, ids: np.ndarray, buffer: np.ndarray, write: bool, nowait: bool, header: int) -> None:
    """``RowFile``'s transfer in Python: the native kernel's steps, a system call per run."""
    todo, size = runs(ids), file.layout.record_bytes
    call = os.pwritev if write else os.preadv

    def work(part: list[tuple[int, int, int]]) -> None:
        for pos, first, count in part:
            view, at = memoryview(buffer[pos : pos + count]).cast("B"), header + first * size
            done = 0
            while done < len(view):  # short only at the end of the file (or past 2 GiB): go on from there
                step = call(file.fd, [view[done:]], at + done)
                if step == 0:
                    raise _native.short_transfer(write, at + done)
                done += step

    if not write and nowait:
        todo = _cached(file, todo, buffer, size, header)  # the rest must wait for the disk: many in flight
        if not todo:
            return
    per = -(-len(todo) // file.queue_depth)
    parts = [todo[i : i + per] for i in range(0, len(todo), per)]
    run_parts(file._pool, work, parts, file.inline)


Runs = list[tuple[int, int, int]]


def _cached(file: Any, runs: Runs, buffer: np.ndarray, size: int, header: int) -> Runs:
    """Read the runs the page cache holds, here, without waiting (``RWF_NOWAIT``); return the others.

    A read from the page cache takes microseconds: handed to the pool's threads, each would wait far
    longer for the interpreter's lock than it reads. Only a read that must reach the disk goes there."""
    left = []
    for run in runs:
        pos, first, count = run
        view = memoryview(buffer[pos : pos + count]).cast("B")
        try:
            done = os.preadv(file.fd, [view], header + first * size, os.RWF_NOWAIT)
        except BlockingIOError:
            done = 0
        except OSError as e:  # no RWF_NOWAIT on this file system: every read goes to the pool
            if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise
            return runs
        if done != count * size:  # not (all) cached: the whole run again, from the pool
            left.append(run)
    return left


def run_parts(pool: ThreadPoolExecutor, work: Callable, parts: list, inline: bool) -> None:
    """``work(part)`` for every part on the pool's threads (on this one when ``inline``, a finalizer, or
    when the pool shut down as the interpreter exits); the first part's error in order, whatever the timing."""
    futures = None
    if not inline:
        try:
            futures = [pool.submit(work, part) for part in parts]
        except RuntimeError:
            futures = None
    if futures is None:
        for part in parts:
            work(part)
    for f in futures or ():
        f.result()
