"""Optional native kernels for the row-wise sparse updates (``_rowwise.c``).

What they buy: torch's ops update a batch's distinct rows in five passes over them (gather the
rows and their state, the gradient's norm, the division, scatter both back), each a kernel call
per slice of rows; :meth:`RowWise.adagrad` reads and writes each row and its state once. A fused
sum bag's backward goes further (:meth:`RowWise.bags_adagrad`): no sort of the ids and no segment
sum, each distinct row's gradient summed in a hash table's slot and applied at once.

They are compiled on first use and cached (:mod:`shardvar._native`); without them (no compiler,
``SHARDVAR_NATIVE=0``, tensors they do not take) the torch ops run. Both compute the same rule in
float32; the kernel adds a row's squares in another order, so the two agree to float rounding, not
bit for bit (every path of one process takes the same one).
"""

from __future__ import annotations

import ctypes
import functools
import threading
from collections.abc import Callable
from pathlib import Path

import torch

from .. import _native
from .._errors import ShardvarIndexError, ShardvarValueError

__all__ = ["RowWise", "rowwise"]

SOURCE = Path(__file__).with_name("_rowwise.c")
_ABI = 2  # sv_optim_abi_version() of the source this module calls
FLAGS = ("-O3",)  # -O3: the row loops vectorised
# The sums of a batch's distinct rows are made this many bytes of them at a time (one pass over the
# ids each), so their memory stays bounded whatever the batch: one pass for typical batches.
CHUNK_BYTES = 4 << 20
_lock = threading.Lock()
_loaded: dict[str, RowWise | None] = {}


class RowWise:
    """The row-wise update kernels of a loaded library."""

    def __init__(self, library: ctypes.CDLL) -> None:
        if library.sv_optim_abi_version() != _ABI:
            raise OSError(f"the native library is version {library.sv_optim_abi_version()}, not {_ABI}")
        fn = library.sv_rowwise_adagrad
        c = ctypes
        fn.argtypes = (c.c_void_p, c.c_int64, c.c_int64, c.c_void_p, c.c_int64, c.c_void_p, c.c_int64,
                       c.c_void_p, c.c_int64, c.c_int64, c.c_float, c.c_float, c.c_float)  # fmt: skip
        fn.restype = c.c_int64
        self._adagrad = fn
        fn = library.sv_bags_rowwise_adagrad
        fn.argtypes = (c.c_void_p, c.c_int64, c.c_int64, c.c_void_p, c.c_int64, c.c_void_p, c.c_void_p, c.c_int,
                       c.c_int64, c.c_int64, c.c_void_p, c.c_int64, c.c_int64, c.c_float, c.c_float, c.c_float,
                       c.c_void_p, c.c_void_p, c.c_int64, c.c_void_p, c.c_void_p, c.c_void_p, c.c_int64,
                       c.c_void_p)  # fmt: skip
        fn.restype = None
        self._bags_adagrad = fn
        self._scratch = threading.local()  # each thread's hash table and sums, kept warm from call to call

    def adagrad(self, weight: torch.Tensor, acc: torch.Tensor, rows: torch.Tensor, grad: torch.Tensor,
                lr: float, eps: float, decay: float) -> bool:  # fmt: skip
        """Row-wise Adagrad of the distinct ``rows`` of ``weight`` (and their accumulators ``acc``) in place;
        False (nothing changed) where the tensors are not laid out as the kernel takes them."""
        if not (_table(weight, acc) and _gradient(grad, rows.numel(), weight)):
            return False
        if rows.dtype != torch.int64 or rows.dim() != 1 or not rows.is_contiguous() or not _native.on_cpu_memory(rows):
            return False
        bad = self._adagrad(weight.data_ptr(), weight.stride(0), weight.shape[0], acc.data_ptr(), acc.stride(0),
                            rows.data_ptr(), rows.numel(), grad.data_ptr(), grad.stride(0), weight.shape[1],
                            lr, eps, decay)  # fmt: skip
        if bad:
            raise ShardvarIndexError(f"row {int(rows[bad - 1])} is outside the table's {weight.shape[0]} rows")
        torch.autograd.graph.increment_version((weight, acc))  # as an in-place torch op would
        return True


    def bags_adagrad(self, weight: torch.Tensor, acc: torch.Tensor, ids: torch.Tensor, offsets: torch.Tensor,
                     grad: torch.Tensor, lr: float, eps: float, decay: float) -> Callable[[], None] | None:  # fmt: skip
        """The row-wise Adagrad update of the rows of ``weight`` that the sum bags (``ids``, ``offsets``) read, each
        with the sum of its bags' ``grad`` rows, in one pass and no sort: a job to run on any thread; None
        where the tensors are not laid out as the kernel takes them."""
        if not (_table(weight, acc) and _gradient(grad, offsets.numel(), weight) and _indices(ids, offsets)):
            return None
        if (offsets.numel() == 0 and ids.numel()) or ids.numel() >= 1 << 31:  # no bag for the ids (torch's op
            return None  # says what is wrong), or more ids than the kernel's 32-bit slots count

        return functools.partial(self._bags, weight, acc, ids, offsets, grad, (lr, eps, decay))

    def _bags(self, weight: torch.Tensor, acc: torch.Tensor, ids: torch.Tensor, offsets: torch.Tensor,
              grad: torch.Tensor, options: tuple[float, float, float]) -> None:  # fmt: skip
        n, dim = ids.numel(), weight.shape[1]
        keys, slots, id_slot, rows, sums = self._buffers(n, dim)  # this thread's
        info = (ctypes.c_int64 * 3)()
        self._bags_adagrad(weight.data_ptr(), weight.stride(0), weight.shape[0], acc.data_ptr(), acc.stride(0),
                           ids.data_ptr(), offsets.data_ptr(), ids.element_size(), n, offsets.numel(), grad.data_ptr(),
                           grad.stride(0), dim, *options, keys.data_ptr(), slots.data_ptr(), keys.numel(),
                           id_slot.data_ptr(), rows.data_ptr(), sums.data_ptr(), _chunk(dim), info)  # fmt: skip
        if info[0] == 1:
            raise ShardvarIndexError(f"id {int(ids[info[1]])} is outside the table's {weight.shape[0]} rows")
        if info[0] == 2:
            raise ShardvarValueError(f"offsets must start at 0 and not decrease, within the {n} ids; bag {info[1]} "
                                     f"starts at {int(offsets[info[1]])}")  # fmt: skip
        torch.autograd.graph.increment_version((weight, acc))

    def _buffers(self, n: int, dim: int) -> tuple[torch.Tensor, ...]:
        """This thread's scratch for ``n`` ids of rows of ``dim``: (hash keys, hash slots, each id's slot,
        distinct rows, sums of a chunk of rows), grown as needed and kept."""
        capacity = 1 << max(4, (2 * n - 1).bit_length())
        chunk = _chunk(dim)
        held = getattr(self._scratch, "buffers", None)
        if held is None or held[0].numel() < capacity or held[2].numel() < n or held[4].numel() < chunk * dim:
            grown = max(capacity, held[0].numel() if held else 0)
            ids = max(n, held[2].numel() if held else 0)
            held = self._scratch.buffers = (
                torch.empty(grown, dtype=torch.int64), torch.empty(grown, dtype=torch.int32),
                torch.empty(ids, dtype=torch.int32), torch.empty(ids, dtype=torch.int64),
                torch.empty(max(chunk * dim, held[4].numel() if held else 0), dtype=torch.float32),
            )  # fmt: skip
        keys, slots, id_slot, rows, sums = held
        return keys[:capacity], slots[:capacity], id_slot, rows, sums[: chunk * dim]


def _chunk(dim: int) -> int:
    """How many rows' sums of width ``dim`` are made per pass over the ids."""
    return max(1, CHUNK_BYTES // (4 * max(dim, 1)))


def _table(weight: torch.Tensor, acc: torch.Tensor) -> bool:
    """Whether ``weight`` is 2-D float32 CPU rows of unit stride and ``acc`` one float32 per row."""
    if not _native.on_cpu_memory(weight, acc) or weight.dim() != 2 or weight.dtype != torch.float32:
        return False
    if weight.stride(1) != 1:
        return False
    return acc.dim() == 1 and acc.dtype == torch.float32 and acc.shape[0] == weight.shape[0]


def _gradient(grad: torch.Tensor, count: int, weight: torch.Tensor) -> bool:
    """Whether ``grad`` is ``count`` float32 CPU rows of ``weight``'s width, of unit stride."""
    if not _native.on_cpu_memory(grad) or grad.dim() != 2 or grad.dtype != torch.float32:
        return False
    return tuple(grad.shape) == (count, weight.shape[1]) and grad.stride(1) == 1


def _indices(ids: torch.Tensor, offsets: torch.Tensor) -> bool:
    """Whether ``ids`` and ``offsets`` are 1-D contiguous CPU integers of one dtype (32 or 64 bits)."""
    if ids.dim() != 1 or offsets.dim() != 1 or ids.dtype != offsets.dtype:
        return False
    if ids.dtype not in (torch.int32, torch.int64) or not _native.on_cpu_memory(ids, offsets):
        return False
    return ids.is_contiguous() and offsets.is_contiguous()


def rowwise() -> RowWise | None:
    """This process's row-wise update kernel (compiled and loaded on the first call), or None."""
    with _lock:
        if "kernel" not in _loaded:
            _loaded["kernel"] = _native.load(SOURCE, "rowwise", _ABI, RowWise, "a row-wise update", FLAGS)
        return _loaded["kernel"]
