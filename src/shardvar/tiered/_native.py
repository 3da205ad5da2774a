"""An optional native kernel for a backing file's record reads and writes (``_native_io.c``).

What it buys: a training step moves thousands of records, mostly one-record runs. In Python each
run costs a list entry, a ``memoryview`` and an ``os.preadv`` call, ~2.7 us a page-cached run; the
kernel walks the ids, coalesces runs, reads the page-cached ones at once (``preadv2(RWF_NOWAIT)``)
and the rest on its own threads, all without the interpreter's lock, so a run costs about its
system call, ~0.7 us (4096 page-cached reads of 264 B: 11.2 ms in Python, 2.8 ms here).

It is compiled on first use and cached (:mod:`shardvar._native`: where, and when it is not). Without
a kernel :func:`kernel` is ``None`` and ``RowFile`` takes its Python path (the same bytes and the
same errors; one debug log line says why).
"""

from __future__ import annotations

import ctypes
import errno
import os
import threading
from pathlib import Path

import numpy as np

from .. import _native

__all__ = ["Kernel", "kernel", "short_transfer"]

SOURCE = Path(__file__).with_name("_native_io.c")
_ABI = 1  # sv_abi_version() of the source this module calls
_SHORT = -1  # sv_transfer's code for a read at the end of the file (or a write of nothing)
_lock = threading.Lock()
_loaded: dict[str, Kernel | None] = {}  # "kernel": this process's answer, once


def short_transfer(write: bool, at: int) -> OSError:
    """The error of a read that met the end of the file at byte ``at`` (or a write that wrote nothing)."""
    what = f"wrote nothing at byte {at}" if write else f"the file ends at byte {at}"
    return OSError(errno.EIO, f"short {'write' if write else 'read'}: {what}")


class Kernel:
    """``sv_transfer`` of a loaded library."""

    def __init__(self, library: ctypes.CDLL) -> None:
        _native.check_version(library.sv_abi_version, _ABI)
        fn = library.sv_transfer
        c = ctypes
        fn.argtypes = (c.c_int, c.c_void_p, c.c_int64, c.c_int64, c.c_int64, c.c_void_p, c.c_int, c.c_int, c.c_int,
                       c.c_void_p)  # fmt: skip
        fn.restype = c.c_int
        self._fn = fn

    def transfer(
        self,
        fd: int,
        ids: np.ndarray,
        buffer: np.ndarray,
        record_bytes: int,
        header: int,
        write: bool,
        nowait: bool,
        queue_depth: int,
    ) -> int:
        """Move the records of ascending ``ids`` (contiguous int64) between ``buffer`` (contiguous, one record
        per id) and the file; returns how many runs had to wait for the disk. A failure is an ``OSError``."""
        info = (ctypes.c_int64 * 2)()
        code = self._fn(
            fd, ids.ctypes.data, ids.size, record_bytes, header, buffer.ctypes.data, write, nowait, queue_depth, info
        )
        if code == _SHORT:
            raise short_transfer(write, info[0])
        if code:
            raise OSError(code, os.strerror(code))
        return info[1]


def kernel() -> Kernel | None:
    """This process's native kernel (compiled and loaded on the first call), or ``None``: see the module."""
    with _lock:
        if "kernel" not in _loaded:
            _loaded["kernel"] = _load()
        return _loaded["kernel"]


def _load() -> Kernel | None:
    return _native.load(SOURCE, "native_io", _ABI, Kernel, "a backing file's record I/O")


def built() -> Path:
    """The compiled library, compiled now if this source has none in the cache folder yet."""
    return _native.build(SOURCE, "native_io", _ABI)
