"""RowFile: a table's rows and their optimizer state in one file on disk, one record per row.

A record is the row's values followed by its state (``state_width`` float32 slots: a row-wise
optimizer's accumulator, an element-wise one's moments), so one read brings both. The file is a
4 KiB header (magic, then JSON: rows, dim, dtype, state width, record size, whether it was
closed cleanly) and the records back to back. It is a working store, not a checkpoint: opening
marks it in use (``clean: false``) and only ``close()`` marks it clean again, so a file a killed
process left is refused instead of silently trained on; an exclusive ``flock`` keeps a second
process out while it is open.

Reads and writes move whole records, consecutive ones in one call. A read the page cache holds
is made at once on the calling thread (``RWF_NOWAIT``); the others, and the writes, go to
``queue_depth`` threads: a miss on disk costs a random read, and a disk serves many at once only
when many are in flight, which one thread cannot give. The native kernel (``_native.py``, compiled
on first use) does this without the interpreter's lock; without it the same is done in Python
(``os.preadv`` / ``os.pwritev``, a pool of threads), with the same bytes and the same errors.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from .._errors import ShardvarValueError
from .._validate import check_int
from . import _native
from ._header import HEADER, OWNER_BYTES, BackingFileError, RecordLayout, read_header, write_header
from ._mapped import MappedRecords
from ._pyio import python_transfer, run_parts, runs

__all__ = ["RowFile", "RecordLayout", "BackingFileError"]

SPREAD_WRITES = 256  # records a write thread takes at least, when writes are spread (``disk_bound``)
_SYNC_FILE_RANGE = getattr(ctypes.CDLL(None, use_errno=True), "sync_file_range", None)  # Linux's (RowFile.send)
_SYNC_FILE_RANGE_WRITE = 2  # start writing the range's dirty pages; wait for nothing
_PAGE = 4096  # the page cache's unit: a write of part of one that is not cached reads it first
_NOWAIT = hasattr(os, "RWF_NOWAIT")  # Linux 4.14+: a read that fails rather than wait for the disk


class RowFile:
    """An open backing file (see the module docstring); ``create`` or ``open`` it, ``close`` when done."""

    def __init__(self, path: Path, fd: int, layout: RecordLayout, queue_depth: int) -> None:
        self.path, self.fd, self.layout = path, fd, layout
        self.queue_depth = queue_depth
        if hasattr(os, "posix_fadvise"):  # rows are read where ids fall: the kernel's read-ahead of a page's
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # neighbours would only evict other rows' pages
        self._pool = ThreadPoolExecutor(max_workers=queue_depth, thread_name_prefix="shardvar-io")
        self._native = _native.kernel()  # None: the Python path (no compiler, SHARDVAR_NATIVE=0)
        self.bytes_read = self.bytes_written = 0
        # A finalizer's (the garbage collector's) file: transfers on the calling thread (the pool's locks may be
        # held) and no thread joined when closing: the collector may run inside a thread's start while threading
        # holds its own lock, and a join there deadlocks (seen in CI: the new thread never started)
        self.inline = False
        # Whether every row is in its own record (``RecordLog``: none written back elsewhere); kept in the header
        self.ordered = True
        # Whether the last large read mostly waited for the disk: then writes, which read their pages
        # first, go out on many threads too (in the page cache one thread writes fastest: _native_io.c)
        self.disk_bound = False
        # While the page cache holds the whole file, reads are a gather from a mapping of it (``_mapped``)
        self.mapped = MappedRecords(fd, HEADER, layout.places, layout.record_bytes)

    # -- opening and closing ------------------------------------------------------------------------
    @classmethod
    def create(
        cls,
        path: str | os.PathLike,
        layout: RecordLayout,
        init: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
        *,
        chunk_rows: int = 1 << 16,
        queue_depth: int = 32,
        progress: Callable[[int], None] | None = None,
    ) -> RowFile:
        """A new file of ``layout.rows`` records, ``init(ids) -> (values, state)`` chunk by chunk.

        The whole size is reserved first (``posix_fallocate``), so a disk too small fails before
        anything is written, and the file is removed again; memory stays one chunk.
        """
        path = Path(path)
        check_int(chunk_rows, "chunk_rows", minimum=1)
        if path.exists():
            raise BackingFileError(f"backing file {str(path)!r} already exists; open it, or remove it first")
        size = layout.file_bytes  # the owners of spare records too: reserved, they read as zeros
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        except OSError as e:
            raise BackingFileError(f"cannot create backing file {str(path)!r}: {e.strerror}") from None
        try:
            _lock(fd, path)
            _reserve(fd, path, size)
            write_header(fd, layout, clean=False)
            file = cls(path, fd, layout, queue_depth)
            for first in range(0, layout.rows, chunk_rows):
                ids = torch.arange(first, min(first + chunk_rows, layout.rows))
                values, state = init(ids)
                file.write(ids, layout.join(values, state))
                if progress is not None:
                    progress(int(ids.numel()))
            file.settle()
            return file
        except BaseException:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise

    def settle(self) -> None:
        """Write the file out and drop it from the page cache, before records are read and written one by one.

        Written in large sequential pieces, the file sits in the page cache in large blocks (folios):
        a later write of one record then dirties a whole block and costs 10-30 us in the kernel
        (~130 ms a step for the 4k write-backs of the README's benchmark). Dropped, it comes back
        record by record, page by page, where a write costs ~2 us.
        """
        os.fsync(self.fd)
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_DONTNEED)

    @classmethod
    def open(cls, path: str | os.PathLike, *, queue_depth: int = 32) -> RowFile:
        """Open a file a ``close()`` left clean; it is marked in use until closed again."""
        path = Path(path)
        fd = open_fd(path, os.O_RDWR)
        try:
            _lock(fd, path)
            layout, clean, ordered = read_header(fd, path)
            if not clean:
                raise BackingFileError(
                    f"backing file {str(path)!r} was not closed cleanly (its process died while training): its rows "
                    "may be half written. Restart from your last checkpoint (shardvar.load) into a new backing file"
                )
            if os.fstat(fd).st_size != layout.file_bytes:
                raise BackingFileError(f"backing file {str(path)!r} is truncated: its size does not match its header")
            write_header(fd, layout, clean=False, ordered=ordered)
            file = cls(path, fd, layout, queue_depth)
            file.ordered = ordered
            return file
        except BaseException:
            os.close(fd)
            raise

    def close(self) -> None:
        """Make every write durable, mark the file clean, and release it (idempotent)."""
        if self.fd < 0:
            return
        self._pool.shutdown(wait=not self.inline)
        self.mapped.close()
        os.fsync(self.fd)
        write_header(self.fd, self.layout, clean=True, ordered=self.ordered)
        os.fsync(self.fd)
        os.close(self.fd)  # releases the flock
        self.fd = -1

    def send(self) -> None:
        """Start writing the file's changed pages to the disk, without waiting (Linux's ``sync_file_range``).

        Called after write-backs when reads show the file is on the disk, not in the page cache (a process
        under a memory cap: cgroup v1 counts the page cache, and its dirty limits are the machine's). Left
        to the kernel, written pages stay dirty until the cap is reached; each page a read then brings in
        must wait for one of them to be written, and the pages read ahead for the next batch, the clean
        ones, are dropped first, so the write-backs into them read them again. Measured (2^24 rows, 512 MiB
        cache, 1.25 GiB cap, Zipf ids, with the Prefetcher): 520 ms a step, 75 MiB read from the disk;
        sent at once, 295 ms and 31 MiB. Without ``sync_file_range`` (not Linux) nothing is sent early.
        """
        if _SYNC_FILE_RANGE is None or self.fd < 0:
            return
        if _SYNC_FILE_RANGE(self.fd, ctypes.c_int64(0), ctypes.c_int64(0), _SYNC_FILE_RANGE_WRITE) != 0:
            error = ctypes.get_errno()
            raise BackingFileError(f"cannot write to backing file {str(self.path)!r}: {os.strerror(error)}")

    def will_need(self, ids: torch.Tensor, *, owners: bool = False) -> None:
        """Ask the kernel to read the pages of the records of ascending ``ids`` now (or of their ``owners``), all at
        once, without waiting.

        Called before write-backs when reads show the file is on the disk: a write of part of a page the page
        cache does not hold reads that page first, inside the write, one write at a time under the file's lock
        (with the ``Prefetcher``, a page read a step ahead is often dropped under a memory cap before a row is
        written into it). Asked here (``POSIX_FADV_WILLNEED``, one call per run of pages), those reads are in
        flight together, and each write finds its page or waits for that one read only.
        """
        if not hasattr(os, "posix_fadvise") or self.fd < 0 or ids.numel() == 0 or (owners and not self.layout.spare):
            return
        base, size = (self.layout.owners_offset, OWNER_BYTES) if owners else (HEADER, self.layout.record_bytes)
        at = base + ids.numpy().astype(np.int64) * size
        pages = np.unique(np.concatenate([at // _PAGE, (at + size - 1) // _PAGE]))
        for _, first, count in runs(pages):  # a call per run of consecutive pages
            os.posix_fadvise(self.fd, first * _PAGE, count * _PAGE, os.POSIX_FADV_WILLNEED)

    def discard(self) -> None:
        """Let go of a file that is not kept (replaced at its path, or a load's shadow): closed as it is, never
        marked clean (idempotent)."""
        if self.fd >= 0:
            self._pool.shutdown(wait=not self.inline)
            self.mapped.close()
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> RowFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- records ------------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self.fd < 0:
            raise BackingFileError(f"backing file {str(self.path)!r} is closed")

    def _check_ids(self, ids: torch.Tensor) -> np.ndarray:
        self._check_open()
        out = ids.detach().to("cpu", torch.int64).numpy()
        if out.size and (int(out.min()) < 0 or int(out.max()) >= self.layout.places):
            raise ShardvarValueError(
                f"records must be in [0, {self.layout.places}); got {int(out.min())}..{int(out.max())}"
            )
        return out

    def check_range(self, low: int, high: int) -> None:
        """Refuse row ids from ``low`` to ``high`` unless every one is a row of this file."""
        if low < 0 or high >= self.layout.rows:
            raise ShardvarValueError(f"row ids must be in [0, {self.layout.rows}); got {low}..{high}")

    def read(self, ids: torch.Tensor) -> torch.Tensor:
        """The records of ``ids`` (any order, distinct or not) as ``[len(ids), record_bytes]`` uint8."""
        order_ids = self._check_ids(ids)
        order = np.argsort(order_ids, kind="stable")
        sorted_ids = order_ids[order]
        out = torch.empty((sorted_ids.size, self.layout.record_bytes), dtype=torch.uint8)
        self._transfer(sorted_ids, out.numpy(), write=False)
        self.bytes_read += out.numel()
        if np.all(order[:-1] < order[1:]):
            return out
        result = torch.empty_like(out)
        result[torch.from_numpy(order)] = out
        return result

    def write(self, ids: torch.Tensor, records: torch.Tensor) -> None:
        """Write ``records[i]`` as the record of distinct ``ids[i]``."""
        raw = self._check_ids(ids)
        if records.shape != (raw.size, self.layout.record_bytes) or records.dtype != torch.uint8:
            expected = f"uint8 [{raw.size}, {self.layout.record_bytes}]"
            raise ShardvarValueError(f"records must be {expected}; got {records.dtype} {list(records.shape)}")
        order = np.argsort(raw, kind="stable")
        data = records.contiguous().numpy()
        self._transfer(raw[order], data[order] if raw.size > 1 else data, write=True)
        self.bytes_written += records.numel()

    def read_into(self, ids: torch.Tensor, out: torch.Tensor) -> None:
        """Read the records of ascending, distinct ``ids`` into ``out`` (contiguous ``[len(ids), record_bytes]``
        uint8, e.g. a cache's staging area): no buffer of its own."""
        raw = self._check_ids(ids)
        self._transfer(raw, self._check_buffer(out, raw.size, "out"), write=False)
        self.bytes_read += out.numel()

    def write_from(self, ids: torch.Tensor, records: torch.Tensor) -> None:
        """Write ``records`` (contiguous, one per id) as the records of ascending, distinct ``ids``; no copy."""
        raw = self._check_ids(ids)
        self._transfer(raw, self._check_buffer(records, raw.size, "records"), write=True)
        self.bytes_written += records.numel()

    def move_rows(self, places: torch.Tensor, slots: torch.Tensor, values: torch.Tensor, state: torch.Tensor, *,
                  write: bool) -> bool:  # fmt: skip
        """``values[slots[i]]`` and ``state[slots[i]]`` from the record at ``places[i]`` (int64, distinct, any order),
        or into it (``write``), if the mapping takes reads (writes) now: one pass of row copies, no staging; False
        (nothing done) where it does not. (The row copies check the places and slots: no pass of their own here.)"""
        self._check_open()

        def move(view: torch.Tensor) -> None:
            fields = [(values, 0), (state, self.layout.state_offset)]
            _native.move_fields(view, places, slots, fields, write=write)

        if not self.mapped.move(places, move, write):
            return False
        size = places.numel() * self.layout.record_bytes
        self.bytes_written += size if write else 0
        self.bytes_read += 0 if write else size
        return True

    def read_owners(self, places: torch.Tensor) -> torch.Tensor:
        """The row each record of ascending ``places`` holds (-1: none), as written by ``write_owners``."""
        raw = self._check_ids(places)
        found = np.zeros(raw.size, dtype=np.int64)
        parts = runs(raw)
        if len(parts) > 1 and self.disk_bound:  # on the disk: every run asked for at once, then read one by one
            self.will_need(places, owners=True)
        for at, first, count in parts:
            found[at : at + count] = np.frombuffer(self._owner_io(first, count), dtype=np.int64)
        own = np.where(raw < self.layout.rows, raw, -1)  # never written: the record of its own row, or a spare one
        return torch.from_numpy(np.where(found > 0, found - 1, own))

    def write_owners(self, places: torch.Tensor, ids: torch.Tensor) -> None:
        """Record that the records at ascending ``places`` hold rows ``ids`` (one call per run of places)."""
        raw = self._check_ids(places)
        data = ids.to(torch.int64).add(1).numpy()
        for at, first, count in runs(raw):
            self._owner_io(first, count, data[at : at + count].tobytes())

    def _owner_io(self, first: int, count: int, data: bytes | None = None) -> bytes:
        if not self.layout.spare:
            raise ShardvarValueError(f"backing file {str(self.path)!r} has no spare records, so no record owners")
        at = self.layout.owners_offset + first * OWNER_BYTES
        try:
            if data is not None:
                if os.pwrite(self.fd, data, at) != len(data):
                    raise OSError(errno.EIO, "short write of record owners")
                self.bytes_written += len(data)
                return data
            got = os.pread(self.fd, count * OWNER_BYTES, at)
            self.bytes_read += len(got)
        except OSError as e:
            raise BackingFileError(f"cannot use backing file {str(self.path)!r}: {e.strerror or e}") from None
        if len(got) != count * OWNER_BYTES:
            raise BackingFileError(f"backing file {str(self.path)!r} is truncated: its record owners end early")
        return got

    def _check_buffer(self, buffer: torch.Tensor, n: int, name: str) -> np.ndarray:
        """``buffer`` as the array a transfer reads or writes in place: contiguous uint8 ``[n, record_bytes]``."""
        shape = (n, self.layout.record_bytes)
        if buffer.dtype != torch.uint8 or buffer.shape != shape or buffer.device.type != "cpu":
            got = f"{buffer.dtype} {list(buffer.shape)} on {buffer.device}"
            raise ShardvarValueError(f"{name} must be a CPU uint8 tensor {list(shape)}; got {got}")
        if not buffer.is_contiguous():  # the transfer reads or writes its memory in place
            raise ShardvarValueError(f"{name} must be contiguous; got strides {buffer.stride()}")
        return buffer.numpy()

    def _transfer(self, ids: np.ndarray, buffer: np.ndarray, *, write: bool) -> None:
        """Move whole records between ``buffer`` (one row per id, ascending ids) and the file."""
        if ids.size == 0:
            return
        through = self.mapped.write if write else self.mapped.read
        if through(torch.from_numpy(ids), torch.from_numpy(buffer)):
            self.disk_bound = False  # (mapped: the page cache holds the file)
            return
        try:
            if self._native is not None:  # a finalizer (``inline``) starts no thread
                depth = 1 if self.inline else self.queue_depth
                ids, size = np.ascontiguousarray(ids, dtype=np.int64), self.layout.record_bytes
                if write and self.disk_bound and depth > 1 and ids.size >= 2 * SPREAD_WRITES:
                    self._spread_writes(ids, buffer, size)
                    return
                waited = self._native.transfer(self.fd, ids, buffer, size, HEADER, write, _NOWAIT, depth)
                if not write and ids.size >= SPREAD_WRITES:
                    self.disk_bound = waited * 4 > ids.size
            else:
                python_transfer(self, ids, buffer, write, _NOWAIT, HEADER)
        except OSError as e:
            what = "write to" if write else "read from"
            raise BackingFileError(f"cannot {what} backing file {str(self.path)!r}: {e.strerror or e}") from None

    def _spread_writes(self, ids: np.ndarray, buffer: np.ndarray, size: int) -> None:
        """Writes over the pool's threads, when the reads show the file's pages are on the disk: a write of
        one record into a page the page cache does not hold reads that page first, and one thread would
        wait for those reads one at a time (behind the read-ahead's many in flight, ~0.1 ms each)."""
        cuts = np.linspace(0, ids.size, min(self.queue_depth, ids.size // SPREAD_WRITES) + 1).astype(np.int64)
        parts = [(a, b) for a, b in zip(cuts[:-1].tolist(), cuts[1:].tolist(), strict=True) if b > a]
        native = self._native

        def work(part: tuple[int, int]) -> None:
            a, b = part
            native.transfer(self.fd, ids[a:b], buffer[a:b], size, HEADER, True, _NOWAIT, 1)

        run_parts(self._pool, work, parts, inline=False)


def open_fd(path: Path, flags: int) -> int:
    """``os.open(path, flags)``, a failure as shardvar's error naming the file."""
    try:
        return os.open(path, flags)
    except OSError as e:
        raise BackingFileError(f"cannot open backing file {str(path)!r}: {e.strerror}") from None


def _lock(fd: int, path: Path) -> None:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise BackingFileError(
            f"backing file {str(path)!r} is open in another process (or another table of this one); "
            "give each table and each rank its own file"
        ) from None


def _reserve(fd: int, path: Path, size: int) -> None:
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        free = os.statvfs(path.parent).f_bavail * os.statvfs(path.parent).f_frsize
        raise BackingFileError(
            f"cannot reserve {size} bytes for backing file {str(path)!r} ({e.strerror}); {free} bytes are free there"
        ) from None
