"""``shardvar.Tiered``: the storage option of a table whose rows live in a file, the hot ones in RAM.

``Tiered(path, cache_bytes=..., policy=...)`` is a value (it opens nothing); a module given it
as ``storage=`` opens it (:meth:`Tiered.open`) into a :class:`TieredRows`: the backing file
(:class:`RowFile`), streamed full from the module's initializer block by block, and a
:class:`RowCache` of as many rows (with their optimizer state) as ``cache_bytes`` holds.

The optimizer's state is added when an optimizer takes the table (``add_slot``): the file is
rewritten once, chunk by chunk, into records wide enough for it (a new file renamed over the old).
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from .._errors import ShardvarTypeError, ShardvarValueError
from .._validate import check_choice, check_int, check_number
from ..variables import TierSink
from ._budget import bytes_for, cache_bytes_for, capacity
from ._cache import POLICIES, RowCache
from ._file import BackingFileError, RecordLayout, RowFile
from ._log import spare_records
from ._shadow import active_load
from ._slots import keeps_places
from ._views import mapped, sharded_view

__all__ = ["Tiered", "TieredRows", "cache_bytes_for"]

CHUNK_ROWS = 1 << 14  # rows streamed at once when a file is filled or widened


@dataclass(frozen=True)
class Tiered:
    """Keep a table's rows in the file ``path``, at most ``cache_bytes`` of rows and state in RAM.

    ``policy``: which rows leave the cache first, ``"lru"`` (least recently used) or ``"lfu"``
    (least often). ``queue_depth``: reads and writes in flight at once (a disk serves many in parallel).
    ``read_ahead``: the fraction of ``cache_bytes`` reserved for rows the ``Prefetcher`` reads ahead
    (0 reads none ahead); the cache's slots get the rest, so slots and read-ahead rows together stay
    within ``cache_bytes``. ``spare``: records the file keeps free, as a fraction of the rows, so changed rows
    are written back in sequence into free ones (``_log``: one sequential write a step, not a random page
    write a row; the more spare, the fewer records cleaning moves: measured, 1.7, 0.75 and 0.3 moved per row
    written back at 0.25, 0.5 and 1); 0 writes each back to its own record. ``progress``: called
    ``progress(rows_done, rows)`` as the file is filled (when the table is made) and rewritten (when an
    optimizer adds its state), chunk by chunk.
    """

    path: str | os.PathLike
    cache_bytes: int
    policy: str = "lru"
    queue_depth: int = 32
    read_ahead: float = 0.125
    spare: float = 0.5
    progress: Callable[[int, int], None] | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.path, str | os.PathLike):
            raise ShardvarTypeError(f"path must be a file path; got {type(self.path).__name__}")
        path = Path(self.path)
        folder = path.parent
        if not folder.is_dir():
            raise BackingFileError(f"the folder of backing file {str(path)!r} does not exist; create it first")
        if not os.access(folder, os.W_OK | os.X_OK):
            raise BackingFileError(f"the folder of backing file {str(path)!r} is not writable")
        check_int(self.cache_bytes, "cache_bytes", minimum=1)
        check_choice(self.policy, "policy", POLICIES)
        check_int(self.queue_depth, "queue_depth", minimum=1)
        if self.progress is not None and not callable(self.progress):
            raise ShardvarTypeError(f"progress must be a callable (rows_done, rows) or None; got {self.progress!r:.80}")
        if check_number(self.read_ahead, "read_ahead", minimum=0.0) >= 1:
            raise ShardvarValueError(f"read_ahead must be a fraction of cache_bytes in [0, 1); got {self.read_ahead!r}")
        if check_number(self.spare, "spare", minimum=0.0) > 16:
            raise ShardvarValueError(f"spare must be a fraction of the rows in [0, 16]; got {self.spare!r}")

    def for_rank(self, rank: int) -> Tiered:
        """This storage for rank ``rank`` of a distributed table, whose ranks each keep their own shards' file:
        ``{rank}`` in the path is replaced by the rank, else the rank goes before the suffix
        (``emb.rows`` -> ``emb.rank1.rows``; ``emb`` -> ``emb.rank1``).

        >>> Tiered("/tmp/emb.rows", cache_bytes=1024).for_rank(1).path
        PosixPath('/tmp/emb.rank1.rows')
        """
        check_int(rank, "rank", minimum=0)
        path = Path(self.path)
        if "{rank}" in path.name:
            named = path.with_name(path.name.replace("{rank}", str(rank)))
        else:
            named = path.with_name(f"{path.stem}.rank{rank}{path.suffix}")
        return replace(self, path=named)

    def open(self, rows: int, dim: int, dtype: torch.dtype, blocks: Iterator[torch.Tensor]) -> TieredRows:
        """A new backing file of ``rows`` x ``dim`` filled from ``blocks``, and its cache."""
        layout = RecordLayout(rows, dim, str(dtype).removeprefix("torch."), 0)
        budget = capacity(self.cache_bytes, self.read_ahead, layout)
        if keeps_places(rows, budget[0]):  # a row may then live in any record: give the log its room
            layout = replace(layout, spare=spare_records(rows, self.spare))
        path = Path(self.path)
        if path.exists():
            _refuse_existing(path)
        file = RowFile.create(
            path,
            layout,
            _streamed(blocks, dim, dtype),
            chunk_rows=CHUNK_ROWS,
            queue_depth=self.queue_depth,
            progress=_counter(self.progress, rows),
        )
        return TieredRows(self, file, self.cache_of(file, budget))

    def cache_of(self, file: RowFile, budget: tuple[int, int, int]) -> RowCache:
        """The cache over ``file`` of ``budget`` (slots, read-ahead records, staging records)."""
        cache = RowCache(file, budget[0], self.policy, budget[1], budget[2])
        cache.bytes_for = lambda rows: bytes_for(rows, self.read_ahead, file.layout)
        return cache


def _counter(progress: Callable[[int, int], None] | None, rows: int) -> Callable[[int], None] | None:
    """``RowFile.create``'s per-chunk ``progress(rows)`` as the user's ``progress(rows_done, rows)``."""
    if progress is None:
        return None
    done = [0]

    def report(n: int) -> None:
        done[0] += n
        progress(done[0], rows)

    return report


def _refuse_existing(path: Path) -> None:
    """An existing file is never reused as a table's rows: a backing file is not a checkpoint."""
    RowFile.open(path).close()  # refuses a busy or unclean file with its own reason
    raise BackingFileError(
        f"backing file {str(path)!r} already exists: a backing file is not a checkpoint. Remove it (or give another "
        "path), and restore the table's rows from a checkpoint with shardvar.load"
    )


def _streamed(blocks: Iterator[torch.Tensor], dim: int, dtype: torch.dtype) -> Any:
    """``RowFile.create``'s ``init(ids)`` (consecutive chunks, in order) from blocks of any size."""
    held = [torch.empty((0, dim), dtype=dtype)]
    start = [0]  # the logical row of held[0]'s first row

    def init(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a, b = int(ids[0]), int(ids[-1]) + 1
        rows = held[0][a - start[0] :]
        while rows.shape[0] < b - a:
            block = next(blocks)
            rows = torch.cat([rows, block.to(dtype).reshape(-1, dim)])
        held[0], start[0] = rows[b - a :], b
        return rows[: b - a], torch.zeros((b - a, 0))

    return init


class TieredRows:
    """A table's rows in a backing file and a bounded cache (the ``RowTier`` a module looks up through)."""

    def __init__(self, spec: Tiered, file: RowFile, cache: RowCache) -> None:
        self.spec, self.file, self.cache = spec, file, cache
        self.sink: TierSink | None = None
        self._columns: dict[str, tuple[int, int]] = {}
        self._map: tuple | None = None  # (file, memmap, values, state) once a checkpoint asked for views
        self._closer = weakref.finalize(self, _close, cache, file)

    @property
    def values(self) -> torch.Tensor:
        return self.cache.values

    @property
    def state(self) -> torch.Tensor:
        return self.cache.state

    @property
    def layout(self) -> RecordLayout:
        return self.file.layout

    def resolve(
        self, ids: torch.Tensor, *, grad: bool, of: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, Any]:
        """Slots of ``ids``; with ``grad`` they stay theirs until the backward ran (its token is let go). ``of``:
        the batch ``ids`` are the distinct ids of (``RowTier.resolve``)."""
        slots, step = self.cache.use(ids, pin=grad, of=of)
        if not grad:
            return slots, None
        token = _Token()
        weakref.finalize(token, self.cache.pins.unpin, step)  # run at backward's end, or when its graph is dropped
        return slots, token

    def slot_columns(self) -> dict[str, tuple[int, int]]:
        return dict(self._columns)

    def mark_dirty(self, slots: torch.Tensor) -> None:
        self.cache.mark_dirty(slots)

    def add_slot(self, name: str, width: int, fill: float) -> None:
        """Widen every record by ``width`` state values ``fill`` (the file rewritten once, chunk by chunk)."""
        check_number(fill, "fill")
        if name in self._columns:
            return
        if self.cache.pins.pinned:
            raise ShardvarValueError("cannot add optimizer state to a tiered table while a backward is pending")
        old = self.file.layout
        layout = replace(old, state_width=old.state_width + width)
        budget = capacity(self.spec.cache_bytes, self.spec.read_ahead, layout)  # checked first
        self.cache.flush()

        def wider(values: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return values, torch.cat([state, torch.full((values.shape[0], width), float(fill))], 1)

        self._switch(self._rewrite(".widening", layout, wider), budget)
        self._columns[name] = (old.state_width, width)

    def _rewrite(self, suffix: str, layout: RecordLayout, change: Callable[..., tuple]) -> RowFile:
        """The rows in row order (the cache flushed first), ``change(values, state)`` chunk by chunk, in a new file of
        ``layout`` beside the backing file (``<name><suffix>``; one a dead process left is removed first), its whole
        size reserved first, then renamed over the backing file. The old file stays open for the caller."""
        old = self.file
        beside = old.path.with_name(old.path.name + suffix)
        beside.unlink(missing_ok=True)

        def init(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return change(*old.layout.split(old.read(self.cache.places_of(ids))))

        new = RowFile.create(beside, layout, init, chunk_rows=CHUNK_ROWS, queue_depth=self.spec.queue_depth,
                             progress=_counter(self.spec.progress, old.layout.rows))  # fmt: skip
        os.replace(beside, old.path)
        new.path = old.path
        return new

    def _budget(self) -> tuple[int, int, int]:
        cache = self.cache
        return cache.capacity, cache.reserve or 0, cache.staging.shape[0]

    def _switch(self, new: RowFile, budget: tuple[int, int, int]) -> None:
        """Make ``new`` (already at the backing file's path) the table's file, with an empty cache."""
        self._closer.detach()
        reading = self.cache.reading
        stats = self._drop_cache()  # (its writes done first: they go to the old file)
        with reading:  # a read-ahead of the old cache still reading the old file finishes first
            self.file.close()  # the old file, replaced at its path: its rows are not read again
        self.file, self.cache = new, self.spec.cache_of(new, budget)
        self.cache.stats = stats
        self._closer = weakref.finalize(self, _close, self.cache, new)

    def _drop_cache(self) -> Any:
        """Let go of the cache (its memory freed before a new one is made: never two at once) and return its
        statistics. Its rows were written back or are no longer wanted."""
        stats = self.cache.stats
        with self.cache.lock:  # (a resolve ahead running in it finishes first; none runs after)
            self.cache.pins.retire()
        self.cache.behind.close()
        self.cache = None  # type: ignore[assignment]
        return stats

    def adopt(self, new: RowFile, mapping: tuple) -> None:
        """A load's shadow, renamed over the backing file, becomes the table's file (``_shadow``)."""
        self._switch(new, self._budget())
        self._map = mapping

    def pending_backward(self) -> bool:
        return self.cache.pins.pinned

    def sharded(
        self, layout: Any, slot: str | None = None, row_wise: bool = False, owned: tuple[int, ...] | None = None
    ) -> Any:
        """The rows (``slot`` None) or the state slot ``slot`` as a ShardsView in ``layout`` over the file
        (every changed row written back first); ``owned``: the file holds those shards only, back to back."""
        self.cache.flush()
        values, state = self._records()
        rows = layout.num_rows
        column = values
        if slot is not None:
            first, width = self._columns[slot]
            column = state[:, first] if row_wise else state[:, first : first + width]
        return sharded_view(layout, (rows, *column.shape[1:]), column, owned)

    def _records(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(values, state) views of every record: of a shadow file while a load runs (it writes there)."""
        load = active_load()
        if load is not None:
            shadow = load.shadow_of(self)
            return shadow.values, shadow.state
        self._in_row_order()
        if self._map is None or self._map[0] is not self.file:
            self._map = (self.file, *mapped(self.file))
        return self._map[2], self._map[3]

    def _in_row_order(self) -> None:
        """Every record back at its row's own place (record i: row i), for views of the file: once the cache moved
        rows (``RowCache``: a changed row is written back through the file's log), the file is rewritten in
        row order, chunk by chunk, into a new file renamed over it. The cache keeps its rows."""
        self.cache.flush()
        if not self.cache.moved:
            return
        old = self.file
        try:
            new = self._rewrite(".ordering", old.layout, lambda values, state: (values, state))
        except BackingFileError as e:
            raise BackingFileError(
                f"the rows of the tiered table of {str(old.path)!r} are out of row order (a changed row is written "
                "back through its log): a checkpoint rewrites them in order into a new file beside it first, "
                f"which needs room for a second copy: {e}"
            ) from None
        self._closer.detach()
        self.cache.rebase(new)
        self.file = new
        old.discard()
        self._closer = weakref.finalize(self, _close, self.cache, new)

    def reload(self) -> None:
        """Forget every cached row without writing it back: the file was just written (a checkpoint loaded)."""
        load = active_load()
        if load is not None and load.holds(self):  # the load wrote into its shadow only: the file is unchanged
            return
        if self.cache.pins.pinned:
            raise ShardvarValueError("cannot load a tiered table while a backward of its lookups is pending")
        if not bool((self.cache.key >= 0).any()) and not self.cache.staged_rows:
            return  # nothing held to forget (a committed load switched to its new file with an empty cache)
        budget = self._budget()
        self._closer.detach()
        stats = self._drop_cache()
        self.cache = self.spec.cache_of(self.file, budget)
        self.cache.stats = stats
        self._closer = weakref.finalize(self, _close, self.cache, self.file)

    def cache_stats(self) -> dict[str, float]:
        """Hit rate, hits, misses, evictions, rows written back, records the log's cleaning moved, bytes read and
        written (records and their owners), capacity, and the bytes
        the cache keeps outside ``cache_bytes`` (its index and per-slot records: ``bookkeeping_bytes``).
        A write-back in flight is waited for first: the bytes written are those of every row written back."""
        with self.cache.lock:
            self.cache.behind.wait()
        s = self.cache.stats
        return {
            "hit_rate": s.hit_rate,
            "hits": s.hits,
            "misses": s.misses,
            "evictions": s.evictions,
            "written_back": s.written_back,
            "prefetched": s.prefetched,
            "relocated": s.relocated,
            "bytes_read": self.file.bytes_read,
            "bytes_written": self.file.bytes_written,
            "capacity_rows": self.cache.capacity,
            "spare_rows": self.file.layout.spare,
            "read_ahead_rows": self.cache.reserve or 0,
            "cache_bytes": self.cache.nbytes,
            "bookkeeping_bytes": self.cache.bookkeeping_bytes,
        }

    def peek(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(values, state) of rows ``ids`` as they are now, wherever they are held; changes nothing."""
        return self.cache.peek(ids)

    def flush(self) -> None:
        self.cache.flush()

    def close(self) -> None:
        """Write back what changed and close the file cleanly (also done when the table is collected)."""
        self._closer()


class _Token:
    """Kept by a pending backward: its batch's rows stay in their slots while it lives."""

    __slots__ = ("__weakref__",)


def _close(cache: RowCache, file: RowFile) -> None:
    if file.fd < 0:
        return
    file.inline = True  # maybe run by the garbage collector, inside another file's pool call
    if cache.behind.writing_here() or cache.pins.resolving == threading.get_ident():
        # the collector runs inside this table's own write-back, or a resolve ahead holding its cache's lock, which
        # cannot be waited for from under itself: the file is let go as it is, never marked clean (as after a
        # crash: it is refused when opened), and a resolve ahead running here stops (``_ahead.resolve_ahead``)
        cache.pins.retire()
        file.discard()
        return
    cache.close()
    file.close()
