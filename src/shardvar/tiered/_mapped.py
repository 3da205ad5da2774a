"""MappedRecords: a backing file's records read (and written) through a mapping while the page cache holds the file.

Why: a record read from the page cache by ``pread`` costs ~0.8 us of kernel time (a system call, a look-up, a
copy); a training step's 7k misses then cost ~6 ms, more than half the in-memory step. Through a shared
mapping of the file, once its pages are mapped, the same reads are one gather (``torch.index_select``),
~0.05 us a record. The page cache is one, so what ``pwrite`` writes the mapping sees at once, and the reverse.

When: only while the page cache holds (nearly) the whole file. A mapped page that is not there faults in the
gathering thread, one disk read at a time, where ``RowFile``'s reads keep many in flight. Whether it is
held is asked of the kernel (``cachestat``, Linux 6.5+; elsewhere the mapping is never used) at most every
``RECHECK_S`` seconds, since the answer costs up to a few ms for a file cached page by page. While mapped,
a gather that took major page faults means the file left the page cache: the mapping is released and the
system-call reads take over again until the next check.

Writes: while mapped, a record written back (``RowFile.write_from``) is a scatter into the mapping too, where a
``pwrite`` of a record into the page cache costs 2-5 us. Only a file without holes is mapped writable (its
blocks cover its size): a write into a hole would allocate a block in the page fault, where a full disk is a
``SIGBUS``, not an error. Created files are reserved whole (``posix_fallocate``); a sparse copy of one is not.
A write that faults (a page the page cache no longer holds) releases the mapping, as a read does.

What it costs: the mapped pages count in the process's RSS (as shared file pages, ``RssFile``); they are the
page cache's, which the kernel reclaims as before. Released, the file is unmapped and they leave the
process. A file truncated under the mapping by another process would kill this one (``SIGBUS``): ``RowFile``
holds an exclusive lock on it, which a cooperating process respects, and each gather first checks the
file's size (``fstat``, ~1 us), so only a truncation in the middle of a gather is not caught.
``SHARDVAR_MAP_FILES=0`` turns the mapping off.
"""

from __future__ import annotations

import ctypes
import math
import mmap
import os
import resource
import threading
import time
import warnings
from collections.abc import Callable

import torch

from ._native import scatter_rows

__all__ = ["MappedRecords", "cached_pages"]

RECHECK_S = 2.0  # seconds between asking the kernel whether the page cache holds the file
MAX_UNCACHED = 1 / 256  # the most of the file's pages the page cache may lack while reads go through the mapping
_CACHESTAT = 451  # the system call's number (one for every architecture, since Linux 6.5)
_PAGE = mmap.PAGESIZE
_libc = ctypes.CDLL(None, use_errno=True)


class _Range(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Stat(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint64) for name in ("cache", "dirty", "writeback", "evicted", "recently_evicted")]


def cached_pages(fd: int, offset: int, length: int) -> int | None:
    """How many pages of ``fd``'s bytes ``[offset, offset + length)`` the page cache holds; None where the kernel
    cannot say (before Linux 6.5, not Linux, or refused)."""
    stat = _Stat()
    if _libc.syscall(_CACHESTAT, fd, ctypes.byref(_Range(offset, length)), ctypes.byref(stat), 0) != 0:
        return None
    return int(stat.cache)


def _allocated(fd: int) -> bool:
    """Whether every byte of ``fd`` has a block on the disk: no hole, so no write into it allocates (reserved by
    ``posix_fallocate`` counts, written or not). By the blocks the file holds (``st_blocks``): a file system that
    counts its metadata there could hide a hole of a block or two, which only a full disk would make fatal."""
    st = os.fstat(fd)
    return st.st_blocks * 512 >= st.st_size


def _major_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_majflt  # every thread's: a gather may run on several


class MappedRecords:
    """``records`` records of ``record_bytes`` at ``offset`` of ``fd`` (page-aligned), read through a mapping while
    the page cache holds them (see the module docstring)."""

    def __init__(self, fd: int, offset: int, records: int, record_bytes: int) -> None:
        self.fd, self.offset, self.records, self.record_bytes = fd, offset, records, record_bytes
        self.enabled = os.environ.get("SHARDVAR_MAP_FILES", "1").strip() != "0" and records > 0
        self._map: mmap.mmap | None = None
        self._view: torch.Tensor | None = None  # [records, record_bytes] over the mapping: never handed out
        self.writable = False  # whether the mapping takes writes too (see the module docstring)
        self._next_check = 0.0  # (monotonic seconds) the first read asks
        self._lock = threading.Lock()  # a gather and a release or close: the mapping stays while a gather reads it
        self._holder: int | None = None  # the thread inside a pass (``_through``), holding ``_lock``
        self._closing = self._releasing = False  # asked by that thread inside its pass: done once the pass is
        self.gathers = self.scatters = 0  # reads and writes served through the mapping

    @property
    def active(self) -> bool:
        """Whether reads go through the mapping now."""
        return self._view is not None

    @property
    def takes_writes(self) -> bool:
        """Whether writes go through the mapping now (it is active and writable)."""
        return self._view is not None and self.writable

    def read(self, ids: torch.Tensor, out: torch.Tensor) -> bool:
        """Copy the records of ``ids`` (int64, in range) into ``out`` if reads go through the mapping now; False
        (nothing done) where they do not: the caller reads them with system calls."""
        return self.move(ids, lambda view: torch.index_select(view, 0, ids, out=out), write=False)

    def write(self, ids: torch.Tensor, records: torch.Tensor) -> bool:
        """Copy ``records`` (one per distinct id of ``ids``, int64, in range) into the file's records if the mapping
        takes writes now; False (nothing done) where it does not: the caller writes them with system calls."""
        return self.move(ids, lambda view: scatter_rows(view, ids, records), write=True)

    def move(
        self, ids: torch.Tensor, move: Callable[[torch.Tensor], object], write: bool, *, records: int | None = None,
        count: bool = True,
    ) -> bool:  # fmt: skip
        """``move(view)`` (``[records, record_bytes]`` uint8 over the mapping), which reads the records of ``ids``
        only (or writes them: ``write``), if the mapping takes reads (writes) now; False (nothing done) if not.
        ``records``: how many it moves (default ``ids``'s; the faults it may take before the mapping is let go).
        ``count``: counted as a gather or scatter here (else the caller counts what it did)."""
        if write and not self.takes_writes:
            return False
        if not write and (not self.enabled or (self._view is None and not self._check())):
            return False
        return self._through(ids.numel() if records is None else records, move, write, count)

    def _through(self, records: int, move: Callable[[torch.Tensor], object], write: bool, count: bool) -> bool:
        with self._lock:
            if self._view is None or (write and not self.writable):
                return False
            if self._cut_short():
                self._release()  # (a file cut short under the mapping: its system calls say how)
                return False
            self._holder = threading.get_ident()
            try:
                before = _major_faults()
                move(self._view)
                self.scatters += write and count
                self.gathers += not write and count
                if _major_faults() - before > max(8, records // 256):  # the page cache no longer holds the file
                    self._release()
            finally:
                self._holder = None
                if self._releasing or self._closing:  # (asked on this thread inside ``move``: see ``close``)
                    self._releasing = False
                    self._release()
                    self.enabled &= not self._closing
        return True

    def _cut_short(self) -> bool:
        return os.fstat(self.fd).st_size < self.offset + self.records * self.record_bytes

    def _check(self) -> bool:
        """Map the file if the time to ask has come and the page cache holds it."""
        now = time.monotonic()
        if now < self._next_check:
            return False
        self._next_check = now + RECHECK_S
        length = self.records * self.record_bytes
        cached = cached_pages(self.fd, self.offset, length)
        if cached is None:
            self.enabled = False  # the kernel cannot say: never mapped
            return False
        if cached < math.ceil(length / _PAGE) * (1 - MAX_UNCACHED):
            return False
        with self._lock:
            if self._view is None:
                self._open(length)
        return True

    def _open(self, length: int) -> None:
        self.writable = _allocated(self.fd)
        for prot in (mmap.PROT_READ | mmap.PROT_WRITE, mmap.PROT_READ)[0 if self.writable else 1 :]:
            try:
                self._map = mmap.mmap(self.fd, length, mmap.MAP_SHARED, prot, offset=self.offset)
                break
            except PermissionError:  # (a file opened for reading only: mapped for reads)
                self.writable = False
            except (OSError, ValueError, OverflowError):  # (no address space for it: the system calls as before)
                self.enabled = False
                return
        if self._map is not None:
            self._view_map()

    def _view_map(self) -> None:
        if hasattr(self._map, "madvise"):  # rows are read where ids fall: no read-ahead around a faulting page
            self._map.madvise(mmap.MADV_RANDOM)
        with warnings.catch_warnings():  # a read-only mapping is only ever read here (index_select copies out)
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.frombuffer(self._map, dtype=torch.uint8)
        self._view = flat.view(self.records, self.record_bytes)

    def release(self) -> None:
        """Go back to system-call reads until the next check, dropping the mapped pages from the process."""
        if self._holder == threading.get_ident():
            self._releasing = True  # (inside this thread's own pass, as ``close``: released once it is done)
            return
        with self._lock:
            self._release()

    def _release(self) -> None:
        self._next_check = time.monotonic() + RECHECK_S
        self._view = None
        if self._map is not None:
            self._map.close()  # (unmapped: the pages leave the process's RSS)
            self._map = None

    def close(self) -> None:
        """Unmap for good (the file is closing). Asked on the thread inside a pass (a table collected there by the
        garbage collector lets its file go), the pass unmaps on its way out: its lock is this thread's already."""
        if self._holder == threading.get_ident():
            self._closing = True
            return
        with self._lock:
            self._release()
            self.enabled = False
