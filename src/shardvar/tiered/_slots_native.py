"""Optional native kernels for the row cache's bookkeeping (``_native_slots.c``): a batch's look-up, the LRU select.

What they buy: a step resolves ~82k ids (~27k distinct, a few thousand misses) against a direct map
of millions of rows and picks its victims among ~400k slots. In torch that is a dozen ops over the
batch (a gather, a widening, masks, a scatter of the hits' step, counts) and, for the victims, a
copy of the slots' steps, two scatters into it and a radix select over ``bincount``: each op a
pass and an allocation. :meth:`Kernel.lookup` makes one pass over the ids, :meth:`Kernel.smallest`
two or three over the steps (a counting pass checks a sampled guess of the k-th smallest: 0.6 ms
at 400k slots, against 1.8 for its radix passes), allocating nothing of the cache's size.

They are compiled on first use and cached (:mod:`shardvar._native`); without them (no compiler,
``SHARDVAR_NATIVE=0``, tensors they do not take) the torch ops run, with the same results.
"""

from __future__ import annotations

import ctypes
import threading
from pathlib import Path
from typing import NamedTuple

import torch

from .. import _native

__all__ = ["Kernel", "Looked", "kernel"]

SOURCE = Path(__file__).with_name("_native_slots.c")
_ABI = 3  # sv_slots_abi_version() of the source this module calls
FLAGS = ("-O3",)
_BINS = 2 * ((1 << 16) + 2)  # the kernel's counts per pass of its select: 2 * (BINS + 2)
_lock = threading.Lock()
_loaded: dict[str, Kernel | None] = {}
c = ctypes


class Looked(NamedTuple):
    """What :meth:`Kernel.lookup` found and changed."""

    slot: torch.Tensor  # int64 per id: its slot, negative where missed
    missed: torch.Tensor  # positions of the misses (ascending)
    missed_ids: torch.Tensor  # their ids
    hit: torch.Tensor  # the distinct slots marked used (views of this thread's scratch)
    was: torch.Tensor  # their used values before

    def undo(self, used: torch.Tensor) -> None:
        """Put back the used values the look-up changed."""
        used.index_put_((self.hit,), self.was)


class Kernel:
    """``sv_lookup`` and ``sv_smallest`` of a loaded library."""

    def __init__(self, library: ctypes.CDLL) -> None:
        _native.check_version(library.sv_slots_abi_version, _ABI)
        p, i64 = c.c_void_p, c.c_int64
        fn = library.sv_lookup
        fn.argtypes = (p, c.c_int, i64, p, i64, p, p, i64, c.c_int32, p, p, p, p, p)
        fn.restype = i64
        self._lookup = fn
        fn = library.sv_smallest
        fn.argtypes = (p, c.c_int, i64, p, i64, i64, i64, i64, p, p)
        fn.restype = i64
        self._smallest = fn
        self._scratch = threading.local()  # each thread's, kept from call to call

    def lookup(self, table: torch.Tensor, ids: torch.Tensor, used: torch.Tensor, step: int) -> Looked | None:
        """The slot of each of ``ids`` in the direct map ``table`` (``DirectSlots.table``), each distinct slot's
        ``used`` set to ``step`` (``Looked.undo`` puts them back); None (nothing changed) where the tensors are not
        as the kernel takes them, or an id or slot is out of range (the torch ops say which)."""
        if not (_vector(table, torch.int32, torch.int64) and _vector(ids, torch.int64) and _vector(used, torch.int32)):
            return None
        if not torch.iinfo(torch.int32).min <= step <= torch.iinfo(torch.int32).max:
            return None
        n = ids.numel()
        slot = torch.empty(n, dtype=torch.int64)
        missed, missed_ids, hit, was = self._buffers(n, min(n, used.numel()))
        info = (c.c_int64 * 1)()
        misses = self._lookup(table.data_ptr(), table.dtype == torch.int64, table.numel(), ids.data_ptr(), n,
                              slot.data_ptr(), used.data_ptr(), used.numel(), step, missed.data_ptr(),
                              missed_ids.data_ptr(), hit.data_ptr(), was.data_ptr(), info)  # fmt: skip
        if misses < 0:
            return None
        hits = info[0]
        return Looked(slot, missed[:misses].clone(), missed_ids[:misses].clone(), hit[:hits], was[:hits])

    def smallest(
        self, values: torch.Tensor, k: int, above: int, skip: torch.Tensor | None = None, masked: int = 0
    ) -> tuple[int, torch.Tensor] | None:
        """(how many of ``values`` are below ``above``, the ascending positions of the ``k`` smallest of them, ties
        to the lower position; an empty tensor where fewer than ``k`` are), where the value at each position of
        ``skip`` (int32, ascending) counts as ``masked``; None where the kernel does not take the tensors."""
        if not _vector(values, torch.int32, torch.int64) or (skip is not None and not _vector(skip, torch.int32)):
            return None
        if not all(-(1 << 62) <= x <= 1 << 62 for x in (k, above, masked)):
            return None
        out = torch.empty(max(k, 0), dtype=torch.int64)
        hist = getattr(self._scratch, "hist", None)
        if hist is None:
            hist = self._scratch.hist = torch.empty(_BINS, dtype=torch.int64)
        nskip = 0 if skip is None else skip.numel()
        below = self._smallest(values.data_ptr(), values.dtype == torch.int64, values.numel(),
                               None if skip is None else skip.data_ptr(), nskip, masked, above, k, out.data_ptr(),
                               hist.data_ptr())  # fmt: skip
        if below < 0:
            return None
        return below, out if below >= k else out[:0]

    def _buffers(self, n: int, hits: int) -> tuple[torch.Tensor, ...]:
        """This thread's scratch for ``n`` ids: (miss positions, miss ids, hit slots, their old steps), grown as
        needed and kept."""
        held = getattr(self._scratch, "lookup", None)
        if held is None or held[0].numel() < n or held[2].numel() < hits:
            n, hits = max(n, held[0].numel() if held else 0), max(hits, held[2].numel() if held else 0)
            wide = torch.int64
            held = self._scratch.lookup = (
                torch.empty(n, dtype=wide), torch.empty(n, dtype=wide), torch.empty(hits, dtype=wide),
                torch.empty(hits, dtype=torch.int32),
            )  # fmt: skip
        return held


def _vector(x: torch.Tensor, *dtypes: torch.dtype) -> bool:
    """Whether the kernel takes ``x`` by its pointer: a contiguous 1-D CPU tensor of one of ``dtypes``."""
    return x.dtype in dtypes and x.dim() == 1 and x.is_contiguous() and _native.on_cpu_memory(x)


def kernel() -> Kernel | None:
    """This process's native kernels (compiled and loaded on the first call), or None: see the module."""
    with _lock:
        if "kernel" not in _loaded:
            _loaded["kernel"] = _native.load(SOURCE, "native_slots", _ABI, Kernel, "the row cache's bookkeeping", FLAGS)
        return _loaded["kernel"]


def built() -> Path:
    """The compiled library, compiled now if this source has none in the cache folder yet."""
    return _native.build(SOURCE, "native_slots", _ABI, FLAGS)
