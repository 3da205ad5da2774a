"""Where shard memory lives: slabs over consecutive shards, moving shards into one, and overlaps.

Functions over tensors' storage metadata (pointers, offsets, strides); the store decides when to
call them. This module (with :mod:`._relayout`, which moves rows in place) is the only one that
allocates slabs and re-points shards into them (``Tensor.set_``): which rows go where is the
store's :class:`~shardvar.variables._plan.SlabPlan`, what holds them is decided here.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping, Sequence

import torch

from .._errors import ShardvarValueError
from .._pages import empty
from ..layout import Layout, intersect_progressions, mod_sizes

__all__ = [
    "Slab",
    "as_slab",
    "adopt",
    "allocate_shards",
    "check_disjoint",
    "empty_shards",
    "lay_out",
    "place",
    "shards_over",
    "storage_ptr",
    "where",
]

_PLAIN = (torch.Tensor, torch.nn.Parameter)


def where(t: torch.Tensor) -> object:
    if type(t) in _PLAIN:
        try:
            return t.data_ptr()
        except RuntimeError:  # a tensor without storage (a torch.func wrapper)
            return id(t)
    return storage_ptr(t), id(t)


def _use_count(t: torch.Tensor) -> int:
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


@functools.cache
def _base_use() -> int:
    # The count of a tensor that nothing else shares memory with. Measured on first use, not at
    # import: importing shardvar allocates nothing, so a program can still set torch's huge-page
    # switch (read at torch's first allocation) after it.
    return _use_count(torch.empty(1))


def storage_ptr(t: torch.Tensor) -> int | None:
    """The address of the tensor's storage, or None for tensors without one (torch.func wrappers, fakes)."""
    try:
        return t.untyped_storage().data_ptr()
    except (NotImplementedError, RuntimeError):
        return None


Slab = tuple[torch.Tensor, tuple[int, ...], tuple[int, ...]]  # [rows, width], each member's first row and step


def _set(first: torch.Tensor, offset: int, rows: int, width: int) -> torch.Tensor:
    slab = torch.empty(0, dtype=first.dtype, device=first.device)
    return slab.set_(first.untyped_storage(), offset, (rows, width), (width, 1))


def _plain_rows(t: torch.Tensor, step: int) -> bool:
    """Whether ``t`` is whole rows of a row-major buffer, ``step`` rows apart."""
    width = math.prod(t.shape[1:])
    inner = torch.empty(t.shape[1:], device="meta").stride() if t.dim() > 1 else ()
    return tuple(t.stride()[1:]) == tuple(inner) and (t.shape[0] <= 1 or t.stride()[0] == step * width)


def as_slab(shards: list[torch.Tensor]) -> Slab | None:
    """A ``[rows, width]`` tensor over the shards' memory, when they tile one allocation.

    The shards, in order, lie in runs from the first one's memory on: one shard whose rows follow
    each other (its rows ``start + i``), or ``m`` shards of mod sizes laid row by row (a mod table
    of ``m`` shards in logical order: shard ``j`` at rows ``start + j + m * i``).
    """
    first = shards[0]
    if first.dim() == 0 or first.layout != torch.strided or first.device.type == "meta" or storage_ptr(first) is None:
        return None
    ptr, base = first.untyped_storage().data_ptr(), first.storage_offset()
    width, rows = math.prod(first.shape[1:]), sum(s.shape[0] for s in shards)
    if not all(s.dtype == first.dtype and s.untyped_storage().data_ptr() == ptr for s in shards):
        return None
    offset, starts = base, []
    for s in shards:  # every shard's rows following each other, back to back: the common case, cheap
        if not s.is_contiguous() or s.storage_offset() != offset:
            break
        starts.append((offset - base) // max(width, 1))
        offset += math.prod(s.shape)
    else:
        return _set(first, base, rows, width), tuple(starts), (1,) * len(shards)
    offset, k, starts, steps = base, 0, [], []
    while k < len(shards):
        s = shards[k]
        run = _interleaved(shards, k, offset, width) if s.shape[0] > 1 and not s.is_contiguous() else 1
        if not run or (run == 1 and (not s.is_contiguous() or s.storage_offset() != offset)):
            return None
        row = (offset - base) // max(width, 1)
        starts += [row + j for j in range(run)]
        steps += [run] * run
        offset += sum(math.prod(x.shape) for x in shards[k : k + run])
        k += run
    return _set(first, base, rows, width), tuple(starts), tuple(steps)


def _interleaved(shards: list[torch.Tensor], k: int, offset: int, width: int) -> int:
    """How many shards from ``k`` on lie row by row from element ``offset`` (a mod table's rows in
    logical order): their count ``m`` (the first one's row stride over the width), or 0."""
    stride = shards[k].stride()[0]
    if not width or stride % width or stride // width < 2 or k + stride // width > len(shards):
        return 0
    m = stride // width
    run = shards[k : k + m]
    if tuple(x.shape[0] for x in run) != mod_sizes(sum(x.shape[0] for x in run), m):
        return 0  # rows of other sizes would not tile the run's rows
    tiles = all(x.storage_offset() == offset + j * width and _plain_rows(x, m) for j, x in enumerate(run))
    return m if tiles else 0


def _adoptable(t: torch.Tensor) -> bool:
    # Re-pointing a tensor is invisible to its owner only if nothing else sees its memory: no
    # view of it, no base it views, no autograd graph that saved it. Tensor subclasses keep their
    # own semantics, so only plain tensors and Parameters are moved.
    return (
        type(t) in (torch.Tensor, torch.nn.Parameter)
        and t._base is None
        and (t.is_leaf or not t.requires_grad)
        and not t.is_inference()
        and t.layout == torch.strided
        and t.device.type != "meta"
        and storage_ptr(t) is not None
        and _use_count(t) == _base_use()
    )


def adopt(shards: list[torch.Tensor], interleaved: bool) -> bool:
    """Move same-device shards into one new allocation (row by row for ``interleaved`` mod
    shards, else back to back); False when that is not safe."""
    if len({id(s) for s in shards}) != len(shards) or not all(_adoptable(s) for s in shards):
        return False
    lay_out([(shards, interleaved)])
    return True


def place(t: torch.Tensor, piece: torch.Tensor) -> None:
    """Re-point ``t`` at ``piece``'s place in its memory (``t`` keeps its identity and shape)."""
    t.set_(piece.untyped_storage(), piece.storage_offset(), t.shape, piece.stride())


def lay_out(tables: Sequence[tuple[Sequence[torch.Tensor], bool]]) -> None:
    """Move each table's shards (same device and dtype, split by rows) into one new allocation, table after
    table, with their values: a table's shards back to back, or row by row where its flag says so (the
    ``m`` shards of a mod table in logical order)."""
    first = tables[0][0][0]
    rows = [sum(s.shape[0] for s in shards) for shards, _ in tables]
    slab = empty((sum(rows), *first.shape[1:]), dtype=first.dtype, device=first.device)
    start = 0
    with torch.no_grad():
        for (shards, interleaved), count in zip(tables, rows, strict=True):
            region, n = slab[start : start + count], len(shards)
            pieces = [region[k::n] for k in range(n)] if interleaved else region.split([s.shape[0] for s in shards])
            for s, piece in zip(shards, pieces, strict=True):
                piece.copy_(s)
                place(s, piece)
            start += count


def shards_over(slab: torch.Tensor, first: int, sizes: Sequence[int]) -> list[torch.nn.Parameter]:
    """Parameters over ``slab``'s (``[rows, width]``) rows from ``first`` on, ``sizes`` rows each, back to back."""
    out, width = [], slab.shape[1]
    with torch.no_grad():
        for size in sizes:
            p = torch.nn.Parameter(torch.empty(0, dtype=slab.dtype, device=slab.device))
            p.set_(slab.untyped_storage(), slab.storage_offset() + first * width, (size, width), (width, 1))
            out.append(p)
            first += size
    return out


def allocate_shards(
    layout: Layout,
    shape: torch.Size,
    dtype: torch.dtype,
    devices: Sequence[torch.device] | None,
    owned: list[int],
    values: torch.Tensor | Callable[[int], torch.Tensor] | None,
    requires_grad: bool,
) -> dict[int, torch.Tensor]:
    """New shards ``owned`` (on ``devices[s]``, default ``values``' device or the CPU), one slab per device
    when split along axis 0, with ``values`` copied in (the logical tensor, or ``shard -> tensor``)."""
    default = values.device if isinstance(values, torch.Tensor) else torch.device("cpu")
    at = {s: devices[s] if devices else default for s in owned}
    parts = layout.split(values) if isinstance(values, torch.Tensor) else None
    shards: dict[int, torch.Tensor] = {}
    for device in dict.fromkeys(at.values()):
        members = [s for s in owned if at[s] == device]
        for s, piece in zip(members, empty_shards(layout, shape, dtype, device, members), strict=True):
            if parts is not None or callable(values):
                with torch.no_grad():
                    piece.copy_(parts[s] if parts is not None else values(s))
            shards[s] = torch.nn.Parameter(piece, requires_grad=True) if requires_grad else piece
    return shards


def empty_shards(
    layout: Layout, shape: torch.Size, dtype: torch.dtype, device: torch.device, members: list[int]
) -> list[torch.Tensor]:
    """New uninitialised shards ``members`` of ``layout``: along axis 0 consecutive pieces of one slab."""
    # Each piece contiguous (torch's sparse ``add_`` fails on strided leaf parameters: see _relayout).
    # Along another axis a slab would buy nothing (rows are not contiguous), so each shard is its own tensor.
    if layout.axis != 0:
        return [empty(layout.shard_shape(shape, s), dtype=dtype, device=device) for s in members]
    rows = [layout.sizes[s] for s in members]
    slab = empty((sum(rows), *shape[1:]), dtype=dtype, device=device)
    return list(slab.split(rows)) if members else []


def _span(t: torch.Tensor) -> tuple[int, int]:
    """First and last element offsets of ``t`` within its storage."""
    lo = t.storage_offset()
    return lo, lo + sum((n - 1) * st for n, st in zip(t.shape, t.stride(), strict=True) if n)


def _row_progression(t: torch.Tensor) -> tuple[int, int, int, int] | None:
    """(row width, first row, row step, rows) when ``t`` is whole rows of a row-major buffer."""
    width = math.prod(t.shape[1:])
    inner = torch.empty(t.shape[1:], device="meta").stride() if t.dim() > 1 else ()
    if t.dim() == 0 or width == 0 or tuple(t.stride()[1:]) != tuple(inner):
        return None
    if t.storage_offset() % width or t.stride()[0] % width:
        return None
    return width, t.storage_offset() // width, max(t.stride()[0] // width, 1), t.shape[0]


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    pa, pb = _row_progression(a), _row_progression(b)
    if pa and pb and pa[0] == pb[0]:
        return intersect_progressions(pa[1:], pb[1:])[2] > 0
    if a.numel() + b.numel() > 1 << 22:
        return False  # too big to compare element by element; interleaved layouts this odd are not ours
    return bool(torch.isin(_addresses(a), _addresses(b)).any())


def _addresses(t: torch.Tensor) -> torch.Tensor:
    out = torch.full(t.shape, t.storage_offset(), dtype=torch.int64)
    for d, (n, st) in enumerate(zip(t.shape, t.stride(), strict=True)):
        out += (torch.arange(n) * st).reshape([-1 if i == d else 1 for i in range(t.dim())])
    return out.reshape(-1)


def check_disjoint(shards: Mapping[int, torch.Tensor]) -> None:
    """Refuse shards that share memory: a write to one would silently change another."""
    by_storage: dict[int, list[int]] = {}
    for s, t in shards.items():
        ptr = storage_ptr(t) if math.prod(t.shape) and t.device.type != "meta" else None
        if ptr:
            by_storage.setdefault(ptr, []).append(s)
    for members in by_storage.values():
        if len(members) < 2:
            continue  # a shard alone in its memory (only its pointer was read)
        active: list[tuple[int, int]] = []  # (last offset, shard) of spans that may reach the next one
        for lo, hi, b in sorted((*_span(shards[s]), s) for s in members):
            active = [(end, a) for end, a in active if end >= lo]
            for _, a in active:
                if _overlap(shards[a], shards[b]):
                    raise ShardvarValueError(f"shards {a} and {b} share memory; each shard must hold its own rows")
            active.append((hi, b))
