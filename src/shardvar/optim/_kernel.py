"""Optional native kernels for the row-wise sparse updates (``_rowwise.c``): RowWiseAdagrad, RowWiseAdam.

What they buy: torch's ops update a batch's distinct rows in five passes over them (gather the
rows and their state, the gradient's norm, the division, scatter both back), each a kernel call
per slice of rows; :meth:`RowWise.rows` reads and writes each row and its state once. A fused sum
bag's backward goes further (:meth:`RowWise.bags`): no sort of the ids and no segment sum, each
distinct row's gradient summed in a hash table's slot and applied at once.

They are compiled on first use and cached (:mod:`shardvar._native`); without them (no compiler,
``SHARDVAR_NATIVE=0``, tensors they do not take) the torch ops run. Both compute the same rule in
float32; the kernel adds a row's squares in another order, so the two agree to float rounding, not
bit for bit (every path of one process takes the same one).
"""

from __future__ import annotations

import ctypes
import functools
import math
import threading
from collections.abc import Callable
from pathlib import Path
from typing import ClassVar

import torch

from .. import _native
from .._errors import ShardvarIndexError, ShardvarValueError
from .._pages import empty

__all__ = ["Rule", "RowWise", "adagrad_rule", "adam_rule", "rowwise"]

SOURCE = Path(__file__).with_name("_rowwise.c")
_ABI = 4  # sv_optim_abi_version() of the source this module calls
FLAGS = ("-O3",)  # -O3: the row loops vectorised
# The sums of a batch's distinct rows are made this many bytes of them at a time (one pass over the
# ids each), so their memory stays bounded whatever the batch: one pass for typical batches (32768 rows of
# 64 floats: a batch of 4096 bags of 20 Zipf ids reads ~21600 distinct rows of a 2^18-row table).
CHUNK_BYTES = 8 << 20
_lock = threading.Lock()
_loaded: dict[str, RowWise | None] = {}
c = ctypes


class Rule(c.Structure):
    """An update rule and its options as the kernel reads them (``rule_t``)."""

    _fields_: ClassVar = [("rule", c.c_int64), ("lr", c.c_float), ("eps", c.c_float), ("decay", c.c_float),
                            ("beta1_weight", c.c_float), ("beta2", c.c_float), ("one_minus_beta2", c.c_float),
                            ("sqrt_bias2", c.c_float), ("step_size", c.c_float), ("moment", c.c_void_p),
                            ("moment_stride", c.c_int64)]  # fmt: skip


def adagrad_rule(lr: float, eps: float, decay: float) -> Rule:
    """Row-wise Adagrad with these options."""
    return Rule(0, lr, eps, decay)


def adam_rule(moment: torch.Tensor, lr: float, betas: tuple[float, float], eps: float, decay: float,
              step: int) -> Rule | None:  # fmt: skip
    """Row-wise Adam at ``step`` with its first moment ``moment`` (a row per table row); None where the
    kernel cannot take ``moment``."""
    if not _rows(moment):
        return None
    b1, b2 = betas
    rule = Rule(1, lr, eps, decay, 1 - b1, b2, 1 - b2, math.sqrt(1 - b2**step), -lr / (1 - b1**step),
                moment.data_ptr(), moment.stride(0))  # fmt: skip
    rule.tensor, rule.shape = moment, tuple(moment.shape)  # kept alive with the rule; checked against the table
    return rule


class RowWise:
    """The row-wise update kernels of a loaded library."""

    def __init__(self, library: ctypes.CDLL) -> None:
        _native.check_version(library.sv_optim_abi_version, _ABI)
        fn = library.sv_rowwise_update
        fn.argtypes = (c.c_void_p, c.c_int64, c.c_int64, c.c_void_p, c.c_int64, c.c_void_p, c.c_int64,
                       c.c_void_p, c.c_int64, c.c_int64, c.POINTER(Rule))  # fmt: skip
        fn.restype = c.c_int64
        self._rows = fn
        fn = library.sv_bags_rowwise_update
        fn.argtypes = (c.c_void_p, c.c_int64, c.c_int64, c.c_void_p, c.c_int64, c.c_void_p, c.c_void_p, c.c_int,
                       c.c_int64, c.c_int64, c.c_void_p, c.c_int64, c.c_int64, c.POINTER(Rule), c.c_void_p,
                       c.c_void_p, c.c_int64, c.c_void_p, c.c_void_p, c.c_void_p, c.c_int64, c.c_void_p)  # fmt: skip
        fn.restype = None
        self._bags = fn
        self._scratch = threading.local()  # each thread's hash table and sums, kept warm from call to call

    def rows(self, rule: Rule, weight: torch.Tensor, acc: torch.Tensor, rows: torch.Tensor | None,
             grad: torch.Tensor) -> bool:  # fmt: skip
        """``rule``'s update of the distinct ``rows`` (None: every row) of ``weight`` (their row-wise state ``acc``)
        in place; False (nothing changed) where the tensors are not laid out as the kernel takes them."""
        count = weight.shape[0] if rows is None else rows.numel()
        if not (_table(rule, weight, acc) and _gradient(grad, count, weight)):
            return False
        if rows is not None and not (rows.dtype == torch.int64 and rows.dim() == 1 and rows.is_contiguous()):
            return False
        if rows is not None and not _native.on_cpu_memory(rows):
            return False
        bad = self._rows(weight.data_ptr(), weight.stride(0), weight.shape[0], acc.data_ptr(), acc.stride(0),
                         None if rows is None else rows.data_ptr(), count, grad.data_ptr(), grad.stride(0),
                         weight.shape[1], rule)  # fmt: skip
        if bad:
            raise ShardvarIndexError(f"row {int(rows[bad - 1])} is outside the table's {weight.shape[0]} rows")
        _changed(rule, weight, acc)
        return True

    def bags(self, rule: Rule, weight: torch.Tensor, acc: torch.Tensor, ids: torch.Tensor, offsets: torch.Tensor,
             grad: torch.Tensor) -> Callable[[], None] | None:  # fmt: skip
        """``rule``'s update of the rows of ``weight`` that the sum bags (``ids``, ``offsets``) read, each with the
        sum of its bags' ``grad`` rows, in one pass and no sort: a job to run on any thread; None where
        the tensors are not laid out as the kernel takes them."""
        if not (_table(rule, weight, acc) and _gradient(grad, offsets.numel(), weight) and _indices(ids, offsets)):
            return None
        if (offsets.numel() == 0 and ids.numel()) or ids.numel() >= 1 << 31:  # no bag for the ids (torch's op
            return None  # says what is wrong), or more ids than the kernel's 32-bit slots count
        return functools.partial(self._run_bags, rule, weight, acc, ids, offsets, grad)

    def _run_bags(self, rule: Rule, weight: torch.Tensor, acc: torch.Tensor, ids: torch.Tensor,
                  offsets: torch.Tensor, grad: torch.Tensor) -> None:  # fmt: skip
        n, dim = ids.numel(), weight.shape[1]
        keys, slots, id_slot, rows, sums = self._buffers(n, dim)  # this thread's
        info = (ctypes.c_int64 * 3)()
        self._bags(weight.data_ptr(), weight.stride(0), weight.shape[0], acc.data_ptr(), acc.stride(0),
                   ids.data_ptr(), offsets.data_ptr(), ids.element_size(), n, offsets.numel(), grad.data_ptr(),
                   grad.stride(0), dim, rule, keys.data_ptr(), slots.data_ptr(), keys.numel(), id_slot.data_ptr(),
                   rows.data_ptr(), sums.data_ptr(), _chunk(dim), info)  # fmt: skip
        if info[0] == 1:
            raise ShardvarIndexError(f"id {int(ids[info[1]])} is outside the table's {weight.shape[0]} rows")
        if info[0] == 2:
            raise ShardvarValueError(f"offsets must start at 0 and not decrease, within the {n} ids; bag {info[1]} "
                                     f"starts at {int(offsets[info[1]])}")  # fmt: skip
        _changed(rule, weight, acc)

    def _buffers(self, n: int, dim: int) -> tuple[torch.Tensor, ...]:
        """This thread's scratch for ``n`` ids of rows of ``dim``: (hash keys, hash slots, each id's slot,
        distinct rows, sums of a chunk of rows), grown as needed and kept."""
        capacity = 1 << max(4, (2 * n - 1).bit_length())
        sums = _chunk(dim) * dim
        held = getattr(self._scratch, "buffers", None)
        if held is None or held[0].numel() < capacity or held[2].numel() < n or held[4].numel() < sums:
            grown, ids = max(capacity, held[0].numel() if held else 0), max(n, held[2].numel() if held else 0)
            held = self._scratch.buffers = (  # huge pages: the hash table and the sums are read at random
                empty(grown, dtype=torch.int64), empty(grown, dtype=torch.int32),
                empty(ids, dtype=torch.int32), empty(ids, dtype=torch.int64),
                empty(max(sums, held[4].numel() if held else 0), dtype=torch.float32),
            )  # fmt: skip
        keys, slots, id_slot, rows, chunk = held
        return keys[:capacity], slots[:capacity], id_slot, rows, chunk[:sums]


def _changed(rule: Rule, weight: torch.Tensor, acc: torch.Tensor) -> None:
    """Count the update as an in-place change of what it wrote, as a torch op would (autograd checks it)."""
    moment = getattr(rule, "tensor", None)
    torch.autograd.graph.increment_version((weight, acc) if moment is None else (weight, acc, moment))


def _chunk(dim: int) -> int:
    """How many rows' sums of width ``dim`` are made per pass over the ids."""
    return max(1, CHUNK_BYTES // (4 * max(dim, 1)))


def _rows(x: torch.Tensor) -> bool:
    """Whether ``x`` is 2-D float32 CPU rows of unit stride that do not overlap (as an expanded tensor's do:
    torch's in-place ops refuse those)."""
    if not _native.on_cpu_memory(x) or x.dim() != 2 or x.dtype != torch.float32 or x.stride(1) != 1:
        return False
    return x.shape[0] <= 1 or x.stride(0) >= max(x.shape[1], 1)


def _table(rule: Rule, weight: torch.Tensor, acc: torch.Tensor) -> bool:
    """Whether the kernel takes ``weight``, its row-wise state ``acc`` (one float32 per row) and the rule's
    first moment (Adam's: a row per table row)."""
    if not (_rows(weight) and _native.on_cpu_memory(acc) and acc.dim() == 1 and acc.dtype == torch.float32):
        return False
    if getattr(rule, "shape", tuple(weight.shape)) != tuple(weight.shape):
        return False
    return acc.shape[0] == weight.shape[0] and (acc.shape[0] <= 1 or acc.stride(0) >= 1)


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
    """This process's row-wise update kernels (compiled and loaded on the first call), or None."""
    with _lock:
        if "kernel" not in _loaded:
            _loaded["kernel"] = _native.load(SOURCE, "rowwise", _ABI, RowWise, "a row-wise update", FLAGS)
        return _loaded["kernel"]
