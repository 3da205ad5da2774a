"""How ``cache_bytes`` is split: the cache's slots, the read-ahead reserve, the staging and write-behind areas.

One place for the arithmetic a ``Tiered`` table, ``cache_bytes_for`` and a cache's "too small"
error share: every row and state the table holds in RAM comes out of ``cache_bytes``.
"""

from __future__ import annotations

import torch

from .._errors import ShardvarValueError
from .._validate import check_int, check_number
from ._cache import STAGING_ROWS
from ._file import RecordLayout

__all__ = ["bytes_for", "cache_bytes_for", "capacity"]

STAGING_SHARE = 32  # the staging area's share of cache_bytes, and the write-behind area's: 1/32 each (<= STAGING_ROWS)


def cache_bytes_for(
    slots: int,
    dim: int,
    *,
    rows: int | None = None,
    state_width: int = 0,
    dtype: torch.dtype = torch.float32,
    read_ahead: float = 0.125,
) -> int:
    """The least ``cache_bytes`` giving ``slots`` rows in the cache of a ``rows`` x ``dim`` table whose optimizer
    keeps ``state_width`` float32 per row (row-wise Adagrad: 1; Adam: ``2 * dim``), besides its read-ahead
    reserve (``read_ahead``) and its staging and write-behind areas."""
    check_int(slots, "slots", minimum=1)
    check_int(dim, "dim", minimum=1)
    table_rows = slots if rows is None else check_int(rows, "rows", minimum=1)
    layout = RecordLayout(table_rows, dim, str(dtype).removeprefix("torch."), check_int(state_width, "state_width"))
    return bytes_for(slots, check_number(read_ahead, "read_ahead", minimum=0.0), layout)


def _split(cache_bytes: int, read_ahead: float, layout: RecordLayout) -> tuple[int, int, int]:
    """(slots, read-ahead records, staging records) of ``cache_bytes``, slots possibly 0."""
    per_row = layout.row_bytes + 4 * layout.state_width
    reserve = min(int(cache_bytes * read_ahead) // layout.record_bytes, max(layout.rows, 1))
    # the staging area every record read or written passes through: 1/32 of the budget, 1 to STAGING_ROWS
    staging = max(1, min(STAGING_ROWS, cache_bytes // STAGING_SHARE // layout.record_bytes, layout.rows))
    # the write-behind area (rows an eviction gives up, written on a thread) is as large as the staging area
    slots = max(0, cache_bytes - (reserve + 2 * staging) * layout.record_bytes) // per_row
    return min(slots, max(layout.rows, 1)), reserve, staging


def capacity(cache_bytes: int, read_ahead: float, layout: RecordLayout) -> tuple[int, int, int]:
    """(slots, read-ahead records, staging records) within ``cache_bytes``; refused if no slot is left."""
    budget = _split(cache_bytes, read_ahead, layout)
    if budget[0] < 1:
        raise ShardvarValueError(
            f"cache_bytes={cache_bytes} holds no row: one row and its state take "
            f"{layout.row_bytes + 4 * layout.state_width} bytes, besides the staging and write-behind areas "
            f"({budget[2]} record(s) of {layout.record_bytes} bytes each)"
            + (f" and the read-ahead reserve ({read_ahead} of it)" if budget[1] else "")
            + f"; give it at least {bytes_for(1, read_ahead, layout)}"
        )
    return budget


def bytes_for(rows: int, read_ahead: float, layout: RecordLayout) -> int:
    """The least ``cache_bytes`` (found by doubling, then bisection) whose slots hold ``rows`` rows."""
    rows = min(rows, max(layout.rows, 1))
    high = max(rows * (layout.row_bytes + 4 * layout.state_width), 1)
    while _split(high, read_ahead, layout)[0] < rows:
        high *= 2
    low = high // 2
    while low + 1 < high:  # the slots grow with cache_bytes but for one reserve or staging record: bisect
        mid = (low + high) // 2
        low, high = (low, mid) if _split(mid, read_ahead, layout)[0] >= rows else (mid, high)
    return high
