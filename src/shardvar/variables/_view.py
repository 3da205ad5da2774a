"""ShardsView: some shards of a logical variable, as the checkpoint reads any sharded object.

A view names a layout, the logical shape and dtype, and the shards this process holds; it is
what a table optimizer's state slot or a distributed collection's table looks like to
``shardvar.save`` / ``load`` (which read and fill ``local_shards()`` in place).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from ..layout import Layout

__all__ = ["ShardsView"]


@dataclass
class ShardsView:
    """Shards (by index) of a ``shape`` variable laid out by ``layout``; the tensors are shared, not copied."""

    layout: Layout
    shape: tuple[int, ...]
    dtype: torch.dtype
    shards: dict[int, torch.Tensor]
    packed: dict[str, Any] | None = None  # a quantized table's packed format and width (variables._packed)
    # Pieces ``(shard, first local row, rows)`` of every shard in order, each a bounded copy: a checkpoint
    # writes these instead of each shard whole (shards that are strided views of a file: a tiered table's)
    stream: Callable[[], Iterable[tuple[int, int, torch.Tensor]]] | None = None

    def local_shards(self) -> dict[int, torch.Tensor]:
        return dict(self.shards)

    def join(self) -> torch.Tensor:
        """The logical tensor (every shard must be here)."""
        return self.layout.join([self.shards[s] for s in range(self.layout.num_shards)])
