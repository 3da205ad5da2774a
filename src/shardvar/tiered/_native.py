"""An optional native kernel for a backing file's record reads and writes (``_native_io.c``).

What it buys: a training step moves thousands of records, mostly one-record runs. In Python each
run costs a list entry, a ``memoryview`` and an ``os.preadv`` call, ~2.7 us a page-cached run; the
kernel walks the ids, coalesces runs, reads the page-cached ones at once (``preadv2(RWF_NOWAIT)``)
and the rest on its own threads, all without the interpreter's lock, so a run costs about its
system call, ~0.7 us (4096 page-cached reads of 264 B: 11.2 ms in Python, 2.8 ms here).

It also copies rows between a cache's slots and the records of a mapped file or staging area by index
(``scatter_rows``): a ``memcpy`` a row, where ``index_copy_`` moves an element at a time (7k rows of
256 B into a 400k-row table: 0.26 ms, against 0.82 ms), and sets flags at a batch's indices (``fill_at``).

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
import torch

from .. import _native

__all__ = ["Kernel", "copy_rows", "fill_at", "kernel", "move_fields", "scatter_rows", "short_transfer"]

SOURCE = Path(__file__).with_name("_native_io.c")
_ABI = 5  # sv_abi_version() of the source this module calls
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
        copy = library.sv_copy_rows
        copy.argtypes = (c.c_void_p, c.c_int64, c.c_int64, c.c_void_p) * 2 + (c.c_int64, c.c_int64)
        copy.restype = c.c_int64
        self._copy = copy
        fill = library.sv_fill_at
        fill.argtypes = (c.c_void_p, c.c_int64, c.c_int64, c.c_void_p, c.c_int64, c.c_void_p)
        fill.restype = c.c_int64
        self._fill = fill
        move = library.sv_move_fields
        move.argtypes = (c.c_void_p, c.c_int64, c.c_int64, c.c_void_p, c.c_int64, c.c_void_p, c.c_int64, c.c_int64,
                         c.c_void_p, c.c_void_p, c.c_void_p, c.c_void_p, c.c_int)  # fmt: skip
        move.restype = c.c_int64
        self._move = move
        swap = library.sv_swap_rows
        p, i64 = c.c_void_p, c.c_int64
        swap.argtypes = (p, c.c_int, i64, p, p, c.c_int, p, p, p, i64, p, i64, p, i64, p, i64, c.c_int32, p, i64, i64,
                         i64, p, p, p, p, p, p)  # fmt: skip
        swap.restype = i64
        self._swap = swap

    def move_fields(self, records: torch.Tensor, places: torch.Tensor, slots: torch.Tensor,
                    fields: list[tuple[torch.Tensor, int]], write: bool) -> None:  # fmt: skip
        """See ``move_fields`` (the tensors qualified)."""
        slots_n = fields[0][0].shape[0]
        bad = self._move(records.data_ptr(), records.stride(0), records.shape[0], places.data_ptr(), places.numel(),
                         slots.data_ptr(), slots_n, *_field_arrays(fields), int(write))  # fmt: skip
        if bad:
            i = bad - 1
            if not 0 <= int(places[i]) < records.shape[0]:
                raise IndexError(f"record {int(places[i])} is out of bounds for {records.shape[0]} records")
            raise IndexError(f"index {int(slots[i])} is out of bounds for dimension 0 with size {slots_n}")

    def swap_rows(self, slots: Slots, victims: torch.Tensor, free: torch.Tensor, ids: torch.Tensor, step: int,
                  records: torch.Tensor, fields: Fields, out: tuple[torch.Tensor, ...]) -> int | None:  # fmt: skip
        """``sv_swap_rows`` (see ``_native_io.c``) over a cache's ``slots`` (map, key, home, used, dirty, count) and
        ``records`` (a mapping of its file), ``out``: (each id's slot, the slots left free). The rows written back, or
        None where an index is bad (nothing changed: the caller's own path says why)."""
        table, key, home, used, dirty, count = slots
        done = self._swap(table.data_ptr(), table.dtype == torch.int64, table.numel(), key.data_ptr(), home.data_ptr(),
                          key.dtype == torch.int64, used.data_ptr(), dirty.data_ptr(),
                          count.data_ptr() if count.numel() else None, used.numel(), victims.data_ptr(),
                          victims.numel(), free.data_ptr(), free.numel(), ids.data_ptr(), ids.numel(), step,
                          records.data_ptr(), records.stride(0), records.shape[0], *_field_arrays(fields),
                          out[0].data_ptr(), out[1].data_ptr())  # fmt: skip
        return None if done < 0 else done

    def fill_at(self, dst: torch.Tensor, index: torch.Tensor, value: float | int | bool) -> None:
        """``dst[index] = value`` (see ``fill_at``; the tensors qualified)."""
        one = torch.tensor(value, dtype=dst.dtype)  # (the value as the element's bytes)
        bad = self._fill(
            dst.data_ptr(), dst.element_size(), dst.numel(), index.data_ptr(), index.numel(), one.data_ptr()
        )
        if bad:
            raise IndexError(f"index {int(index[bad - 1])} is out of bounds for dimension 0 with size {dst.numel()}")

    def copy_rows(self, dst: torch.Tensor, index: torch.Tensor, src: torch.Tensor, source: torch.Tensor | None) -> None:
        """``dst[index[i]] = src[source[i]]`` (``source`` None: ``src[i]``; the tensors qualified: ``copy_rows``)."""
        size = dst.element_size()
        to = (dst.data_ptr(), dst.stride(0) * size, dst.shape[0], index.data_ptr())
        at = None if source is None else source.data_ptr()
        bad = self._copy(*to, src.data_ptr(), src.stride(0) * size, src.shape[0], at, len(index), dst.shape[1] * size)
        if bad:
            i = bad - 1
            if not 0 <= int(index[i]) < dst.shape[0]:
                raise IndexError(f"index {int(index[i])} is out of bounds for dimension 0 with size {dst.shape[0]}")
            raise IndexError(f"index {int(source[i])} is out of bounds for dimension 0 with size {src.shape[0]}")

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


def scatter_rows(dst: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.index_copy_(0, index, src)`` for 2-D ``dst`` and ``src`` of one dtype and width (``index`` of any integer
    dtype): by the kernel where it can take them (plain CPU tensors, rows of unit stride, an int64 ``index``, no
    autograd), else by torch."""
    copy_rows(dst, index, src, None)


def copy_rows(dst: torch.Tensor, index: torch.Tensor, src: torch.Tensor, source: torch.Tensor | None) -> None:
    """``dst[index] = src[source]`` (``source`` None: ``src``) for 2-D ``dst`` and ``src`` of one dtype and width,
    ``index`` and ``source`` of any integer dtype, distinct ``index``: by the kernel where it can take them (as
    ``scatter_rows``), else by torch. Rows of a mapped file and a cache's slots, with no copy in between."""
    n = index.numel()
    fast = kernel() if _qualifies(dst, index, src, source, n) else None
    if fast is not None:
        fast.copy_rows(dst, index, src, source)
    elif source is None:
        dst.index_copy_(0, index.to(torch.int64), src)
    else:
        dst.index_copy_(0, index.to(torch.int64), src.index_select(0, source.to(torch.int64)))


def _qualifies(dst: torch.Tensor, index: torch.Tensor, src: torch.Tensor, source: torch.Tensor | None, n: int) -> bool:
    if not _native.on_cpu_memory(dst, index, src) or dst.requires_grad or src.requires_grad:
        return False
    if dst.dim() != 2 or src.dim() != 2 or dst.dtype != src.dtype or dst.shape[1] != src.shape[1]:
        return False
    if any(i.dim() != 1 or i.dtype != torch.int64 or not i.is_contiguous() for i in (index, source) if i is not None):
        return False
    if (source is None and src.shape[0] != n) or (source is not None and source.numel() != n):
        return False
    return dst.stride(1) == 1 and src.stride(1) == 1 and dst.shape[1] > 0


def fill_at(dst: torch.Tensor, index: torch.Tensor, value: float | int | bool) -> None:
    """``dst.index_fill_(0, index, value)`` for a 1-D ``dst`` (``index`` of any integer dtype): by the kernel where it
    can take them (plain contiguous CPU tensors, an int64 ``index``, no autograd), else by torch."""
    plain = _native.on_cpu_memory(dst, index) and not dst.requires_grad and dst.dim() == 1 and dst.is_contiguous()
    fast = kernel() if plain and index.dim() == 1 and index.dtype == torch.int64 and index.is_contiguous() else None
    if fast is None:
        dst.index_fill_(0, index.to(torch.int64), value)
    else:
        fast.fill_at(dst, index, value)


Fields = list[tuple[torch.Tensor, int]]
Slots = tuple[torch.Tensor, ...]  # a row cache's map, key, home, used, dirty and count (``swap_rows``)


def _field_arrays(fields: Fields) -> tuple:
    """The kernels' view of ``fields`` (``(array, byte offset in a record)``): their count, then per field the array's
    base pointer, row stride, offset in a record and row width in bytes, as C arrays."""
    c, k = ctypes, len(fields)
    return (
        k,
        (c.c_void_p * k)(*(t.data_ptr() for t, _ in fields)),
        (c.c_int64 * k)(*(t.stride(0) * t.element_size() for t, _ in fields)),
        (c.c_int64 * k)(*(at for _, at in fields)),
        (c.c_int64 * k)(*(t.shape[1] * t.element_size() for t, _ in fields)),
    )


def move_fields(
    records: torch.Tensor, places: torch.Tensor, slots: torch.Tensor, fields: Fields, *, write: bool
) -> None:
    """Between ``records`` (``[places, record_bytes]`` uint8, e.g. a mapped file) and the rows of ``fields``'s arrays
    (``(array, byte offset in a record)``; 2-D, one row per slot): for each ``i``, row ``slots[i]`` of each array
    from the bytes at its offset in record ``places[i]``, or into them (``write``; distinct ``places``). One pass
    over the records, a ``memcpy`` a field, by the kernel where it can take them; else a ``copy_rows`` a field."""
    arrays = [t for t, _ in fields]
    fast = kernel() if _moves(records, places, slots, arrays) else None
    if fast is not None:
        fast.move_fields(records, places, slots, fields, write)
        return
    for array, at in fields:
        size = array.shape[1] * array.element_size()
        part = records[:, at : at + size].view(array.dtype)
        copy_rows(part, places, array, slots) if write else copy_rows(array, slots, part, places)


def _moves(records: torch.Tensor, places: torch.Tensor, slots: torch.Tensor, arrays: list[torch.Tensor]) -> bool:
    if not arrays or not _native.on_cpu_memory(records, places, slots, *arrays) or records.dtype != torch.uint8:
        return False
    if any(t.requires_grad or t.dim() != 2 or t.stride(1) != 1 or t.shape[0] != arrays[0].shape[0] for t in arrays):
        return False
    ok = all(i.dim() == 1 and i.dtype == torch.int64 and i.is_contiguous() for i in (places, slots))
    return ok and places.numel() == slots.numel() and records.dim() == 2 and records.stride(1) == 1
