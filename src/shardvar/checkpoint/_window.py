"""Restoring a target shard in windows of rows, so a load stages a bounded piece at a time.

A destination the files cannot be read into directly (a tiered table's rows, strided views of its
backing file; a tensor on another device) is filled window by window: rows ``[a, b)`` of the
shard are restored into one bounded buffer and copied in, so the staging is at most
``WINDOW_BYTES`` whatever the shard's size. Every chunk was verified before the first write.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from ..layout import Layout
from ._manifest import VariableEntry
from ._restore import Files, restore_into, whole_layout

__all__ = ["WINDOW_BYTES", "restore_windows"]

WINDOW_BYTES = 64 << 20  # the most a load stages at once for a destination it cannot fill directly


class _Window:
    """Rows ``[a, b)`` of shard ``shard`` of ``layout``, as a one-shard target (shard 0)."""

    def __init__(self, layout: Layout, shard: int, a: int, b: int) -> None:
        self.layout, self.shard, self.a, self.b = layout, shard, a, b
        self.axis = layout.axis

    def shard_progression(self, shard: int) -> tuple[int, int, int]:
        start, step, _ = self.layout.shard_progression(self.shard)
        return start + step * self.a, step, self.b - self.a

    def locate(self, ids: torch.Tensor, check: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        owner, row = self.layout.locate(ids, check=False)
        mine = (owner == self.shard) & (row >= self.a) & (row < self.b)
        return torch.where(mine, 0, -1), row - self.a


def restore_windows(
    files: Files, entry: VariableEntry, target: Layout | None, shard: int, dest: torch.Tensor
) -> Iterator[tuple[int, torch.Tensor]]:
    # ``dest`` only sizes the windows; the caller copies each into it
    """(first row, rows) of shard ``shard`` of ``entry``, a window at a time (each a new bounded tensor)."""
    if entry.layout is None:  # a 0-d variable: one value
        out = torch.empty(entry.shape, dtype=entry.dtype)
        restore_into(files, entry, None, {0: out}, verify=True)
        yield dest, out
        return
    target = target or whole_layout(entry)
    axis = target.axis
    rows = target.shard_shape(entry.shape, shard)[axis]
    per_row = max(1, dest.numel() // max(rows, 1)) * entry.dtype.itemsize
    window = max(1, WINDOW_BYTES // per_row)
    shape = list(target.shard_shape(entry.shape, shard))
    for a in range(0, rows, window):
        b = min(rows, a + window)
        shape[axis] = b - a
        out = torch.empty(shape, dtype=entry.dtype)
        restore_into(files, entry, _Window(target, shard, a, b), {0: out}, verify=True)  # type: ignore[arg-type]
        yield dest.narrow(axis, a, b - a), out
