"""Where a table's rows are held when they are not all in RAM: declared here, built by ``tiered``.

A module given ``storage=`` (``shardvar.Tiered``) asks it to ``open`` the table: the storage
takes the table's rows in logical order, a block at a time (the module's initializer, streamed:
no table-sized RAM), and hands back a :class:`RowTier`. The store's plan still says which shard
and row an id is; the tier says where that row is held now (a cache slot, or the file).

A lookup ``resolve``\\ s its ids to slots of ``values`` (the rows in RAM, one per slot) and reads
them there; the table's optimizer, fused into backward, updates ``values`` and ``state`` at those
slots through the tier's sink and marks them dirty. The optimizer's state lives in ``state``'s
columns, one slot name each (``slot_columns``), so it travels with its row to the file and back.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Protocol, runtime_checkable

import torch

__all__ = ["RowTier", "TableStorage", "TierSink"]

# sink(slots of each looked-up id, one gradient row each): the fused optimizer's update of those rows
TierSink = Callable[[torch.Tensor, torch.Tensor], None]


@runtime_checkable
class RowTier(Protocol):
    """A table's rows held in a bounded cache of slots over a backing store."""

    values: torch.Tensor  # [slots, dim]: the rows a lookup reads
    state: torch.Tensor  # [slots, state width] float32: the optimizer's state of each slot's row
    sink: TierSink | None

    def resolve(
        self, ids: torch.Tensor, *, grad: bool, of: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, Any]:
        """(the slot of each id, a token keeping those rows in their slots while it lives (``grad``: until
        the backward ran), or None). ``of``: (the batch, each of its ids' position in ``ids``) where ``ids`` are
        the batch's distinct ids (a tier may have resolved the batch itself ahead)."""
        ...

    def slot_columns(self) -> dict[str, tuple[int, int]]:
        """Optimizer state slot -> (first column, width) in ``state``."""
        ...

    def add_slot(self, name: str, width: int, fill: float) -> None:
        """Give every row ``width`` state values ``fill`` named ``name`` (the file's records widen)."""
        ...

    def mark_dirty(self, slots: torch.Tensor) -> None: ...

    def cache_stats(self) -> dict[str, float]: ...

    def sharded(self, layout: Any, slot: str | None = None, row_wise: bool = False) -> Any:
        """The rows (``slot`` None) or a state slot, as a sharded object (a ShardsView) in ``layout`` over
        the backing file, streamed in bounded pieces by a checkpoint and filled in place by a load."""
        ...

    def reload(self) -> None:
        """Forget the cached rows (the file was written under the cache: a checkpoint was loaded)."""
        ...


@runtime_checkable
class TableStorage(Protocol):
    """A storage option for a table (``shardvar.Tiered``)."""

    def open(self, rows: int, dim: int, dtype: torch.dtype, blocks: Iterator[torch.Tensor]) -> RowTier:
        """A new tier of ``rows`` rows, filled from ``blocks`` (the rows in order, consecutive blocks)."""
        ...
