"""RowCache: a bounded set of a RowFile's records in RAM, the rows the kernels read.

The cache holds ``capacity`` rows as one ``[capacity, dim]`` tensor (``values``: the weight a
lookup runs on, ids mapped to slots) and their state (``state``), with per slot the id held, the
step it was last used, how often, and whether it changed since it was read (``dirty``). Which
slot holds an id, and which rows leave when room is needed (an LRU or LFU policy, ties to the lower
slot), is ``_slots``' bookkeeping: a gather and a scatter per step, and a linear radix select
(``_lookup`` runs it through native kernels where it can).

``resolve`` brings a batch's ids in: hits are marked used first, so they are never the ones evicted for the
batch's misses; the victims' changed records are copied out before their slots are reused and written by the
write-behind thread (``_behind``), or here when they do not fit its area; the misses are read from the file in
concurrent reads (while the file is mapped, victims and misses move in one native pass: ``_swap``).

Where a row is written back: where the index keeps a place per row (``_slots.DirectSlots``) and the file has
spare records, into the next free record of the file's log (``_log.RecordLog``): one sequential write a step, not
a random page write each (while a mapping of the file takes writes, each row goes back to its own place instead:
a scatter, nothing for the log to clean). The records are then out of row order (``places_of`` says where each
row is; ``TieredRows`` puts them back in order before a checkpoint maps the file). Records pass between the
file and the slots through one staging area allocated once (counted in ``nbytes``, as the write-behind area is),
so no buffer of a batch's size is ever allocated besides the slots. Rows used at or after ``protect_since`` are
never evicted: which those are for batches in flight (a pending backward's, a batch resolved ahead by the
``Prefetcher`` while another computes) is ``_ahead.Pins``'s rule alone. Everything is checked before anything
moves: a batch whose distinct rows do not fit raises and changes nothing.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

from .._errors import ShardvarValueError
from .._validate import check_bool, check_choice, check_int
from ..variables import sort_stable
from ._ahead import CacheRefused, Pins, resolve_ahead
from ._behind import WriteBehind
from ._file import RowFile
from ._log import RecordLog
from ._lookup import look_up
from ._native import fill_at, scatter_rows
from ._slots import slot_index
from ._swap import swap_in
from ._transit import CacheStats, Staged, read_ahead

__all__ = ["RowCache", "CacheStats", "POLICIES", "STAGING_ROWS"]

POLICIES = ("lru", "lfu")
FLUSH_SLOTS = 1 << 18  # slots a flush looks through at once
STAGING_ROWS = 1 << 16  # the most records the staging area holds, and the write-behind area (fewer for a small cache)


def _select(records: torch.Tensor, rows: torch.Tensor, out: torch.Tensor) -> None:
    torch.index_select(records, 0, rows, out=out)  # into the staging area: no buffer of its own


class RowCache:
    """``capacity`` rows of ``file`` in RAM (see the module docstring)."""

    def __init__(
        self,
        file: RowFile,
        capacity: int,
        policy: str = "lru",
        reserve: int | None = None,
        staging: int | None = None,
        *,
        relocate: bool = True,
        segment: int | None = None,
    ) -> None:
        if not file.ordered:  # where each row is, is known to the cache that moved it only
            raise ShardvarValueError(
                f"the rows of backing file {str(file.path)!r} are not in row order (written back through its log); "
                "a backing file is not a checkpoint: restore the table from its last checkpoint (shardvar.load)"
            )
        layout = file.layout
        self.capacity = check_int(capacity, "cache capacity (rows)", minimum=1)
        # The records in transit between the file and the slots (misses read, rows written back),
        # allocated once: ``nbytes`` counts them, so a batch allocates no rows of its own.
        staging = min(capacity, STAGING_ROWS) if staging is None else check_int(staging, "staging (rows)", minimum=1)
        self.staging = torch.zeros((staging, layout.record_bytes), dtype=torch.uint8)
        self.behind = WriteBehind(file, staging)  # the rows an eviction gives up, written on a thread: as many
        # cache_bytes whose slots hold ``rows`` (set by the table, which knows its read-ahead share)
        self.bytes_for: Callable[[int], int] | None = None
        # Records read ahead (``stage``) held at once, all staged sets together: the table's budget
        # counts them (``nbytes``). None: no bound (a cache used on its own, outside a table).
        self.reserve = None if reserve is None else check_int(reserve, "read-ahead reserve (rows)", minimum=0)
        self.policy = check_choice(policy, "policy", POLICIES)
        self.file, self.layout = file, layout
        self.values = torch.zeros((capacity, layout.dim), dtype=layout.torch_dtype)
        self.state = torch.zeros((capacity, layout.state_width), dtype=torch.float32)
        # Per slot, outside cache_bytes (it holds no row): 32-bit where the numbers fit, since a cache of
        # millions of slots pays for every byte here (int32 steps and counts last 2**31 steps).
        wide = layout.rows > torch.iinfo(torch.int32).max
        self.key = torch.full((capacity,), -1, dtype=torch.int64 if wide else torch.int32)
        self.used = torch.zeros(capacity, dtype=torch.int32)  # the step each slot was last used
        self.count = torch.zeros(capacity if self.policy == "lfu" else 0, dtype=torch.int32)  # uses: LFU's alone
        self.dirty = torch.zeros(capacity, dtype=torch.bool)
        self.home = torch.full((capacity,), -1, dtype=self.key.dtype)  # the place of each slot's copy in the file
        self.index = slot_index(layout.rows, capacity)
        # ``relocate``: a changed row is written back through the file's log (where the index keeps places and
        # the file has spare records); the file's records are then in row order only through ``places_of``
        self.relocate = check_bool(relocate, "relocate")
        self.log = RecordLog(layout, segment) if self.relocate and self.index.moves and layout.spare else None
        self.moved = False  # whether a row was written back to another place than its own
        self.free = torch.arange(capacity, dtype=torch.int32)  # the slots holding no row, ascending
        self.step = 0
        self.stats = CacheStats()
        self.lock = threading.Lock()  # guards the slots and the index (a prefetch thread reads them)
        # held while a read-ahead reads the file (outside ``lock``): the file is not replaced under it
        self.reading = threading.Lock()
        # Rows read ahead for a coming batch (``stage``), and the ids written back since: a staged
        # record of one of those is stale. Staged rows sit outside the slots, so nothing evicts them.
        # Two at most: the batch about to run and the one after it (read while the first computes),
        # together at most ``reserve`` records.
        self._staged: list[Staged] = []
        self.pins = Pins()  # the rows kept for batches in flight, and the batches resolved ahead (``_ahead``)

    @property
    def nbytes(self) -> int:
        """RAM held for rows and state: slots, read-ahead reserve and staging (the figure ``cache_bytes`` bounds)."""
        slots = self.capacity * (self.values[:1].nbytes + self.state[:1].nbytes)
        return slots + (self.reserve or 0) * self.layout.record_bytes + self.staging.nbytes + self.behind.nbytes

    @property
    def held_bytes(self) -> int:
        """RAM holding rows and state now: slots, staging and write-behind areas, and the records read ahead
        and not yet taken."""
        slots = self.capacity * (self.values[:1].nbytes + self.state[:1].nbytes)
        staged = sum(s.records.nbytes for s in self._staged if s.records is not None)
        return slots + self.staging.nbytes + self.behind.nbytes + staged

    @property
    def staged_rows(self) -> int:
        """Records read ahead and held now (at most ``reserve``)."""
        return sum(s.ids.numel() for s in self._staged)

    @property
    def bookkeeping_bytes(self) -> int:
        """RAM the cache keeps besides rows and state (outside ``cache_bytes``): its index and per-slot records."""
        log = self.log.nbytes if self.log is not None else 0
        return self.index.nbytes + log + sum(t.nbytes for t in (self.key, self.home, self.used, self.count, self.dirty))

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """The slot of each id (-1: not in the cache); changes nothing."""
        if ids.numel():
            self._check(int(ids.min()), int(ids.max()))
        return self.index.find(ids).clamp_(min=-1)

    def _check(self, low: int, high: int) -> None:
        self.file.check_range(low, high)  # before the index, which holds no row past the file's

    def resolve(self, ids: torch.Tensor, *, protect_since: int | None = None) -> torch.Tensor:
        """The slot of each of ``ids`` (any shape, repeats allowed), bringing missing rows in (``use``)."""
        return self.use(ids, protect_since=protect_since)[0]

    def use(
        self, ids: torch.Tensor, *, pin: bool = False, protect_since: int | None = None, of: tuple | None = None
    ) -> tuple[torch.Tensor, int]:
        """(slots, step) of ``ids`` for a batch about to compute: the slots resolved ahead for these very ids
        (``prefetch``), else resolved now, a new step whose rows count as used now. ``pin``: the batch's rows stay
        until ``pins.unpin(step)`` (its backward ran). ``protect_since``: rows used at that step or later are kept
        (default: the pinned batches', those resolved ahead, and this one's; see ``_ahead``). ``of``: (a batch, its ids'
        positions in ``ids``) where ``ids`` are its distinct ids: taken as resolved ahead for that batch."""
        taken = self.pins.take(ids, pin, of) if protect_since is None else None
        if taken is not None:
            return taken
        with self.lock:
            flat = ids.reshape(-1)
            if flat.numel():
                self._check(int(flat.min()), int(flat.max()))
            step = self.step + 1
            if protect_since is not None:  # (it keeps what it is told: the batches resolved ahead are let go)
                self.pins.drop()
            try:
                slots = self._resolve(flat, step, self.pins.since(step, ahead=True) if protect_since is None else
                                      protect_since)  # fmt: skip
            except CacheRefused as e:
                if not self.pins.drop():  # else the batches resolved ahead go (resolved when they run), not this one
                    raise ShardvarValueError(str(e)) from None
                slots = self._resolve(flat, step, self.pins.since(step))
            if pin:
                self.pins.pin(step)
            return slots.view(ids.shape), step

    def _resolve(self, ids: torch.Tensor, step: int, protect_since: int) -> torch.Tensor:
        slot, missed, new_ids, inverse, hits, chosen = look_up(self, ids, step, protect_since)  # (or refused)
        self.step = step  # taken: from here on the cache changes
        self.stats.hits += hits
        if new_ids.numel() == 0:
            return slot
        new_slots = swap_in(self, chosen, new_ids)  # (while the file is mapped: one native pass; else these steps)
        if new_slots is None:
            if chosen is not None:
                self._evict(chosen)  # (the log's cleaning may move the misses' records: their places are read after)
            new_slots = self.free[: new_ids.numel()].to(torch.int64)
            self._bring(new_slots, new_ids, self.index.places(new_ids))
            self.free = self.free[new_ids.numel() :].clone()  # not a view: the first fill's arange is let go
            self.index.insert(new_ids, new_slots)
        # a read-ahead set whose rows are all in the slots now is spent: kept, it would go on collecting the ids
        # that move (``move``) for as long as no read-ahead replaces it
        self._staged = [t for t in self._staged if t.records is None or bool((self.index.find(t.ids) < 0).any())]
        slot[missed] = new_slots[inverse]
        self.stats.misses += new_ids.numel()
        return slot

    def _refuse(self, ids: torch.Tensor, protect_since: int) -> None:
        distinct = torch.unique(ids)
        needed = distinct.numel() + int(((self.used >= protect_since) & (self.key >= 0)).sum())
        per_row = self.values[:1].nbytes + self.state[:1].nbytes
        besides = self.nbytes - self.capacity * per_row  # the read-ahead reserve, the staging and write-behind areas
        budget = self.bytes_for(needed) if self.bytes_for else needed * per_row + besides
        raise CacheRefused(
            f"the row cache holds {self.capacity} rows; this batch needs {distinct.numel()} distinct rows "
            f"and {needed - distinct.numel()} more are held for a batch in flight: give it at least "
            f"{needed} rows (cache_bytes={budget}, with its read-ahead, staging and write-behind records)"
        )

    def _bring(self, slots: torch.Tensor, ids: torch.Tensor, places: torch.Tensor) -> None:
        """Fill ``slots`` with the records of missing ``ids`` (ascending) at ``places``: read ahead where current,
        else read now (in the order of their places)."""
        read, into = places, slots  # (all of them: no read-ahead while the file is mapped)
        if self._staged:
            todo = torch.ones(ids.numel(), dtype=torch.bool)
            for staged in reversed(self._staged):  # the latest read first
                use, pos = staged.current(ids, todo)
                self._through_staging(slots[use], lambda a, b, o, p=pos[use], s=staged: _select(s.records, p[a:b], o))
                todo &= ~use
            rest = todo.nonzero().squeeze(1)
            self.stats.prefetched += ids.numel() - rest.numel()
            read, into = places[rest], slots[rest]
        if not self.file.move_rows(read, into, self.values, self.state, write=False):  # (unmapped)
            at, order = sort_stable(read, self.layout.places)  # (a radix sort: torch's costs ~4x as much)
            at = at.to(torch.int64)
            self._through_staging(into[order], lambda a, b, out: self.file.read_into(at[a:b], out))
        scatter_rows(self.key.view(-1, 1), slots, ids.to(self.key.dtype).view(-1, 1))
        scatter_rows(self.home.view(-1, 1), slots, places.to(self.home.dtype).view(-1, 1))
        fill_at(self.used, slots, self.step)
        if self.count.numel():
            self.count[slots] = 1
        fill_at(self.dirty, slots, False)

    def _evict(self, slots: torch.Tensor) -> None:
        """Give up ``slots`` (ascending), writing back the rows that changed since they were read: through the
        file's log as far as it has room (see the module docstring), the rest to their own places."""
        gone, done = slots[self.dirty[slots]], 0
        # While the mapping takes writes (the page cache holds the file), a row's own place costs a scatter: no log
        in_place = self.file.mapped.takes_writes
        while self.log is not None and not in_place and done < gone.numel():  # a write-behind area at a time
            n = self.log.make_room(min(gone.numel() - done, self.behind.area.shape[0]), self)  # (may move homes)
            if n == 0:
                break
            part = gone[done : done + n]
            ids, new, old = self.key[part].to(torch.int64), self.log.claim(n), self.home[part].to(torch.int64)
            self.log.write(self, new, ids, lambda out, p=part: self._gather(p, out))
            self.move(ids, new)
            self.log.moved(old, new)
            self.stats.written_back += n
            done += n
        self._write_back(gone[done:], behind=done == 0)
        keys = self.key[slots].to(torch.int64)
        self.index.remove(keys, self.home[slots].to(torch.int64))
        fill_at(self.key, slots, -1)
        free, given = self.free, slots.to(torch.int32)  # (ascending: kept as they are where no slot was free)
        self.free = sort_stable(torch.cat([free, given]), self.capacity)[0].to(torch.int32) if free.numel() else given
        self.stats.evictions += slots.numel()
        if self.index.needs_rebuild():
            held = (self.key >= 0).nonzero().squeeze(1)
            self.index.rebuild(self.key[held].to(torch.int64), held)

    def locate(self, ids: torch.Tensor) -> torch.Tensor:
        """The record of the file that holds each of ``ids`` (of a held row: its home, current after ``flush``)."""
        slot = self.index.find(ids)
        held = slot >= 0
        places = self.index.places(ids).clone()
        places[held] = self.home[slot[held]].to(torch.int64)
        return places

    def move(self, ids: torch.Tensor, places: torch.Tensor) -> None:
        """Rows ``ids`` are held at ``places`` of the file from now on (written there, or on their way)."""
        slot = self.index.find(ids)
        held = slot >= 0
        self.home[slot[held]] = places[held].to(self.home.dtype)
        self.index.remove(ids[~held], places[~held])
        for staged in self._staged:  # a record read ahead from the old place is stale
            staged.written.append(ids)
        self.moved = True
        self.file.ordered = False

    def _through_staging(self, slots: torch.Tensor, fill: Callable[[int, int, torch.Tensor], None]) -> None:
        """Fill ``slots``: ``fill(a, b, out)`` puts records ``[a, b)`` in the staging area, then into ``slots[a:b]``."""
        for a in range(0, slots.numel(), self.staging.shape[0]):
            b = min(slots.numel(), a + self.staging.shape[0])
            records = self.staging[: b - a]
            fill(a, b, records)
            values, state = self.layout.split(records)
            scatter_rows(self.values, slots[a:b], values)
            scatter_rows(self.state, slots[a:b], state)

    def _write_back(self, slots: torch.Tensor, behind: bool = False) -> None:
        """Write the rows at ``slots`` to their homes: through the file's mapping where it takes writes, else in
        place order, on the write-behind thread where ``behind`` and they fit its area (the
        slots may be reused at once: their records were copied), else here."""
        if slots.numel() == 0:
            return
        homes, ids = self.home[slots].to(torch.int64), self.key[slots].to(torch.int64)
        mapped = self.file.mapped.takes_writes
        if mapped:
            self.behind.wait()  # (a write still in flight goes first)
        if not (mapped and self.file.move_rows(homes, slots, self.values, self.state, write=True)):
            self._write_records(slots, homes, behind)
        fill_at(self.dirty, slots, False)
        for staged in self._staged:
            staged.written.append(ids)
        self.stats.written_back += slots.numel()

    def _write_records(self, slots: torch.Tensor, homes: torch.Tensor, behind: bool) -> None:
        places, order = sort_stable(homes, self.layout.places)
        places, slots = places.to(torch.int64), slots[order]
        if not (behind and self.behind.start(places, lambda out: self._gather(slots, out))):
            self.behind.wait()
            for a in range(0, slots.numel(), self.staging.shape[0]):  # through the staging area
                b = min(slots.numel(), a + self.staging.shape[0])
                self._gather(slots[a:b], self.staging[: b - a])
                self.file.write_from(places[a:b], self.staging[: b - a])

    def _gather(self, slots: torch.Tensor, records: torch.Tensor) -> None:
        values, state = self.layout.split(records)
        torch.index_select(self.values, 0, slots, out=values)
        torch.index_select(self.state, 0, slots, out=state)

    # -- reading ahead --------------------------------------------------------------------------------
    def stage(self, ids: torch.Tensor, limit: int) -> int:
        """Read ahead the records of up to ``limit`` of ``ids`` not in the cache now; returns how many
        (``_transit.read_ahead``: how much, what is kept, and why nothing is while the file is mapped)."""
        return read_ahead(self, ids, limit)

    def ahead_since(self) -> int:
        """What a ``prefetch`` asked for now keeps (rows used at this step or later): asked on the loop's thread, before
        the batch computing takes its slots, so it never depends on the threads' timing (``_ahead``)."""
        return self.pins.since(self.step + 1, ahead=True)

    def prefetch(self, ids: torch.Tensor, limit: int, since: int) -> int:
        """Ready a coming batch's ``ids`` while another computes (rows brought or read): resolved ahead while the file
        is mapped (``_ahead``; ``since``: ``ahead_since``), else up to ``limit`` read ahead; nothing once let go
        (each path checks ``Pins.retired`` under the cache's lock)."""
        return resolve_ahead(self, ids, since) if self.file.mapped.active else self.stage(ids, limit)

    def mark_dirty(self, slots: torch.Tensor) -> None:
        """The rows (and state) at ``slots`` were changed in place: write them back before evicting."""
        fill_at(self.dirty, slots.reshape(-1).to(torch.int64), True)

    def flush(self) -> None:
        """Write every changed row back (before a checkpoint streams the file, and at close)."""
        with self.lock:
            self.behind.wait()
            for start in range(0, self.capacity, FLUSH_SLOTS):  # a slice at a time: no cache-sized id arrays
                self._write_back(self.dirty[start : start + FLUSH_SLOTS].nonzero().squeeze(1).add_(start))

    def peek(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(values, state) of ``ids`` as they are now, from the cache where held, else the file; no change."""
        with self.lock:
            slot = self.lookup(ids)
            held = slot >= 0
            values = torch.empty((ids.numel(), self.layout.dim), dtype=self.values.dtype)
            state = torch.empty((ids.numel(), self.layout.state_width), dtype=torch.float32)
            values[held], state[held] = self.values[slot[held]], self.state[slot[held]]
            if bool((~held).any()):
                self.behind.wait()
                v, s = self.layout.split(self.file.read(self.index.places(ids[~held])))
                values[~held], state[~held] = v, s
            return values, state

    def places_of(self, ids: torch.Tensor) -> torch.Tensor:
        """The file's record of each of ``ids``, held or not (of a held row: its home, current after ``flush``)."""
        with self.lock:
            return self.locate(ids)

    def rebase(self, file: RowFile) -> None:
        """``file``, a copy of this one's records in row order (``flush`` ran first), replaces it: every row is
        back at its own place, the held ones in their slots."""
        with self.lock, self.reading:  # no read-ahead is reading the old file now, nor starts to
            self.behind.wait()
            self.file = self.behind.file = file
            self._staged = []  # read from the old file, by its places: not taken from here on
            self.index.reset_places()
            held = self.key >= 0
            self.home[held] = self.key[held]
            self.log = RecordLog(file.layout, self.log.segment) if self.log is not None else None
            self.moved = False

    def close(self) -> None:
        """Write every changed row back and let the write-behind thread go (the table is closing)."""
        try:
            self.flush()
        finally:
            with self.lock:
                self.pins.retire()
            self.behind.close()
