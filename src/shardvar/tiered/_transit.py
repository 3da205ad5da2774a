"""What a cache counts (``CacheStats``), and records read ahead for a coming batch (``read_ahead``, the work of
``RowCache.stage``, and what it holds: ``Staged``) with the ids whose records moved since (stale)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["CacheStats", "Staged", "read_ahead"]


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


def read_ahead(cache: Any, ids: torch.Tensor, limit: int) -> int:
    """Read ahead the records of up to ``limit`` of ``ids`` not in ``cache`` (a ``RowCache``) now; returns how many.

    With a ``reserve``, one read ahead takes at most half of it (two batches may be in flight: the one about to run
    and the next) and all staged records together never more than it.

    Safe beside the trainer's own ``resolve`` (only the index look-up holds the lock): the file is read while it
    computes, and ``resolve`` takes the staged records instead of reading. While reads are gathers from a mapping of
    the file (the page cache holds it: ``RowFile.mapped``) nothing is read ahead: a miss then costs less than its
    hand-over (measured, 2^22 rows in the page cache: 38 ms a step reading ahead, 23 ms not), and the ``Prefetcher``
    resolves the whole batch ahead instead (``RowCache.prefetch``, ``_ahead``). While the file is on
    the disk, the segments the log will clean next are asked of the kernel too (``RecordLog.foresee``).
    """
    with cache.lock:
        if cache.pins.retired:  # (let go since the thread was started: its file may be closed)
            return 0
        flat = ids.reshape(-1)
        if flat.numel():
            cache.file.check_range(int(flat.min()), int(flat.max()))
        if cache.file.mapped.active:
            return 0
        distinct = torch.unique(flat[cache.index.find(flat) < 0])  # a gather of every id, a sort of the few misses
        # the last set is kept while its batch may still want it; one whose rows are all in the slots is spent
        kept = [s for s in cache._staged[-1:] if bool((cache.index.find(s.ids) < 0).any())]
        if cache.reserve is not None:  # every staged record together stays within the reserve
            held = sum(s.ids.numel() for s in kept)
            limit = min(limit, (cache.reserve + 1) // 2, cache.reserve - held)
        staged = Staged(distinct[: max(limit, 0)])
        places = cache.index.places(staged.ids)
        cache._staged = [*kept, staged]
        # a write issued before this set, of any of its records: read after it (later ones mark ``written``)
        writing = cache.behind.pending if cache.behind.writes_any(places) else None
        on_disk = cache.log is not None and cache.file.disk_bound
        cleaned = cache.log.foresee(distinct.numel(), cache) if on_disk else None
    if staged.ids.numel():
        if writing is not None:
            cache.behind.wait(writing)
        with cache.reading:  # (a rebase in between dropped this set: what it reads is never taken)
            staged.records = cache.file.read(places)
    for owners in (False, True) if cleaned is not None else ():
        cache.file.will_need(cleaned, owners=owners)
    return staged.ids.numel()
