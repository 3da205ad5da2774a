"""A batch's look-up in the row cache: each id's slot, the distinct misses, the hits marked used, the victims.

The first half of ``RowCache.resolve``, everything it decides before a row moves. Either the whole
batch is taken (its hits marked used at this step, the victims for its misses chosen) or the cache
refuses it (``RowCache._refuse`` raises) and nothing changed.

Two paths, with the same results (slots, victims, hit counts, every ``used`` value): the native
kernels (``_slots_native``) where the index is the direct map, the policy LRU and the tensors are
as they take them; else torch ops. The native look-up marks the hits as it finds them, so a refused
batch, or any error before the batch is taken, puts their old steps back.
"""

from __future__ import annotations

from typing import Any, Literal, NamedTuple

import torch

from ..variables import distinct
from . import _slots_native
from ._slots import DirectSlots, victims

RowCache = Any  # (``_cache.RowCache``, which imports this module: no cycle)

__all__ = ["Found", "look_up"]


class Found(NamedTuple):
    """A taken batch: what ``RowCache.resolve`` goes on with."""

    slot: torch.Tensor  # int64 per id: its slot, negative at the misses (filled in once they are brought)
    missed: torch.Tensor  # which ids missed (a mask, or their positions)
    new_ids: torch.Tensor  # the distinct missed ids, ascending
    inverse: torch.Tensor  # per missed id, its position in ``new_ids``
    hits: int  # distinct slots hit
    chosen: torch.Tensor | None  # the slots given up for the misses (ascending), None where the free ones do


def look_up(cache: RowCache, ids: torch.Tensor, step: int, protect_since: int) -> Found:
    """``ids``' look-up at ``step``, rows used at ``protect_since`` or later kept (see the module); raises through
    ``cache._refuse``, nothing changed, where the batch's distinct rows do not fit."""
    kernel = _slots_native.kernel() if cache.policy == "lru" and isinstance(cache.index, DirectSlots) else None
    looked = kernel.lookup(cache.index.table, ids, cache.used, step) if kernel is not None else None
    if looked is None:
        return _torch(cache, ids, step, protect_since)
    try:
        found = _native(cache, kernel, looked, step, protect_since)
    except BaseException:  # a failed write-back: as if never looked up
        looked.undo(cache.used)
        raise
    if not isinstance(found, Found):
        looked.undo(cache.used)  # (before ``_refuse``, which reads them; or the torch path, which marks them)
        if found == "refused":
            cache._refuse(ids, protect_since)
        return _torch(cache, ids, step, protect_since)
    return found


def _native(
    cache: RowCache, kernel: _slots_native.Kernel, looked: _slots_native.Looked, step: int, protect_since: int
) -> Found | Literal["refused", "torch"]:
    """The rest of the native path, the hits marked (``looked``): the batch taken, else ``"refused"``, or
    ``"torch"`` where the select does not take the cache's free slots."""
    found = distinct(looked.missed_ids, cache.layout.rows)  # (a radix sort: torch.unique costs ~3x as much)
    new_ids, inverse = found.ids, found.inverse
    if new_ids.numel():  # a miss may be a row the last eviction is still writing (raises if that failed)
        cache.behind.wait()
    short = new_ids.numel() - cache.free.numel()
    chosen = None
    if short > 0:  # room is made from rows used before ``protect_since``: the hits marked, the free counting as hits
        picked = kernel.smallest(cache.used, short, protect_since, cache.free, step)
        if picked is None:
            return "torch"
        below, chosen = picked
        if short > below:
            return "refused"
    return Found(looked.slot, looked.missed, new_ids, inverse, looked.hit.numel(), chosen)


def _torch(cache: RowCache, ids: torch.Tensor, step: int, protect_since: int) -> Found:
    # Every id is looked up (a gather), and only the misses are made distinct: a sort of the
    # batch's few misses where one of the whole batch would cost more than the rest of the step.
    slot = cache.index.find(ids)  # (checked in range by the caller)
    missed = slot < 0
    new_ids, inverse = torch.unique(ids[missed], return_inverse=True)
    hits = slot[~missed]  # repeats included: the updates below write each slot's one value
    if new_ids.numel():  # a miss may be a row the last eviction is still writing (raises if that failed)
        cache.behind.wait()
    short = new_ids.numel() - cache.free.numel()
    chosen = None
    if short > 0:  # room is made from rows used before ``protect_since``, none of this batch's
        used = cache.used.clone()
        used[hits] = step
        used[cache.free] = step
        if short > int((used < protect_since).sum()):
            cache._refuse(ids, protect_since)
        chosen = victims(cache.policy, used, cache.count, short, protect_since)
    cache.used.index_fill_(0, hits, step)  # (repeats write the same step)
    if cache.count.numel():  # a use per distinct slot
        cache.count += torch.zeros(cache.capacity, dtype=torch.bool).index_fill_(0, hits, True)
    hit = int((cache.used == step).sum())  # no slot had this step before: this batch's hits
    return Found(slot, missed, new_ids, inverse, hit, chosen)
