"""A tier that holds some shards of a table: a distributed table's rank keeps its own shards' file.

The file holds the ``owned`` shards' rows back to back (shard by shard, each in its local row
order); :class:`ShardRows` is addressed by the table's logical ids, as a whole table's tier is, and
turns them into rows of its file (``TieredRows`` does the rest: cache, optimizer state, write-back).
A checkpoint sees the owned shards only, each a view of its piece of the file.
"""

from __future__ import annotations

from typing import Any

import torch

from ..variables import TierSink
from ._storage import TieredRows

__all__ = ["ShardRows"]


class ShardRows:
    """The ``RowTier`` of the shards ``owned`` of a table laid out by ``layout``, over ``rows`` (their file)."""

    def __init__(self, rows: TieredRows, layout: Any, owned: tuple[int, ...]) -> None:
        self.rows, self.layout, self.owned = rows, layout, tuple(owned)
        self.sink: TierSink | None = None
        sizes = torch.tensor([0, *(layout.sizes[s] for s in self.owned)], dtype=torch.int64)
        # the file row of each owned shard's first row (-1: not here, never asked for: ids reach their owner)
        self._first = torch.full((layout.num_shards,), -1, dtype=torch.int64)
        self._first[list(self.owned)] = sizes.cumsum(0)[:-1]

    def file_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The rows of this rank's file that hold logical ``ids`` (ids of owned shards)."""
        shard, row = self.layout.strategy.locate(self.layout.sizes, ids.reshape(-1).to(torch.int64))
        return (self._first.index_select(0, shard) + row).view(ids.shape)

    @property
    def values(self) -> torch.Tensor:
        return self.rows.values

    @property
    def state(self) -> torch.Tensor:
        return self.rows.state

    @property
    def cache(self) -> Any:
        return self.rows.cache

    @property
    def spec(self) -> Any:
        return self.rows.spec

    def resolve(
        self, ids: torch.Tensor, *, grad: bool, of: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, Any]:
        return self.rows.resolve(self.file_rows(ids), grad=grad)  # (``of`` unused: no rank's rows are resolved ahead)

    def slot_columns(self) -> dict[str, tuple[int, int]]:
        return self.rows.slot_columns()

    def add_slot(self, name: str, width: int, fill: float) -> None:
        self.rows.add_slot(name, width, fill)

    def mark_dirty(self, slots: torch.Tensor) -> None:
        self.rows.mark_dirty(slots)

    def cache_stats(self) -> dict[str, float]:
        return self.rows.cache_stats()

    def sharded(self, layout: Any, slot: str | None = None, row_wise: bool = False) -> Any:
        """The owned shards of the rows (``slot`` None) or of a state slot, views of this rank's file."""
        return self.rows.sharded(layout, slot, row_wise, owned=self.owned)

    def reload(self) -> None:
        self.rows.reload()

    def peek(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(values, state) of owned rows ``ids`` as they are now; changes nothing."""
        return self.rows.peek(self.file_rows(ids))

    def flush(self) -> None:
        self.rows.flush()

    def close(self) -> None:
        self.rows.close()
