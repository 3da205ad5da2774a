"""``v[key]`` and ``v[key] = x`` with numpy semantics on the logical tensor.

The entry of the key that addresses the sharded axis is resolved against the layout, so only
the shards it touches are read or written; the rest of the key is applied by torch to the
rows read. Torch has no negative-step slices, so those are rewritten as flips.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from .._errors import ShardvarIndexError, ShardvarTypeError
from .._validate import check_has_values
from ..layout import Layout, last_occurrence
from ._functional import checked, gather
from ._meta import check_readable
from ._spread import local
from ._store import ShardStore
from ._update import check_writable, scatter
from ._values import check_local, coerce, device_of, materialise

__all__ = ["getitem", "setitem", "expand_key"]


def _to_entry(k: Any) -> Any:
    if isinstance(k, torch.Tensor):
        check_has_values(k, "an index tensor")  # a meta index has no positions to read or write
        if k.is_nested:
            raise ShardvarTypeError(f"an index tensor must be a plain tensor; got a nested one (layout={k.layout})")
    if isinstance(k, (np.ndarray, list)):
        arr = np.asarray(k)
        if arr.dtype == bool:
            return torch.as_tensor(arr)
        if arr.size == 0:
            return torch.empty(arr.shape, dtype=torch.int64)
        if not np.issubdtype(arr.dtype, np.integer):
            raise ShardvarTypeError(f"index arrays must hold integers or booleans; got {k!r:.100}")
        return torch.as_tensor(arr, dtype=torch.int64)
    if isinstance(k, np.integer):
        return int(k)
    if isinstance(k, torch.Tensor) and k.dim() == 0 and k.dtype not in (torch.bool,) and not k.is_floating_point():
        return int(k)
    if isinstance(k, torch.Tensor) and (k.is_floating_point() or k.is_complex()):
        raise ShardvarTypeError(f"index tensors must hold integers or booleans; got dtype {k.dtype}")
    if k is None or k is Ellipsis or isinstance(k, (int, slice, torch.Tensor)):
        return k
    raise ShardvarTypeError(
        f"unsupported index {k!r:.100}; expected ints, slices, Ellipsis, None, or integer/boolean tensors"
    )


def _dims(entry: Any) -> int:
    if entry is None:
        return 0
    if isinstance(entry, torch.Tensor) and entry.dtype == torch.bool:
        return entry.dim()
    return 1


def expand_key(key: Any, ndim: int) -> tuple[list[Any], list[int]]:
    """Entries with Ellipsis expanded and trailing dims filled, and the first dim each entry covers."""
    if isinstance(key, bool) or (isinstance(key, tuple) and any(isinstance(k, bool) for k in key)):
        raise ShardvarTypeError(
            f"a Python bool is not a supported index on a ShardedVariable; use a boolean tensor; got key {key!r:.80}"
        )
    entries = [_to_entry(k) for k in (key if isinstance(key, tuple) else (key,))]
    if sum(e is Ellipsis for e in entries) > 1:
        raise ShardvarIndexError(f"an index can only have a single ellipsis ('...'); got key {key!r:.80}")
    used = sum(_dims(e) for e in entries if e is not Ellipsis)
    if used > ndim:
        raise ShardvarIndexError(f"too many indices for a variable of {ndim} dimension(s): {used} were indexed")
    if Ellipsis in entries:
        at = entries.index(Ellipsis)
        entries[at : at + 1] = [slice(None)] * (ndim - used)
    else:
        entries += [slice(None)] * (ndim - used)
    starts, dim = [], 0
    for e in entries:
        starts.append(dim)
        dim += _dims(e)
    return entries, starts


def _axis_entry(entries: list[Any], starts: list[int], axis: int) -> int:
    for i, (e, d) in enumerate(zip(entries, starts, strict=True)):
        if e is not None and d <= axis < d + _dims(e):
            return i
    raise AssertionError("every dimension is covered after expand_key")


def _flip_negative_steps(t: torch.Tensor, entries: list[Any], starts: list[int], skip: int) -> torch.Tensor:
    # x[a:b:-s] == flip(x)[n-1-a : n-1-b : s]: same elements, same order, positive step.
    for i, (e, d) in enumerate(zip(entries, starts, strict=True)):
        if i != skip and isinstance(e, slice) and e.step is not None and e.step < 0:
            n = t.shape[d]
            start, stop, step = e.indices(n)
            entries[i] = slice(n - 1 - start, n - 1 - stop, -step)
            t = t.flip(d)
    return t


def _normalise_int(index: int, size: int, axis: int) -> int:
    if not -size <= index < size:
        raise ShardvarIndexError(f"index {index} is out of bounds for axis {axis} with size {size}")
    return index % size


def _normalise_ids(ids: torch.Tensor, size: int, axis: int) -> torch.Tensor:
    ids = ids.to(torch.int64)
    bad = (ids < -size) | (ids >= size)
    if bool(bad.any()):
        value = int(ids[bad][0])
        raise ShardvarIndexError(f"index {value} is out of bounds for axis {axis} with size {size}")
    return torch.where(ids < 0, ids + size, ids)


def _read_slice(store: ShardStore, key: slice) -> torch.Tensor:
    layout, axis = store.layout, store.layout.axis
    if not local(store):  # a distributed variable: the slice's ids, fetched from their owners
        return gather(store, torch.arange(layout.num_rows)[key].to(device_of(store))).movedim(0, axis)
    shards = list(store.local_shards().values())
    plan = layout.decompose_slice(key)
    parts = []
    for p in plan.pieces:
        if p.step > 0:
            parts.append(
                shards[p.shard].narrow(axis, p.start, (p.count - 1) * p.step + 1)[_at(axis, slice(None, None, p.step))]
            )
        else:
            low = p.start + (p.count - 1) * p.step
            parts.append(
                shards[p.shard].narrow(axis, low, p.start - low + 1)[_at(axis, slice(None, None, -p.step))].flip(axis)
            )
    if not parts:
        return shards[0].narrow(axis, 0, 0)
    parts = [t.to(device_of(store)) for t in parts]
    out = torch.cat(parts, dim=axis) if len(parts) > 1 else parts[0]
    if not plan.in_order:
        out = out.index_select(axis, torch.argsort(plan.positions(out.device)))
    return out


def _at(axis: int, entry: Any) -> tuple:
    return (slice(None),) * axis + (entry,)


def _checked_key(store: ShardStore, key: Any) -> tuple[list[Any], list[int], int, Any]:
    """(entries, the first dim of each, the index of the sharded axis's entry, what it reads there: a
    row, a slice, ids, or None for a mask over several dims): every check of ``key``, nothing read."""
    check_readable(store)
    axis, size = store.layout.axis, store.shape[store.layout.axis]
    entries, starts = expand_key(key, len(store.shape))
    i = _axis_entry(entries, starts, axis)
    e = entries[i]
    if isinstance(e, torch.Tensor) and e.dtype == torch.bool and e.dim() > 1:
        return entries, starts, i, None
    if isinstance(e, int):
        return entries, starts, i, _normalise_int(e, size, axis)
    if isinstance(e, slice):
        return entries, starts, i, e
    if e.dtype == torch.bool:
        if e.shape[0] != size:
            raise ShardvarIndexError(f"boolean index of length {e.shape[0]} does not match axis {axis} of size {size}")
        return entries, starts, i, torch.nonzero(e).squeeze(1)
    return entries, starts, i, _normalise_ids(e, size, axis)


def getitem(store: ShardStore, key: Any) -> torch.Tensor:
    """``v[key]``: numpy semantics; reads only the shards that ``key`` touches (a distributed variable's
    ranks read together: a key one rank refuses is refused on every rank, see ``checked``)."""
    entries, starts, i, at = checked(store, lambda: _checked_key(store, key))
    axis = store.layout.axis
    if at is None:
        whole = materialise(store)  # a mask over several dims, the sharded one among them, reads every row anyway
        whole = _flip_negative_steps(whole, entries, starts, -1)
        return whole[_numpy_style(entries, whole.device)]
    if isinstance(at, int):
        shard, row = store.layout.locate(torch.tensor([at]))
        if local(store):
            compact = store.local_shards()[int(shard)].narrow(axis, int(row), 1).to(device_of(store))
        else:  # collective on a distributed variable, also on the rank that holds the row
            compact = gather(store, torch.tensor([at], device=device_of(store))).movedim(0, axis)
        entries[i] = 0
    elif isinstance(at, slice):
        compact = _read_slice(store, at)
        entries[i] = slice(None)
    else:
        rows = gather(store, at.reshape(-1).to(device_of(store)))
        compact = rows.movedim(0, axis) if axis else rows
        entries[i] = torch.arange(at.numel(), device=compact.device).reshape(at.shape)
    compact = _flip_negative_steps(compact, entries, starts, i)
    return compact[_numpy_style(entries, compact.device)]


def _numpy_style(entries: list[Any], device: torch.device) -> tuple:
    # numpy counts an int as an advanced index when another advanced index is present (torch does
    # not); a one-element index tensor broadcasts like the scalar and gets numpy's result shape.
    if any(isinstance(e, torch.Tensor) for e in entries):
        return tuple(torch.tensor([e], device=device) if isinstance(e, int) else e for e in entries)
    return tuple(entries)


def setitem(store: ShardStore, key: Any, value: Any) -> None:
    """``v[key] = value``: checks shape and dtype first, then writes only the touched shards."""
    shards = check_local(store, "assignment")
    layout, axis, size, shape = store.layout, store.layout.axis, store.shape[store.layout.axis], store.shape
    entries, starts = expand_key(key, len(shape))
    if any(e is None for e in entries):
        raise ShardvarTypeError(
            f"None (newaxis) is not supported in an assignment to a ShardedVariable; got key {key!r:.80}"
        )
    i = _axis_entry(entries, starts, axis)
    e = entries[i]
    others = [x for j, x in enumerate(entries) if j != i]
    if any(isinstance(x, torch.Tensor) for x in others) or (
        isinstance(e, torch.Tensor) and any(isinstance(x, int) for x in others)
    ):
        _setitem_by_rows(store, entries, starts, i, value)
        return
    if isinstance(e, torch.Tensor) and e.dtype == torch.bool:
        if e.dim() != 1 or e.shape[0] != size:
            raise ShardvarIndexError(
                f"boolean index of shape {list(e.shape)} does not match axis {axis} of size {size}"
            )
        e = torch.nonzero(e).squeeze(1)
    if isinstance(e, torch.Tensor):
        e = _normalise_ids(e, size, axis).reshape(-1)
    elif isinstance(e, int):
        e = _normalise_int(e, size, axis)
    # The result shape of v[key], without reading: index a broadcast scalar.
    probe_entries = [
        _ascending(x, shape[d]) if isinstance(x, slice) else x for x, d in zip(entries, starts, strict=True)
    ]
    probe_entries[i] = _ascending(e, size) if isinstance(e, slice) else e
    target = torch.empty((), dtype=torch.bool).expand(shape)[tuple(probe_entries)].shape
    value = coerce(value, store.dtype, target, selection=True)
    out_dim = sum(1 for x in entries[:i] if isinstance(x, slice))  # where the sharded axis lands in the value
    for j, (x, d) in enumerate(zip(entries, starts, strict=True)):
        if j != i and isinstance(x, slice) and x.step is not None and x.step < 0:
            entries[j] = _ascending(x, shape[d])
            value = value.flip(sum(1 for y in entries[:j] if isinstance(y, (slice, torch.Tensor))))
    writes = _planned_writes(layout, e, entries, i, value, out_dim)
    check_writable([shards[s] for s, _, _ in writes])
    with torch.no_grad():
        for s, key, part in writes:
            shards[s][key] = part.to(shards[s].device)


def _setitem_by_rows(store: ShardStore, entries: list[Any], starts: list[int], i: int, value: Any) -> None:
    """``v[key] = value`` for keys mixing advanced indices across axes, with numpy semantics.

    The rows the key touches along the sharded axis are read into a compact tensor, the key is
    applied to it by torch (positions instead of ids), and the rows are written back at once.
    """
    axis, size = store.layout.axis, store.shape[store.layout.axis]
    e = entries[i]
    if isinstance(e, torch.Tensor) and e.dtype == torch.bool:
        if e.dim() != 1 or e.shape[0] != size:
            raise ShardvarIndexError(
                f"boolean index of shape {list(e.shape)} does not match axis {axis} of size {size}"
            )
        e = torch.nonzero(e).squeeze(1)
    if isinstance(e, int):
        e = torch.tensor(_normalise_int(e, size, axis))
    elif isinstance(e, slice):
        e = torch.arange(size)[e]
    ids = _normalise_ids(e, size, axis).to(device_of(store))
    unique, inverse = torch.unique(ids.reshape(-1), return_inverse=True)
    with torch.no_grad():
        compact = gather(store, unique).movedim(0, axis).clone()
    entries[i] = inverse.reshape(ids.shape) if isinstance(entries[i], torch.Tensor) else inverse.reshape(())
    entries = [
        _ascending(x, compact.shape[d]) if isinstance(x, slice) and x.step and x.step < 0 else x
        for x, d in zip(entries, starts, strict=True)
    ]
    key = _numpy_style(entries, compact.device)
    target = compact[key]
    compact[key] = coerce(value, store.dtype, target.shape, selection=True)
    scatter(store, "scatter_update", unique, compact.movedim(axis, 0))


def _planned_writes(
    layout: Layout, e: Any, entries: list[Any], i: int, value: torch.Tensor, out_dim: int
) -> list[tuple[int, tuple, torch.Tensor]]:
    """(shard, key within the shard, value part) of every write ``v[key] = value`` makes."""
    writes = []
    if isinstance(e, int):
        shard, row = layout.locate(torch.tensor([e]))
        entries[i] = int(row)
        return [(int(shard), tuple(entries), value)]
    if isinstance(e, slice):
        for p in layout.decompose_slice(e).pieces:
            part = value[_at(out_dim, slice(p.out_start, p.out_start + (p.count - 1) * p.out_step + 1, p.out_step))]
            if p.step > 0:
                entries[i] = slice(p.start, p.start + (p.count - 1) * p.step + 1, p.step)
            else:
                low = p.start + (p.count - 1) * p.step
                entries[i] = slice(low, p.start + 1, -p.step)
                part = part.flip(out_dim)
            writes.append((p.shard, tuple(entries), part))
        return writes
    keep = last_occurrence(e)
    e, value = e[keep], value.index_select(out_dim, keep.to(value.device))
    for s, pos, rows in layout.split_ids(e):
        entries[i] = rows
        writes.append((s, tuple(entries), value.index_select(out_dim, pos.to(value.device))))
    return writes


def _ascending(key: slice, size: int) -> slice:
    """The same elements as ``key``, in ascending order (a negative step reversed)."""
    start, stop, step = key.indices(size)
    if step > 0:
        return slice(start, stop, step)
    n = len(range(start, stop, step))
    return slice(start + (n - 1) * step, start + 1, -step) if n else slice(0, 0)
