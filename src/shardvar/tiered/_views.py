"""A backing file's rows and state as tensors over the file itself, for checkpoints.

``records(file)`` maps the file (``numpy.memmap``, shared): its values and state columns are then
strided views, ``[rows, dim]`` and ``[rows, state_width]``, whose pages the kernel reads from and
writes to the file as they are touched, so a table larger than memory is never held in it. A
checkpoint writes such a view through its ``stream`` (bounded copies of consecutive rows) and a
load copies into the views in place (one shard staged at a time).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from ..variables import ShardsView
from ._file import HEADER, RowFile

__all__ = ["STREAM_ROWS", "mapped", "sharded_view"]

STREAM_ROWS = 1 << 14  # rows copied out of the file per piece a checkpoint writes


def mapped(file: RowFile) -> tuple[Any, torch.Tensor, torch.Tensor]:
    """(the map, values ``[rows, dim]``, state ``[rows, state_width]``): views of ``file``'s records."""
    layout = file.layout
    if layout.rows == 0:
        raw = np.zeros((0, layout.record_bytes), dtype=np.uint8)
    else:
        raw = np.memmap(file.path, dtype=np.uint8, mode="r+", offset=HEADER, shape=(layout.rows, layout.record_bytes))
    values, state = layout.split(torch.from_numpy(raw))
    return raw, values, state


def sharded_view(
    layout: Any, shape: tuple[int, ...], logical: torch.Tensor, owned: tuple[int, ...] | None = None
) -> ShardsView:
    """``logical`` (a view of the file) as the shards of ``layout``, also views: the file's rows are the
    table's in logical order, or (``owned``) those shards' only, back to back in that order (a rank's)."""
    shards = {}
    if owned is not None:
        first = 0
        for s in owned:
            shards[s] = logical[first : first + layout.sizes[s]]
            first += layout.sizes[s]
    for s in range(layout.num_shards) if owned is None else ():
        start, step, count = layout.shard_progression(s)
        shards[s] = logical[start : start + step * count : step] if count else logical[:0]

    def stream() -> Iterator[tuple[int, int, torch.Tensor]]:
        for s, rows in shards.items():
            for first in range(0, rows.shape[0], STREAM_ROWS):
                piece = rows[first : first + STREAM_ROWS]
                # a bounded copy with unit strides (a one-row slice of the file counts as contiguous)
                yield s, first, torch.empty(piece.shape, dtype=piece.dtype).copy_(piece)

    return ShardsView(layout, shape, logical.dtype, shards, None, stream)
