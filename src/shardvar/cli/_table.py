"""Plain-text tables and human-readable sizes for the command line."""

from __future__ import annotations

from collections.abc import Sequence

from .._format import format_bytes

__all__ = ["format_bytes", "format_sizes", "render_table"]


def format_sizes(sizes: Sequence[int]) -> str:
    """Shard sizes, run-length coded when long: (3, 3, 2, 2) -> '3,3,2,2'; 16 x 500 -> '500 (x16)'."""
    if len(sizes) <= 8:
        return ",".join(map(str, sizes))
    runs: list[list[int]] = []
    for s in sizes:
        if runs and runs[-1][0] == s:
            runs[-1][1] += 1
        else:
            runs.append([s, 1])
    return ", ".join(f"{s} (x{c})" if c > 1 else str(s) for s, c in runs)


def render_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
