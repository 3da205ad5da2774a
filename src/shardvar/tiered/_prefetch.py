"""Prefetcher: while batch i computes, the rows of batch i+1 are read from the backing files.

One background thread per step reads ahead (``RowCache.stage``): the records the next batch
misses come off the disk while this batch's forward, backward and update run, and are handed
to the cache when that batch resolves its ids. A batch that arrives before its read finished
waits for it (the read is joined before the batch is yielded), so what the step sees never
depends on timing; an error in the thread is raised in the loop, at that batch.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, TypeVar

import torch

from .._validate import check_int
from ._cache import RowCache

__all__ = ["Prefetcher"]

Batch = TypeVar("Batch")


class _ReadAhead(threading.Thread):
    def __init__(self, work: list[tuple[RowCache, torch.Tensor]], limit: int) -> None:
        super().__init__(name="shardvar-prefetch", daemon=True)
        self.work, self.limit = work, limit
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            for cache, ids in self.work:
                cache.stage(ids, self.limit)
        except BaseException as e:  # handed to the loop, raised there
            self.error = e

    def finish(self) -> None:
        self.join()
        if self.error is not None:
            raise self.error


class Prefetcher(Iterable[Batch]):
    """Iterate ``batches``, reading ahead the rows each next batch needs.

    ``ids_of(batch)`` gives, for each cache, the ids the batch will look up in it: a sequence of
    ``(cache, ids)`` pairs. ``limit``: the most rows read ahead per cache and step (they count
    against the cache's bytes).

    >>> # for batch in Prefetcher(loader, lambda b: [(table.cache, b["ids"])]): step(batch)
    """

    def __init__(
        self,
        batches: Iterable[Batch],
        ids_of: Callable[[Batch], Sequence[tuple[RowCache, torch.Tensor]]],
        *,
        limit: int = 1 << 16,
    ) -> None:
        self.batches, self.ids_of = batches, ids_of
        self.limit = check_int(limit, "limit", minimum=1)

    def __iter__(self) -> Iterator[Batch]:
        it = iter(self.batches)
        end: Any = object()
        upcoming = next(it, end)
        reading: _ReadAhead | None = None
        try:
            while upcoming is not end:
                current, upcoming = upcoming, next(it, end)
                if reading is not None:
                    reading.finish()  # this batch's rows are in before it runs
                    reading = None
                if upcoming is not end:
                    reading = _ReadAhead(list(self.ids_of(upcoming)), self.limit)
                    reading.start()
                yield current
        finally:
            if reading is not None:
                reading.join()  # leave no thread reading a file that may be closed next
