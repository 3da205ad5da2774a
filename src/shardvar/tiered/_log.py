"""RecordLog: write-backs into free records of the file, in sequence, and the records they free reclaimed.

Why: a row written back to its own record dirties a page of its own (a record is a few hundred
bytes, a page 4 KiB), and a file larger than RAM has that page on the disk. Measured on this
machine's disk under a memory cap, ~43k random page writes a second at best: 10k write-backs a
step cost 0.24 s, twice the step's reads. Written together into free records one after another,
they are one sequential write of whole pages.

How: the file has ``spare`` records besides one per row (``RecordLayout``), in *segments* of
``SEGMENT`` records (a whole number of pages for any record size). Each row is held by exactly one
record, its place (``RowCache.locate``); the log counts, per segment, the records holding a row
(``live``). Write-backs take places from the *head* segment, then whole free ones (``claim``); the
places they leave are dead. When fewer free places are left than a step needs, the segments with
the fewest live records are cleaned (the greedy policy of log-structured file systems): their live
records are read (one sequential read a segment), written at the head, and the segments are free
again. Which row a record holds is kept in the file beside the records (``RowFile.write_owners``),
so cleaning needs no per-record memory. Every record moved marks the read-ahead sets stale
(``RowCache.move``), as a write-back does.

The cost: spare disk (``Tiered(spare=)``, half the rows by default) and the records cleaning moves
besides the write-backs themselves, reported as ``relocated``: in the steady state of Zipf(1.05)
training with a cache of 10% of the rows, 1.7, 0.75 and 0.3 moved per row written back with a
quarter, half and as many spare records as rows.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from .._errors import ShardvarValueError
from .._validate import check_int
from ..variables import sort_stable
from ._header import RecordLayout

__all__ = ["RecordLog", "SEGMENT", "segment_for", "spare_records"]

SEGMENT = 512  # records: 512 x a multiple of 8 bytes is a whole number of 4 KiB pages
MIN_SEGMENTS = 4  # spare ones at least: two kept free (``make_room``), and room to write back into


def segment_for(rows: int) -> int:
    """Records a segment of a ``rows``-row file's log: ``SEGMENT``, or fewer (down to 8) for a file of fewer
    than 64 segments of rows, so a small table's spare records stay a fraction of it."""
    return min(SEGMENT, max(8, 1 << (rows // 64).bit_length()))


def spare_records(rows: int, fraction: float) -> int:
    """Spare records for a file of ``rows``: ``fraction`` of them, at least ``MIN_SEGMENTS``, the file a whole
    number of segments (0 where ``fraction`` is 0: every row written back to its own record)."""
    if fraction <= 0 or rows == 0:
        return 0
    segment = segment_for(rows)
    total = rows + max(math.ceil(rows * fraction), MIN_SEGMENTS * segment)
    return -(-total // segment) * segment - rows


class RecordLog:
    """Which records of a file with spare ones are free, and where write-backs go next (see the module).

    Its methods take the ``RowCache`` that owns it (typed ``Any``: ``_cache`` imports this module)."""

    def __init__(self, layout: RecordLayout, segment: int | None = None) -> None:
        segment = segment_for(layout.rows) if segment is None else segment
        check_int(segment, "segment (records)", minimum=1)
        if layout.places % segment or layout.spare < MIN_SEGMENTS * segment:
            raise ShardvarValueError(
                f"a record log needs a file of whole segments of {segment} records and at least {MIN_SEGMENTS} spare "
                "ones; "
                f"got {layout.rows} rows and {layout.spare} spare records"
            )
        self.segment, self._span = segment, torch.arange(segment, dtype=torch.int64)
        self.spare = layout.spare
        first = torch.arange(layout.places // segment, dtype=torch.int64) * segment
        self.live = (layout.rows - first).clamp_(0, segment).to(torch.int32)  # records holding a row
        self.open = self.live == 0  # free segments and the head: never cleaned
        self.free = self.open.nonzero().squeeze(1)  # free segments, ascending
        # The segments being filled, each with its next free record: rows written back (head 0) and the
        # records cleaning moves (head 1) apart, as log-structured file systems do: the moved ones have outlived a
        # pass of the log and are likely to outlive the next, the written back ones are the rows training uses
        # now. Mixed, every segment would hold some of each, and cleaning it would move the long-lived ones again.
        self.heads = [[-1, segment], [-1, segment]]

    def _places(self, segments: torch.Tensor) -> torch.Tensor:
        return (segments[:, None] * self.segment + self._span).reshape(-1)

    @property
    def nbytes(self) -> int:
        return self.live.nbytes + self.open.nbytes + self.free.nbytes

    def room(self, moving: bool = False) -> int:
        """Free places ``claim`` can give: the free segments, and the rest of the head of written back rows, or
        of moved records (``moving``)."""
        head, at = self.heads[int(moving)]
        return self.free.numel() * self.segment + (self.segment - at if head >= 0 else 0)

    def claim(self, n: int, moving: bool = False) -> torch.Tensor:
        """``n`` free places (ascending, at most ``room``) for rows about to be written there: from the head of
        written back rows, or of the records cleaning moves (``moving``)."""
        head = self.heads[int(moving)]
        parts = []
        take = min(n, self.segment - head[1]) if head[0] >= 0 else 0
        if take:
            parts.append(torch.arange(take, dtype=torch.int64) + (head[0] * self.segment + head[1]))
            head[1] += take
        if n > take:
            k = -(-(n - take) // self.segment)
            segments, self.free = self.free[:k], self.free[k:]
            parts.append(self._places(segments)[: n - take])
            if head[0] >= 0:
                self.open[head[0]] = False
            self.open[segments[:-1]] = False
            head[:] = int(segments[-1]), n - take - (k - 1) * self.segment
        return torch.cat(parts).sort().values if parts else torch.empty(0, dtype=torch.int64)

    def moved(self, old: torch.Tensor, new: torch.Tensor) -> None:
        """Rows left the records at ``old`` for those at ``new``."""
        ones = torch.ones(old.numel(), dtype=torch.int32)
        self.live.index_add_(0, old // self.segment, ones, alpha=-1)
        self.live.index_add_(0, new // self.segment, ones)

    def make_room(self, n: int, cache: Any) -> int:
        """At least ``n`` free places besides two segments' (cleaning moves up to one before it frees one), cleaning
        the segments with the fewest live records; returns how many of ``n`` fit (fewer only where the spare
        records are too few for a step's write-backs: the rest go to their own places).

        Once it cleans, it cleans ahead: up to a staging area's worth of places more (at most an eighth of the
        spare ones), so cleaning runs every few steps in groups of many segments, not in several small groups
        every step (each costs ~1 ms besides its records: measured, half the cleaning's time a step)."""
        reserve, ahead = self._margins(cache)
        if self.room() >= n + reserve:
            return n
        while self.room() < n + reserve + ahead:
            victims, before = self._victims(n + reserve + ahead - self.room()), self.room()
            cache.behind.wait()  # a segment filled by a write still in flight is read after it
            while victims.numel():  # a group at a time: its live records fit the room, then it is free
                fits = int((self.live[victims].to(torch.int64).cumsum(0) <= self.room(moving=True)).sum())
                group = victims[: min(fits, -(-cache.staging.shape[0] // self.segment))]
                if group.numel() == 0:
                    break
                self._clean(group.sort().values, cache)
                victims = victims[group.numel() :]
            if self.room() <= before:  # nothing left to clean (every segment full): the rest go to their own places
                break
        return max(0, min(n, self.room() - reserve))

    def foresee(self, n: int, cache: Any) -> torch.Tensor | None:
        """The places (ascending) whose records and owners ``make_room(n)`` would read if called next (None: it would
        clean nothing): a read-ahead asks the kernel for them while the file is on the disk, so the step that cleans
        finds them in the page cache (read by that step's thread, a segment at a time, a cleaning took up to 250 ms
        of a step)."""
        reserve, ahead = self._margins(cache)
        if self.room() >= n + reserve:
            return None
        return self._places(self._victims(n + reserve + ahead - self.room()).sort().values)

    def _margins(self, cache: Any) -> tuple[int, int]:
        """(the places kept free besides a need: two segments', since cleaning moves up to one before it frees one;
        how many more a cleaning frees once it runs: ``make_room``)."""
        return 2 * self.segment, min(cache.staging.shape[0], self.spare // 8) // self.segment * self.segment

    @staticmethod
    def write(cache: Any, places: torch.Tensor, ids: torch.Tensor, fill: Callable[..., None], *,
              now: bool = False) -> None:  # fmt: skip
        """Write rows ``ids`` at ascending free ``places`` (``fill(out)`` puts their records in ``out``, in that
        order), with their owners: on the cache's write-behind thread, or here (``now``, or when the thread cannot
        take them). Cleaning writes here: a few whole pages a call, less than a hand-over costs."""
        records = cache.behind.hold(places.numel(), fill)
        if records is None:  # (a finalizer's file, or more than the area holds: rare, so a buffer of its own)
            records = torch.empty((places.numel(), cache.layout.record_bytes), dtype=torch.uint8)
            fill(records)
            cache.behind.wait()
        elif not now:
            cache.behind.submit(places, records, ids)
            return
        cache.file.write_from(places, records)
        cache.file.write_owners(places, ids)

    def _victims(self, deficit: int) -> torch.Tensor:
        """The fewest segments of least live records that free ``deficit`` places, the least live first."""
        gain = self.segment - self.live
        usable = (~self.open & (gain > 0)).nonzero().squeeze(1)
        if usable.numel() == 0:
            return usable
        # ties to the lower segment (a stable sort, radix: live counts are below a segment's records; topk orders
        # ties as it likes), so a read-ahead that asked for a deficit's segments (``foresee``) asked for a smaller one's
        chosen = usable[sort_stable(self.live[usable], self.segment + 1)[1]]
        return chosen[: int(torch.searchsorted(gain[chosen].cumsum(0), deficit)) + 1]

    def _clean(self, segments: torch.Tensor, cache: Any) -> None:
        """Move the live records of ``segments`` (ascending) to the head of moved records, a staging area at a
        time; free them."""
        places, step = self._places(segments), cache.staging.shape[0]
        for a in range(0, places.numel(), step):
            chunk = places[a : a + step]
            owners = cache.file.read_owners(chunk)
            live = owners >= 0
            live[live.clone()] = cache.locate(owners[live]) == chunk[live]
            if not bool(live.any()):
                continue
            records = cache.staging[: chunk.numel()]
            cache.file.read_into(chunk, records)
            at = live.nonzero().squeeze(1)
            ids, new = owners[at], self.claim(at.numel(), moving=True)
            self.write(cache, new, ids, lambda out, r=records, i=at: torch.index_select(r, 0, i, out=out), now=True)
            cache.move(ids, new)
            self.moved(chunk[at], new)
            cache.stats.relocated += at.numel()
        self.open[segments] = True
        self.free = torch.cat([self.free, segments]).sort().values
