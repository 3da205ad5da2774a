"""Records on their way between a cache's slots and its file (``RowCache``).

:class:`Staged`: records read ahead for a coming batch, and the ids whose records moved since
(those are stale). :class:`Swap`: changed rows given up for a batch's misses, held until the
misses are read and their places can take them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Staged", "Swap"]


@dataclass
class Swap:
    """Changed rows given up for a batch's first misses (``RowCache._evict``), their records held for the write."""

    records: torch.Tensor  # in the order of ``targets``
    targets: torch.Tensor  # the misses' places, ascending: where the records go
    homes: torch.Tensor  # the rows' old places, by miss: the misses' homes from now on
    ids: torch.Tensor  # the rows' ids, by miss


class Staged:
    """Records read ahead for ``ids`` (ascending), and the ids written back since: those are stale."""

    def __init__(self, ids: torch.Tensor) -> None:
        self.ids, self.records = ids, None
        self.written: list[torch.Tensor] = []

    def current(self, ids: torch.Tensor, wanted: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(which ``wanted`` ids have a current staged record, the position of each id's record)."""
        if self.records is None or self.ids.numel() == 0:  # still being read: not ours to wait for
            return torch.zeros_like(wanted), torch.zeros_like(ids)
        pos = torch.searchsorted(self.ids, ids).clamp_(max=self.ids.numel() - 1)
        use = wanted & (self.ids[pos] == ids)
        if self.written:
            use &= ~torch.isin(ids, torch.cat(self.written))
        return use, pos
