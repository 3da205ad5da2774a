"""Timing helpers shared by ``shardvar bench`` and the scripts in benchmarks/."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

__all__ = ["zipf_ids", "median_ms", "compare"]


def zipf_ids(num_ids: int, num_rows: int, exponent: float = 1.05, seed: int = 0) -> torch.Tensor:
    """Ids whose ranks follow a truncated Zipf law; hot ids are scattered over the table."""
    g = torch.Generator().manual_seed(seed)
    ranks = torch.arange(1, num_rows + 1, dtype=torch.float64)
    weights = (ranks**-exponent).float()
    sampled = torch.multinomial(weights, num_ids, replacement=True, generator=g)
    return torch.randperm(num_rows, generator=g)[sampled]


def median_ms(fn: Callable[[], object], repeats: int = 7, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def compare(fn: Callable[[], object], baseline: Callable[[], object], repeats: int = 7) -> tuple[float, float]:
    """Median times (ms) of ``fn`` and ``baseline``, measured alternately in the same run."""
    a, b = [], []
    for _ in range(repeats):
        b.append(median_ms(baseline, repeats=1, warmup=1))
        a.append(median_ms(fn, repeats=1, warmup=1))
    return statistics.median(a), statistics.median(b)
