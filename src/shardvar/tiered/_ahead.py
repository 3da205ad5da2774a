"""Which rows a cache keeps for batches in flight (``Pins``), and batches resolved ahead (``resolve_ahead``).

While the page cache holds the backing file (it is mapped), a miss is cheap to read: what a step
pays for is the bookkeeping around it, the look-up, the choice of victims, the write-backs (~8 ms a
step at 2^22 rows, as much as the in-memory step itself). So the ``Prefetcher``'s thread does that
whole resolve for batch i+1 while batch i computes, and batch i+1's forward takes the slots resolved
for it (``RowCache.use``) instead of resolving again.

Which rows stay, decided here alone: rows used by a batch whose backward is pending (pinned: every row
used since the step it was resolved at, so a batch taken from ahead also keeps the rows of a batch
resolved after it until its backward ran), and by every batch resolved ahead and not yet taken. What a
resolve ahead keeps is fixed on the loop's thread before its thread starts, and a forward takes its
batch (its ids as given, or its distinct ids with the batch they come from), so in a ``Prefetcher``
loop no resolve of the loop's own runs beside the thread and what is evicted never depends on timing.
A resolve of ids the prefetcher was not told of runs before or after the thread's, as it happens (the
values are the same, the counts may differ); it keeps the batches resolved ahead too, and where it
then does not fit they are let go (resolved again when they run) and it keeps the pinned batches'
rows only, so batches resolved ahead never make it refused. A resolve ahead that does not fit (the
cache holds too few rows for two batches) changes nothing, and that batch is resolved when it runs.
"""

from __future__ import annotations

import threading
from typing import Any, NamedTuple

import torch

__all__ = ["CacheRefused", "Pins", "Resolved", "resolve_ahead"]


class CacheRefused(Exception):
    """A batch whose distinct rows do not fit the cache beside the rows it keeps (nothing changed): a resolve ahead
    lets it go, ``RowCache.use`` raises it as the ``ShardvarValueError`` its message is for."""


class Resolved(NamedTuple):
    """A batch resolved ahead: its ids (int64, the caller's shape), their slots, and its step."""

    ids: torch.Tensor
    slots: torch.Tensor
    step: int


class Pins:
    """The steps whose rows a cache keeps: pinned batches (a pending backward each) and batches resolved ahead."""

    def __init__(self) -> None:
        self._lock = threading.RLock()  # a backward's token may be collected (``unpin``) while it is held
        self._pinned: dict[int, int] = {}  # step -> pending backwards of that step
        self._ahead: list[Resolved] = []  # the batch about to run and the one after it, at most
        self.retired = False  # the cache was let go (``retire``): nothing is resolved ahead in it any more
        self.resolving: int | None = None  # the thread running a resolve ahead now (it holds the cache's lock)

    @property
    def pinned(self) -> bool:
        with self._lock:
            return bool(self._pinned)

    def pin(self, step: int) -> None:
        with self._lock:
            self._pinned[step] = self._pinned.get(step, 0) + 1

    def unpin(self, step: int) -> None:
        with self._lock:
            left = self._pinned.pop(step, 1) - 1
            if left > 0:
                self._pinned[step] = left

    def since(self, step: int, *, ahead: bool = False) -> int:
        """The oldest step whose rows a resolve at ``step`` keeps: the pinned batches', with ``ahead`` the batches
        resolved ahead and not yet taken too, and its own."""
        with self._lock:
            steps = [*self._pinned, *(r.step for r in self._ahead)] if ahead else list(self._pinned)
            return min([*steps, step])

    def add(self, resolved: Resolved) -> None:
        with self._lock:  # an older one never taken is let go: its batch has gone by
            self._ahead = [*self._ahead[-1:], resolved]

    def drop(self) -> bool:
        """Forget the batches resolved ahead (their rows are no longer kept); whether there were any."""
        with self._lock:
            had, self._ahead = bool(self._ahead), []
            return had

    def retire(self) -> None:
        """The cache is let go (its table made a new one, or closes): a resolve ahead still to run in it changes
        nothing, since what it would write back is no longer wanted (a load) or already written (a close). Called
        under the cache's lock, so one running now has finished."""
        with self._lock:
            self.retired, self._ahead = True, []

    def take(
        self, ids: torch.Tensor, pin: bool, of: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, int] | None:
        """(slots, step) of a batch resolved ahead for exactly ``ids``, or for the batch ``of`` = (batch, each of its
        ids' position in ``ids``) whose distinct ids ``ids`` are, taken (pinned with ``pin``); None if none."""
        with self._lock:
            for k, r in enumerate(self._ahead):
                exact = _same(r.ids, ids)
                if exact or (of is not None and _same(r.ids, of[0])):
                    del self._ahead[k]
                    if pin:
                        self.pin(r.step)
                    if exact:
                        return r.slots, r.step
                    slots = torch.empty(ids.shape, dtype=r.slots.dtype)  # each distinct id's slot, from its batch's
                    slots.view(-1)[of[1].reshape(-1)] = r.slots.reshape(-1)  # (repeats write the same slot)
                    return slots, r.step
        return None


def _same(resolved: torch.Tensor, ids: torch.Tensor) -> bool:
    return resolved.shape == ids.shape and torch.equal(resolved, ids.to(torch.int64))


def resolve_ahead(cache: Any, ids: torch.Tensor, since: int) -> int:
    """Resolve ``ids`` in ``cache`` (a ``RowCache``) for a batch still to come, keeping rows used at ``since`` or
    later (``RowCache.ahead_since``, asked for on the loop's thread); returns the rows brought in. A batch that does
    not fit is left for its own resolve (nothing changed); bad ids raise, as the batch itself would."""
    with cache.lock:
        if cache.pins.retired:
            return 0
        flat = ids.reshape(-1).to(torch.int64)
        if flat.numel():
            cache._check(int(flat.min()), int(flat.max()))
        step = cache.step + 1
        misses, prefetched = cache.stats.misses, cache.stats.prefetched
        cache.pins.resolving = threading.get_ident()  # (a table collected here cannot close its cache: ``_close``)
        try:
            slots = cache._resolve(flat, step, min(since, step))
        except CacheRefused:
            return 0
        except Exception:
            if cache.pins.retired:  # its table was collected here, its file let go: nothing of it is wanted
                return 0
            raise
        finally:
            cache.pins.resolving = None
        cache.pins.add(Resolved(flat.view(ids.shape), slots.view(ids.shape), step))
        brought = cache.stats.misses - misses
        cache.stats.prefetched = prefetched + brought  # read before their batch asked (from read-ahead or not)
        return brought
