"""An optional native stable sort of ids in a known range (``_sort.c``), for :func:`sort_stable`.

What it buys: a fused training step sorts each table's ids to group them by row. torch's stable
sort of 32-bit keys is a radix sort over all 32 bits (81920 ids of a 2^18-row table: ~1.3 ms);
this one counts keys once where the range is not much wider than their count, else sorts only
the bits the range needs, in passes of at most 11 bits. Sorts of more than :data:`MAX_KEYS` ids
take torch's. It is compiled on first use and cached (:mod:`shardvar._native`); without it (no
compiler, ``SHARDVAR_NATIVE=0``) torch's sort runs, with the same result: a stable sort has one
answer.
"""

from __future__ import annotations

import ctypes
import threading
from pathlib import Path

import torch

from .. import _native
from .._errors import ShardvarIndexError

__all__ = ["Sorter", "sorter"]

SOURCE = Path(__file__).with_name("_sort.c")
_ABI = 1  # sv_sort_abi_version() of the source this module calls
# Larger sorts take torch's, whose radix sort runs on the intra-op threads (2^18 ids of a 2^20 range:
# 5.1 ms here on one thread, 4.3 ms torch's on two; 65536 ids: 0.9 ms here, 1.6 ms torch's). The
# scratch a thread keeps (32 bytes an id) stays at most 4 MiB.
MAX_KEYS = 1 << 17
_lock = threading.Lock()
_loaded: dict[str, Sorter | None] = {}


class Sorter:
    """``sv_sort_stable`` of a loaded library."""

    def __init__(self, library: ctypes.CDLL) -> None:
        _native.check_version(library.sv_sort_abi_version, _ABI)
        fn = library.sv_sort_stable
        c = ctypes
        fn.argtypes = (c.c_void_p, c.c_int, c.c_int64, c.c_int64, c.c_void_p, c.c_int, c.c_void_p, c.c_void_p)
        fn.restype = c.c_int64
        self._sort = fn
        self._scratch = threading.local()  # each thread's passes' memory, kept warm from call to call

    def takes(self, keys: torch.Tensor) -> bool:
        """Whether the kernel sorts ``keys``: 1-D contiguous 32- or 64-bit integers on the CPU."""
        if not _native.on_cpu_memory(keys) or keys.dim() != 1 or keys.dtype not in (torch.int32, torch.int64):
            return False
        return keys.is_contiguous() and keys.numel() <= MAX_KEYS

    def sort(self, keys: torch.Tensor, bound: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(the keys ascending as ``dtype``, each one's input position), equal keys in input order."""
        n = keys.numel()
        out = torch.empty(n, dtype=dtype)
        order = torch.empty(n, dtype=torch.int64)
        scratch = getattr(self._scratch, "tensor", None)
        if scratch is None or scratch.numel() < 4 * n:
            scratch = self._scratch.tensor = torch.empty(4 * max(n, 1 << 14), dtype=torch.int64)
        code = self._sort(keys.data_ptr(), keys.element_size(), n, bound, out.data_ptr(), out.element_size(),
                          order.data_ptr(), scratch.data_ptr())  # fmt: skip
        if code:
            raise ShardvarIndexError(f"id {int(keys[code - 1])} is outside [0, {bound})")
        return out, order


def sorter() -> Sorter | None:
    """This process's sort kernel (compiled and loaded on the first call), or None."""
    with _lock:
        if "kernel" not in _loaded:
            _loaded["kernel"] = _native.load(SOURCE, "sort", _ABI, Sorter, "a stable sort of ids", ("-O3",))
        return _loaded["kernel"]
