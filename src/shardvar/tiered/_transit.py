"""What a cache counts (``CacheStats``), and records read ahead for a coming batch (``Staged``, from
``RowCache.stage``) with the ids whose records moved since (stale)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["CacheStats", "Staged"]


@dataclass
class CacheStats:
    """What the cache did since it was made (or ``reset``)."""

    hits: int = 0
    misses: int = 0
    evictions: int = 0
    written_back: int = 0
    prefetched: int = 0  # misses served from rows read ahead
    relocated: int = 0  # records the log's cleaning moved (besides the rows written back)

    @property
    def hit_rate(self) -> float:
        looked = self.hits + self.misses
        return self.hits / looked if looked else 0.0


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
