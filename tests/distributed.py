"""The one helper every multi-process test uses: run a worker on N ranks over gloo on loopback."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(
    world: int,
    worker: str,
    out_dir: Path,
    timeout: float = 180,
    expect_exit: dict[int, int] | None = None,
    **kwargs: Any,
) -> list[Any]:
    """Run ``dist_workers.<worker>(rank, world, **kwargs)`` on ``world`` processes; return each result.

    A rank listed in ``expect_exit`` must exit with that code and returns None.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    procs = []
    for rank in range(world):
        env = {
            **os.environ,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": str(HERE) + os.pathsep + os.environ.get("PYTHONPATH", ""),
        }
        cmd = [sys.executable, str(HERE / "dist_workers.py"), worker, json.dumps(kwargs), str(out_dir)]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    deadline = time.monotonic() + timeout
    outputs = []
    for p in procs:
        try:
            outputs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise AssertionError(f"worker {worker} did not finish within {timeout} s") from None
    expect_exit = expect_exit or {}
    results = []
    for rank, (p, (out, err)) in enumerate(zip(procs, outputs, strict=True)):
        want = expect_exit.get(rank, 0)
        assert p.returncode == want, f"rank {rank} exited {p.returncode} (wanted {want}):\n{out}\n{err}"
        path = out_dir / f"rank{rank}.pt"
        results.append(torch.load(path, weights_only=False) if want == 0 else None)
    return results


def batched(
    out_dir: Callable[[], Path], jobs: dict[Hashable, tuple[int, str, dict[str, Any]]]
) -> Callable[[Hashable], list[Any]]:
    """Results of ``jobs`` (key -> world, worker, kwargs) by key, each rank's; the jobs of a world run together.

    The first key asked for of a world runs all that world's jobs one after another in one group of
    processes (``dist_workers.many``): the cases of a parametrized test pay for one start of torch
    per rank instead of one per case. A job that must end its process cannot be batched.
    """
    done: dict[int, dict[Hashable, list[Any]] | AssertionError] = {}

    def results(key: Hashable) -> list[Any]:
        world = jobs[key][0]
        if world not in done:
            keys = [k for k, (w, _, _) in jobs.items() if w == world]
            try:
                runs = run_ranks(world, "many", out_dir(), 120 + 60 * len(keys), jobs=[jobs[k][1:] for k in keys])
                done[world] = {k: [rank["jobs"][i] for rank in runs] for i, k in enumerate(keys)}
            except AssertionError as e:  # every case of the batch fails with it, without running it again
                done[world] = e
        if isinstance(done[world], AssertionError):
            raise done[world]
        return done[world][key]

    return results
