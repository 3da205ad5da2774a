"""WriteBehind: the rows a cache gives up, written to its file on a thread while the step goes on.

A training step in its steady state evicts about as many trained (changed) rows as it misses,
and each must be written back: a few thousand writes into the page cache, ~2-5 us of kernel time
each, as much as the rest of the step. Written on the step's own thread they add up; here they
are copied into a fixed area (counted in ``cache_bytes``, as the staging area is) and written by
one thread of their own (the native kernel lets the interpreter's lock go while it writes), so the
writes overlap the step's reads and compute.

Order is what keeps it exact. One write is in flight at most: the next eviction waits for it
first. The cache waits for it before any read of the file that could want its rows (a batch's
misses, a read-ahead started after it was issued, ``peek``, ``flush``); a read-ahead started
before it marks its ids stale (``RowCache._staged``), so they are read again, after it.

A write that fails leaves rows that are in neither the cache nor the file: every later use of
the cache raises, and the file is never marked clean (it is refused when opened again), so training
restarts from the last checkpoint, as after a crash.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from ._file import BackingFileError, RowFile

__all__ = ["WriteBehind"]


class WriteBehind:
    """Up to ``rows`` records of ``file`` written on a thread of their own (see the module docstring)."""

    def __init__(self, file: RowFile, rows: int) -> None:
        self.file = file
        self.area = torch.zeros((rows, file.layout.record_bytes), dtype=torch.uint8)
        self._pool: ThreadPoolExecutor | None = None
        self._pending: Future | None = None
        self._places = torch.empty(0, dtype=torch.int64)  # the records the write in flight writes
        self._error: BaseException | None = None
        self._writer: int | None = None  # the thread running a write now

    @property
    def nbytes(self) -> int:
        return self.area.nbytes

    @property
    def pending(self) -> Future | None:
        return self._pending

    def writes_any(self, places: torch.Tensor) -> bool:
        """Whether the write in flight writes any record at ``places`` (a read of those waits for it)."""
        return self._pending is not None and bool(torch.isin(places, self._places).any())

    def wait(self, pending: Future | None = None) -> None:
        """Until the write in flight is done, or ``pending`` (one seen earlier, from another thread: the
        write in flight is then left for the cache's own thread to clear); raise if any write failed."""
        mine = pending is None
        pending = self._pending if mine else pending
        if pending is not None:
            try:
                pending.result()
            except BaseException as e:  # kept: every later use of the cache raises it
                self._error = self._error or e
            if mine:
                self._pending = None
        if self._error is not None:
            raise BackingFileError(
                f"an earlier write-back to backing file {str(self.file.path)!r} failed ({self._error}); the rows "
                "it held are lost and the file is not valid: restore the table from its last checkpoint"
            ) from self._error

    def start(self, places: torch.Tensor, fill: Callable[[torch.Tensor], None]) -> bool:
        """Write records at ascending ``places`` (``fill(out)`` puts them in ``out``) on the thread; False
        (nothing done) when they do not fit the area: the caller writes them itself."""
        records = self.hold(places.numel(), fill)
        if records is None:
            return False
        self.submit(places, records)
        return True

    def hold(self, n: int, fill: Callable[[torch.Tensor], None]) -> torch.Tensor | None:
        """``n`` records put in the area by ``fill(out)`` (the write in flight is waited for first), for a
        ``submit`` once their places may be written; None (nothing done) when they do not fit the area."""
        if n > self.area.shape[0] or self.file.inline:
            return None
        self.wait()
        records = self.area[:n]
        fill(records)
        return records

    def submit(self, places: torch.Tensor, records: torch.Tensor, owners: torch.Tensor | None = None) -> None:
        """Write ``records`` (held by ``hold``) at ascending ``places``, on the thread; ``owners``: the rows they
        hold, recorded too (``RecordLog``: records written where other rows were)."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shardvar-write-behind")
        self._pending = self._pool.submit(self._write, places, records, owners)
        self._places = places

    def _write(self, places: torch.Tensor, records: torch.Tensor, owners: torch.Tensor | None) -> None:
        self._writer = threading.get_ident()
        try:
            disk = self.file.disk_bound  # the file's pages are on the disk, not in the page cache:
            if disk and owners is None:  # (the log's writes fill whole new pages: none to read first)
                self.file.will_need(places)  # the pages written into, read at once if they left (RowFile.will_need)
            self.file.write_from(places, records)
            if owners is not None:
                self.file.write_owners(places, owners)
            if disk:
                self.file.send()  # and written out at once (RowFile.send)
        finally:
            self._writer = None

    def writing_here(self) -> bool:
        """Whether this thread is inside a write of this area's (the garbage collector may run there)."""
        return self._writer == threading.get_ident()

    def close(self) -> None:
        """Wait for the write in flight (raising if it failed) and let the thread go."""
        try:
            self.wait()
        finally:
            if self._pool is not None:  # a finalizer (``inline``) joins no thread: see RowFile.inline
                self._pool.shutdown(wait=not self.file.inline)
                self._pool = None
