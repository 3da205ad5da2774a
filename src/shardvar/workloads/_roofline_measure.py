"""The roofline benchmark's measurements: probes, then every path timed in interleaved rounds.

The byte model is :mod:`shardvar.workloads._roofline`'s; ``shardvar bench --view roofline`` (and
``benchmarks/bench_roofline.py``) print the result this returns.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from torch.utils.benchmark import Timer

from .._pages import huge_pages_mode, torch_advises
from ._roofline import GOAL, Case, Sizes, cases
from ._roofline_probes import bandwidth, disk_rate

__all__ = ["default_threads", "measure"]


def default_threads() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _once(case: Case, fn: Callable[[], object], min_s: float) -> float:
    """Seconds of one call of ``fn``: the median of ``Timer.blocked_autorange``, or one call timed whole."""
    if not case.single_call:
        timer = Timer("fn()", globals={"fn": fn}, num_threads=torch.get_num_threads())
        return timer.blocked_autorange(min_run_time=min_s).median
    if case.prepare is not None:
        case.prepare()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _time_case(case: Case, rounds: int, min_s: float) -> tuple[list[float], list[float]]:
    """Per round, the path's and its baseline's seconds; which goes first alternates round by round."""
    mine: list[float] = []
    base: list[float] = []
    turns = [(case.fn, mine)] + ([(case.baseline, base)] if case.baseline is not None else [])
    for r in range(rounds):
        for fn, out in turns[:: 1 if r % 2 == 0 else -1]:
            out.append(_once(case, fn, min_s))
    return mine, base


def _path_result(case: Case, mine: list[float], base: list[float], rate: float) -> dict:
    """One path's JSON: its bytes by kind, its times (ms), GB/s and fractions of ``rate`` (GB/s)."""
    total = case.traffic.total
    fraction = total / statistics.median(mine) / 1e9 / rate
    return {
        "path": case.name,
        "bound": case.bound,
        "bytes": {**dataclasses.asdict(case.traffic), "total": total},
        "ms": [t * 1e3 for t in mine],
        "baseline_ms": [t * 1e3 for t in base] or None,
        "gb_per_s": total / statistics.median(mine) / 1e9,
        "fraction": fraction,
        "best_fraction": total / min(mine) / 1e9 / rate,
        "baseline_fraction": total / statistics.median(base) / 1e9 / rate if base else None,
        "meets_goal": fraction >= GOAL,
    }


def measure(sizes: Sizes, rounds: int, threads: int, directory: Path, min_s: float) -> dict:
    """Every probe and path (see the byte model); the results as the JSON the benchmark writes."""
    torch.set_num_threads(threads)
    memory = bandwidth(int(sizes.bandwidth_mib * 2**20), rounds, reps=3, threads=threads)
    disk = disk_rate(directory, int(sizes.checkpoint_mib * 2**20), rounds)
    rates = {"memory": max(memory["on"]["copy"]), "disk write": max(disk["write"]), "disk read": max(disk["read"])}
    paths = []
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Sparse invariant checks")  # torch.optim's sparse Adagrad, the baseline
        for case in cases(sizes, directory):
            mine, base = _time_case(case, rounds, min_s)
            paths.append(_path_result(case, mine, base, rates[case.bound]))
    settings = {**dataclasses.asdict(sizes), "rounds": rounds, "threads": threads, "dir": str(directory),
                "thp_mode": huge_pages_mode(), "paths_huge_pages": torch_advises(), "goal": GOAL}  # fmt: skip
    return {"settings": settings, "bandwidth": memory, "disk": disk, "denominators": rates, "paths": paths}
