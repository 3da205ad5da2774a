"""The one helper every multi-process test uses: run a worker on N ranks over gloo on loopback."""

from __future__ import annotations

import json
import multiprocessing
import os
import socket
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


_SERVER: list[Any] = []


def _forked() -> Any:
    """Ranks start as forks of one server process that imported torch and shardvar once (a forkserver),
    not as fresh interpreters: each would spend seconds of the machine's two cores importing torch. The
    server computes nothing, so its forks are as clean as a new process (no threads, no process group)."""
    if not _SERVER:
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(["torch", "torch.distributed", "shardvar", "shardvar.distributed"])
        _SERVER.append(ctx)
    return _SERVER[0]


def _rank_main(env: dict[str, str], argv: list[str], log: str) -> None:
    """A rank: its output to ``log``.out/.err, its environment, one thread, then ``dist_workers.main``."""
    for fd, suffix in ((1, ".out"), (2, ".err")):
        os.dup2(os.open(log + suffix, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
    os.environ.clear()
    os.environ.update(env)
    sys.path.insert(0, str(HERE))
    sys.argv = argv
    torch.set_num_threads(1)  # OMP_NUM_THREADS=1, as a fresh process would read it
    import dist_workers

    dist_workers.main()


def _read(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


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
        argv = [str(HERE / "dist_workers.py"), worker, json.dumps(kwargs), str(out_dir)]
        log = out_dir / f"rank{rank}"
        procs.append(_forked().Process(target=_rank_main, args=(env, argv, str(log)), daemon=False))
        procs[-1].start()
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(1.0, deadline - time.monotonic()))
        if p.exitcode is None:
            for q in procs:
                q.kill()
                q.join()
            raise AssertionError(f"worker {worker} did not finish within {timeout} s")
    expect_exit = expect_exit or {}
    results = []
    for rank, p in enumerate(procs):
        want = expect_exit.get(rank, 0)
        out, err = (_read(out_dir / f"rank{rank}.{k}") for k in ("out", "err"))
        assert p.exitcode == want, f"rank {rank} exited {p.exitcode} (wanted {want}):\n{out}\n{err}"
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
