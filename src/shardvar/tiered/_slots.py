"""Which cache slot holds a row, and which slots a policy gives up first: the cache's bookkeeping.

A cache resolves every batch's distinct ids to slots, and every miss takes a slot from a row the
policy gives up. Both run once per step over the batch or the slots, so both are vectorised and
linear: no probing loop, no sort of the slots.

* :class:`DirectSlots` maps a row to its slot through one int32 per row of the file: a lookup is a
  gather, an insert or removal a scatter. A row it does not hold has its *place* there instead
  (``-1 - place``: the record of the file that holds it), so a cache over it may write a row back
  anywhere (``RowCache``: into the place a miss was just read from, whose page is then in the
  page cache) at no memory per row beyond the slot's own int32. :class:`HashedSlots` keeps the dynamic
  tables' hash index instead (two int64 per bucket, two to four buckets per slot), which is the
  smaller one when the cache holds few of the file's rows (under ~1/16); its rows never move (a
  row's place is its id). :func:`slot_index`
  picks the direct map unless it takes over twice the memory: that memory is outside
  ``cache_bytes`` (it holds no row), and the direct map is several times faster.
* :func:`smallest` finds the ``k`` slots of least priority (ties: lower slot) by a radix select
  over ``torch.bincount`` (16 bits a pass, one pass when priorities span fewer than 65536
  values, as steps do), where a sort of the slots would cost ten times as much per step. The
  native select (``_slots_native``) gives the same positions in two or three passes and no copy.
"""

from __future__ import annotations

import torch

from ..dynamic import HashIndex, mix64
from . import _slots_native

__all__ = ["DirectSlots", "HashedSlots", "keeps_places", "slot_index", "smallest", "victims"]

_BITS = 16  # bins per pass of the radix select: 2**16 counts, a fraction of a millisecond
_SLICE = 1 << 18  # slots scanned at once where a whole-cache array would be large


class DirectSlots:
    """The slot of every row of a ``rows``-row file, or ``-1 - place`` where the cache does not hold it."""

    moves = True  # a row may be written to another place than its own (see ``places``)

    def __init__(self, rows: int, capacity: int) -> None:
        self.table = torch.full((rows,), -1, dtype=self._dtype(rows, capacity))
        self.reset_places()  # (no row held yet: every row at its own place)

    @staticmethod
    def _dtype(rows: int, capacity: int) -> torch.dtype:
        return torch.int32 if max(rows, capacity) <= torch.iinfo(torch.int32).max else torch.int64

    @staticmethod
    def bytes_for(rows: int, capacity: int) -> int:
        return rows * DirectSlots._dtype(rows, capacity).itemsize

    @property
    def nbytes(self) -> int:
        return self.table.nbytes

    def find(self, ids: torch.Tensor) -> torch.Tensor:
        """The slot of each id; negative where not held (``places`` says where the file has it)."""
        return self.table.index_select(0, ids).to(torch.int64)

    def places(self, ids: torch.Tensor) -> torch.Tensor:
        """The file's record of each of ``ids``, none of them held."""
        return self.table.index_select(0, ids).to(torch.int64).neg_().sub_(1)

    def insert(self, ids: torch.Tensor, slots: torch.Tensor) -> None:
        self.table.index_put_((ids,), slots.to(self.table.dtype))

    def remove(self, ids: torch.Tensor, places: torch.Tensor) -> None:
        """``ids`` are no longer held; the file has each at ``places``."""
        self.table.index_put_((ids,), places.neg().sub_(1).to(self.table.dtype))

    def reset_places(self) -> None:
        """Every row not held back at its own place (the file was rewritten in row order), a slice at a time."""
        for start in range(0, self.table.numel(), _SLICE):
            part = self.table[start : start + _SLICE]
            own = torch.arange(start, start + part.numel(), dtype=part.dtype).neg_().sub_(1)
            part.copy_(torch.where(part >= 0, part, own))

    def needs_rebuild(self) -> bool:
        return False


class HashedSlots:
    """The slots of held rows in the dynamic tables' :class:`HashIndex` (open addressing, one shard)."""

    moves = False  # no place per row: every row stays at its own

    def __init__(self, capacity: int) -> None:
        self.index = HashIndex(HashIndex.allocate(1, capacity), 1)

    @staticmethod
    def bytes_for(capacity: int) -> int:
        return HashIndex.bytes_for(capacity)

    @property
    def nbytes(self) -> int:
        return self.index.table.nbytes

    def _home(self, ids: torch.Tensor) -> torch.Tensor:
        return self.index.start(mix64(ids), torch.zeros_like(ids))

    def find(self, ids: torch.Tensor) -> torch.Tensor:
        return self.index.find(ids, self._home(ids))[0]

    def insert(self, ids: torch.Tensor, slots: torch.Tensor) -> None:
        self.index.insert(ids, self._home(ids), slots.to(torch.int64))

    def places(self, ids: torch.Tensor) -> torch.Tensor:
        return ids

    def remove(self, ids: torch.Tensor, places: torch.Tensor) -> None:
        self.index.remove(self.index.find(ids, self._home(ids))[1])  # (``places`` are the ids: rows never move)

    def reset_places(self) -> None:
        pass  # every row is at its own place

    def rebuild(self, ids: torch.Tensor, slots: torch.Tensor) -> None:
        self.index.rebuild(ids, self._home(ids), slots)

    def needs_rebuild(self) -> bool:
        return self.index.needs_rebuild()


def keeps_places(rows: int, capacity: int) -> bool:
    """Whether ``slot_index`` gives the direct map (a place per row), not the hash index: the direct map unless
    it takes more than twice the hash index's memory (it is several times faster: a gather, where the hash
    index probes in rounds)."""
    return DirectSlots.bytes_for(rows, capacity) <= 2 * HashedSlots.bytes_for(capacity)


def slot_index(rows: int, capacity: int) -> DirectSlots | HashedSlots:
    """The index of ``capacity`` slots over a ``rows``-row file (see ``keeps_places``)."""
    return DirectSlots(rows, capacity) if keeps_places(rows, capacity) else HashedSlots(capacity)


def smallest(priority: torch.Tensor, k: int, above: int) -> torch.Tensor:
    """Positions (ascending) of the ``k`` smallest of ``priority`` below ``above``, ties to the lower position.

    ``priority`` holds non-negative integers (the caller's own copy); those at or above ``above`` are never
    chosen, and at least ``k`` are below it (the caller checked, so the ``k``-th smallest is below it too)."""
    if k <= 0:
        return torch.empty(0, dtype=torch.int64)
    kernel = _slots_native.kernel()
    picked = kernel.smallest(priority, k, above) if kernel is not None else None
    if picked is not None:
        return picked[1]
    threshold, need, tied = _kth(priority, k)
    if tied > _SLICE:  # slots may tie by the million (rows read in one step): no table-sized arrays of them
        below = (priority < threshold).nonzero().squeeze(1)
        return torch.cat([below, _first(priority == threshold, need)]).sort().values
    taken = (priority <= threshold).nonzero().squeeze(1)  # the ones below and every tie, ascending: one pass
    tie = priority[taken] == threshold
    return taken[~tie | (tie.cumsum(0) <= need)]


def _first(mask: torch.Tensor, n: int) -> torch.Tensor:
    """Positions of the first ``n`` true values of ``mask``, a slice at a time (no table-sized int64 array)."""
    found, have = [], 0
    for start in range(0, mask.numel(), _SLICE):
        if have >= n:
            break
        hits = mask[start : start + _SLICE].nonzero().squeeze(1)[: n - have]
        found.append(hits.add_(start))
        have += hits.numel()
    return torch.cat(found) if found else torch.empty(0, dtype=torch.int64)


def _kth(values: torch.Tensor, k: int) -> tuple[int, int, int]:
    """The ``k``-th smallest (1-based) of non-negative integer ``values``, how many of those equal to it are
    among the ``k`` smallest, and how many equal it: a radix select, ``_BITS`` a pass."""
    shift = max(0, int(values.max()).bit_length() - _BITS)
    found = 0
    while True:
        digits = values >> shift if shift else values
        counts = torch.bincount(digits).cumsum_(0)
        digit = int(torch.searchsorted(counts, k))  # the first digit whose count reaches k
        before = int(counts[digit - 1]) if digit else 0
        k -= before
        found += digit << shift
        if shift == 0:
            return found, k, int(counts[digit]) - before
        values = values[digits == digit] - (digit << shift)
        shift = max(0, shift - _BITS)


def victims(policy: str, used: torch.Tensor, count: torch.Tensor, k: int, since: int) -> torch.Tensor:
    """The ``k`` slots a policy gives up first (ascending) among those with ``used < since``: ``"lru"`` the
    least recently used, ``"lfu"`` the least often used, then the least recently; ties to the lower slot.
    ``used`` is the caller's own copy (changed here: no second table-sized array)."""
    if policy == "lru":
        return smallest(used, k, since)
    uses = torch.where(used < since, count, int(count.max()) + 1)
    fewest = _kth(uses, k)[0]
    sure = (uses < fewest).nonzero().squeeze(1)
    tied = used.masked_fill_(uses != fewest, since)  # (``used`` is the caller's copy)
    return torch.cat([sure, smallest(tied, k - sure.numel(), since)]).sort().values
