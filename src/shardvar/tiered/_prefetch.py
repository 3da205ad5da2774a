"""Prefetcher: while batch i computes, the rows of batch i+1 are readied from the backing files.

One background thread per step readies the next batch (``RowCache.prefetch``) while this batch's
forward, backward and update run. While a file is on the disk, the records the next batch misses
are read ahead and handed to the cache when that batch resolves its ids. While the page cache
holds it (reads are cheap, the bookkeeping is not) the next batch is resolved ahead: its rows
brought into their slots, the victims written back, and its forward takes the slots (``_ahead``).
A batch that arrives before its thread finished waits for it (the thread is joined before the
batch is yielded), and what a resolve ahead keeps is decided before its thread starts, so what the
step sees never depends on timing; an error in the thread is raised in the loop, at that batch.

A resolve ahead is CPU work, where a read ahead mostly waits on the disk: while one runs, the
loop's body computes with one intra-op thread fewer (``torch.set_num_threads``, restored after
each step; ``share_cores=False`` keeps them all). On 2 cores, a training step whose two intra-op
threads shared the cores with the resolve took 12.2 ms, against 9.4 ms with one (8.9 in memory):
each parallel region of the step waits for its slowest thread, the one the resolve takes turns with.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, TypeVar

import torch

from .._validate import check_bool, check_int
from ._cache import RowCache

__all__ = ["Prefetcher"]

Batch = TypeVar("Batch")


class _ReadAhead(threading.Thread):
    def __init__(self, work: list[tuple[RowCache, torch.Tensor]], limit: int) -> None:
        super().__init__(name="shardvar-prefetch", daemon=True)
        self.work = [(cache, ids, cache.ahead_since()) for cache, ids in work]  # (here, on the loop's thread)
        self.limit = limit
        self.computes = any(cache.file.mapped.active for cache, _ in work)  # resolved ahead (``prefetch``): CPU
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            for cache, ids, since in self.work:
                cache.prefetch(ids, self.limit, since)
        except BaseException as e:  # handed to the loop, raised there
            self.error = e

    def finish(self) -> None:
        self.join()
        if self.error is not None:
            raise self.error


class Prefetcher(Iterable[Batch]):
    """Iterate ``batches``, reading ahead the rows each next batch needs.

    ``ids_of(batch)`` gives, for each cache, the ids the batch will look up in it: a sequence of
    ``(cache, ids)`` pairs. ``limit``: the most records read ahead per cache and step (they count
    against the cache's bytes; a batch resolved ahead takes slots instead). ``share_cores``: while the
    next batch is resolved ahead, the loop's body runs with one intra-op thread fewer (see the module).

    >>> # for batch in Prefetcher(loader, lambda b: [(table.cache, b["ids"])]): step(batch)
    """

    def __init__(
        self,
        batches: Iterable[Batch],
        ids_of: Callable[[Batch], Sequence[tuple[RowCache, torch.Tensor]]],
        *,
        limit: int = 1 << 16,
        share_cores: bool = True,
    ) -> None:
        self.batches, self.ids_of = batches, ids_of
        self.limit = check_int(limit, "limit", minimum=1)
        self.share_cores = check_bool(share_cores, "share_cores")

    def __iter__(self) -> Iterator[Batch]:
        it = iter(self.batches)
        end: Any = object()
        upcoming = next(it, end)
        # the first batch is readied too (its thread joined before it is yielded): every batch then comes resolved
        # ahead, in the loop's order, and no resolve of the loop's own races a thread's
        reading = None if upcoming is end else self._ready(upcoming)
        try:
            while upcoming is not end:
                current, upcoming = upcoming, next(it, end)
                if reading is not None:
                    reading.finish()  # this batch's rows are in before it runs
                    reading = None
                if upcoming is not end:
                    reading = self._ready(upcoming)
                with _sharing(self.share_cores and reading is not None and reading.computes):
                    yield current
        finally:
            if reading is not None:
                reading.join()  # leave no thread reading a file that may be closed next

    def _ready(self, batch: Batch) -> _ReadAhead:
        reading = _ReadAhead(list(self.ids_of(batch)), self.limit)
        reading.start()
        return reading


@contextlib.contextmanager
def _sharing(share: bool) -> Iterator[None]:
    """One intra-op thread fewer for what runs inside (this thread's; at least one), where ``share``."""
    threads = torch.get_num_threads()
    if not share or threads < 2:
        yield
        return
    torch.set_num_threads(threads - 1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
