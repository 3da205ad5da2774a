"""The benchmarks' timing harness: Zipf ids, and sharded and baseline calls timed alternately.

``shardvar bench`` and the scripts in benchmarks/ time with these.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch
from torch.utils.benchmark import Timer

__all__ = ["compare", "time_ms", "zipf_ids"]


def zipf_ids(num_ids: int, num_rows: int, exponent: float = 1.05, seed: int = 0) -> torch.Tensor:
    """Ids whose ranks follow a truncated Zipf law; hot ids are scattered over the table."""
    g = torch.Generator().manual_seed(seed)
    ranks = torch.arange(1, num_rows + 1, dtype=torch.float64)
    weights = (ranks**-exponent).float()
    sampled = torch.multinomial(weights, num_ids, replacement=True, generator=g)
    return torch.randperm(num_rows, generator=g)[sampled]


def _timer(fn: Callable[[], object]) -> Timer:
    # The caller's thread count, not Timer's default of one: the benchmarks time what a user runs.
    return Timer(stmt="fn()", globals={"fn": fn}, num_threads=torch.get_num_threads())


def time_ms(fn: Callable[[], object], repeats: int = 7) -> float:
    """Median time (ms) of one call of ``fn`` over ``repeats`` measurements (after Timer's warm-up)."""
    timer = _timer(fn)
    return statistics.median(timer.timeit(1).median for _ in range(repeats)) * 1e3


def compare(fn: Callable[[], object], baseline: Callable[[], object], repeats: int = 7) -> tuple[float, float]:
    """Median times (ms) of ``fn`` and ``baseline``, measured alternately in the same run.

    Each repetition times one call of each (``Timer.timeit(1)``, which warms up first) in turn, so a
    change in the machine's load lands on both; ``blocked_autorange`` would time one, then the other.
    """
    timers = _timer(fn), _timer(baseline)
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(repeats):
        for timer, out in zip(timers[::-1], times[::-1], strict=True):
            out.append(timer.timeit(1).median)
    return statistics.median(times[0]) * 1e3, statistics.median(times[1]) * 1e3
