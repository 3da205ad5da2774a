"""Shared pieces of the benchmarks: Zipf ids, interleaved timers and the table, all from the package's CLI."""

from __future__ import annotations

from shardvar.cli._bench import compare, time_ms, zipf_ids
from shardvar.cli._console import print_table

__all__ = ["compare", "time_ms", "print_table", "zipf_ids"]
