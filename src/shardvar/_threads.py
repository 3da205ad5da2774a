"""Independent native jobs run on the process's intra-op thread count: this thread and helpers.

A fused backward updates each table with a native kernel that runs without the interpreter's lock
(ctypes lets go of it), so the tables of a collection can be updated at once, one per core. The
calling thread takes jobs too, from the same list, so no thread waits while work is left.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

__all__ = ["run_all"]

_lock = threading.Lock()
_pools: dict[int, ThreadPoolExecutor] = {}  # by helper count, made on first use


def _forget_pools() -> None:
    """In a forked child: the parent's helper threads do not exist there (a pool would queue jobs forever)."""
    global _lock
    _lock = threading.Lock()
    _pools.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pools)


def run_all(jobs: Sequence[Callable[[], None]]) -> None:
    """Run every job, on up to ``torch.get_num_threads()`` threads; the first failure is raised once all ended."""
    helpers = min(len(jobs), torch.get_num_threads()) - 1
    if helpers <= 0:
        for job in jobs:
            job()
        return
    taken = iter(range(len(jobs)))
    take = threading.Lock()
    failures: list[BaseException] = []

    def drain() -> None:
        while True:
            with take:
                k = next(taken, None)
            if k is None:
                return
            try:
                jobs[k]()
            except BaseException as e:
                failures.append(e)

    with _lock:
        pool = _pools.get(helpers) or _pools.setdefault(helpers, ThreadPoolExecutor(helpers, "shardvar-jobs"))
    running = [pool.submit(drain) for _ in range(helpers)]
    drain()
    for f in running:
        f.result()
    if failures:
        raise failures[0]
