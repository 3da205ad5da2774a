"""Shared pieces of the benchmarks: Zipf ids and timers (from the package), and a ratio table."""

from __future__ import annotations

from shardvar.cli._timing import compare, median_ms, zipf_ids

__all__ = ["compare", "median_ms", "print_table", "zipf_ids"]


def print_table(headers: list[str], rows: list[list[object]]) -> None:
    cells = [headers] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    for i, r in enumerate(cells):
        print("  ".join(c.rjust(w) if j else c.ljust(w) for j, (c, w) in enumerate(zip(r, widths, strict=True))))
        if i == 0:
            print("  ".join("-" * w for w in widths))
