"""Ranks of a gloo group on this machine, each running a benchmark's ``measure``; rank 0's result comes back.

One launcher for the distributed benchmarks (``bench_distributed``, ``bench_weak_scaling``, the guard's
rows that call them): a free loopback port, the ranks started (spawned, or forked from a process that
has run no torch op yet), each with its own number of threads, and a barrier before any rank tears its
group down while another still works.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["gloo_ranks"]


def _rank(
    rank: int, world: int, port: int, measure: Callable[..., Any], kwargs: dict, threads: int, queue: Any
) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=300))
    try:
        stats = measure(**kwargs)
        if rank == 0:
            queue.put(stats)
        dist.barrier()  # no rank tears its group down while another still works
    finally:
        dist.destroy_process_group()


def gloo_ranks(
    measure: Callable[..., Any], kwargs: dict, world: int, threads: int, start_method: str = "spawn"
) -> Any:
    """``measure(**kwargs)`` on ``world`` ranks of ``threads`` threads each; rank 0's result.

    ``start_method="fork"``: the ranks are forks of this process, which must not have run torch ops
    yet (a fork inherits no usable thread pool); they then import nothing again.
    """
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    queue = mp.get_context(start_method).SimpleQueue()
    args = (world, port, measure, kwargs, threads, queue)
    mp.start_processes(_rank, args=args, nprocs=world, join=True, start_method=start_method)
    return queue.get()
