"""Shared pieces of the benchmarks: Zipf ids and interleaved timers (``shardvar.workloads``), and the
command line's table."""

from __future__ import annotations

from shardvar.cli import print_table
from shardvar.workloads import compare, time_ms, zipf_ids

__all__ = ["compare", "time_ms", "print_table", "zipf_ids"]
