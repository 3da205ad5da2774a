"""A batch's misses brought in by one native pass while the page cache holds the file (``sv_swap_rows``).

Why: while the file is mapped for writes, ``RowCache._evict`` and ``_bring`` are a dozen torch ops over the
victims and the misses (the victims' flags, keys and homes gathered, the map's entries scattered, the new
slots' keys, homes, steps and flags set), each a pass with its own allocation and dispatch: ~2 ms of a step
at 6k misses on this machine, besides the rows' copies, on the thread that resolves the next batch while one
computes (``_ahead``), where it competes with the step for two cores. ``sv_swap_rows`` does all of it, the
copies included, in one call.

When: the file mapped for writes (the rows go back to their own places: no log), the direct map (a place per
row), no records read ahead (``_staged``: none while the file is mapped) and the kernel loaded, with the
tensors as it takes them. Anything else, or an index the kernel refuses (it checks before it changes
anything), takes ``RowCache``'s own steps, with the same slots, records and statistics: tests run both.
"""

from __future__ import annotations

from typing import Any

import torch

from .._native import on_cpu_memory
from . import _native
from ._slots import DirectSlots

__all__ = ["swap_in"]


def swap_in(cache: Any, chosen: torch.Tensor | None, ids: torch.Tensor) -> torch.Tensor | None:
    """The slots (int64) of ``ids`` (distinct, ascending, none held) brought into ``cache`` (a ``RowCache``) with
    ``chosen`` (ascending slots, or None) given up for them, written back where changed: in one native pass (see the
    module); None, nothing changed, where that does not apply."""
    kernel, file = _native.kernel(), cache.file
    if kernel is None or cache._staged or not isinstance(cache.index, DirectSlots) or not file.mapped.takes_writes:
        return None
    victims = chosen if chosen is not None else torch.empty(0, dtype=torch.int64)
    slots = (cache.index.table, cache.key, cache.home, cache.used, cache.dirty, cache.count)
    fields = [(cache.values, 0), (cache.state, cache.layout.state_offset)]
    if not _takes(slots, victims, cache.free, ids, fields):
        return None
    left = cache.free.numel() + victims.numel() - ids.numel()
    out = (torch.empty(ids.numel(), dtype=torch.int64), torch.empty(max(left, 0), dtype=torch.int32))
    written: list[int | None] = [None]

    def swap(view: torch.Tensor) -> None:
        written[0] = kernel.swap_rows(slots, victims, cache.free, ids, cache.step, view, fields, out)

    cache.behind.wait()  # (a write still in flight goes first, as ``_write_back`` has it)
    moved = ids.numel() + victims.numel()  # (at most: the faults it may take before the mapping is let go)
    if left < 0 or not file.mapped.move(ids, swap, True, records=moved, count=False) or written[0] is None:
        return None
    record = cache.layout.record_bytes
    file.bytes_written += written[0] * record
    file.bytes_read += ids.numel() * record
    file.mapped.gathers += bool(ids.numel())  # (as the cache's own steps count: a read, and a write if any)
    file.mapped.scatters += bool(written[0])
    cache.free = out[1]
    cache.stats.evictions += victims.numel()
    cache.stats.written_back += written[0]
    return out[0]


def _takes(slots: tuple[torch.Tensor, ...], victims: torch.Tensor, free: torch.Tensor, ids: torch.Tensor,
           fields: list[tuple[torch.Tensor, int]]) -> bool:  # fmt: skip
    """Whether the kernel takes these tensors by their pointers (plain contiguous CPU tensors of its dtypes)."""
    table, key, home, used, dirty, count = slots
    wide = (torch.int32, torch.int64)
    ok = table.dtype in wide and key.dtype in wide and home.dtype == key.dtype and used.dtype == torch.int32
    ok = ok and dirty.dtype == torch.bool and count.dtype == torch.int32 and free.dtype == torch.int32
    ok = ok and victims.dtype == torch.int64 and ids.dtype == torch.int64
    vectors = (table, key, home, used, dirty, count, victims, free, ids)
    ok = ok and all(t.dim() == 1 and t.is_contiguous() for t in vectors)
    arrays = [t for t, _ in fields]
    rows = all(t.dim() == 2 and t.stride(1) == 1 and t.shape[0] == used.numel() and not t.requires_grad for t in arrays)
    return ok and rows and on_cpu_memory(*vectors, *arrays)
