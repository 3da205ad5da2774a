"""Features packed into one lookup of a group's allocation: every input checked, each table's ids
moved to its rows there, the bags' offsets joined.

The checks are those of each feature alone, in the same order and with the same errors, but
done at once where they can be: the offsets of all features are joined first and checked as one
array (see :func:`_joined`), and only when something is wrong are the features checked one by one
to name the first fault. The ids are copied once into the packed rows (int32 where the
allocation's rows fit it) and moved to their storage rows there, in place, one pass per
operation for every feature of the same layout: the per-feature work is a range check and a copy.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from typing import Any, NamedTuple

import torch

from .._errors import ShardvarError
from .._recycle import Recycler
from ..layout import as_ids, check_ids
from ..variables import check_bag, check_weights

__all__ = ["buffer", "checked_features", "feature_bags", "pack", "refused"]


def feature_bags(
    f: str, inputs: tuple[dict, dict, dict], num_rows: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Feature ``f``'s 1-D ids, offsets and weights, or the error naming the feature: the ids of its table's
    ``num_rows``, offsets over them (a bad one would reach into another table's ids), weights by torch's
    rule (the ids' shape, the table's ``dtype``: one rule whether its table is grouped or not)."""
    features, offsets, weights = inputs
    try:
        ids = as_ids(features[f])
        checked = check_bag(ids, offsets.get(f), include_last_offset=False)
        check_ids(ids, num_rows)
        w = _weights(f, weights, ids, dtype)
    except ShardvarError as e:
        raise type(e)(f"feature {f!r}: {e}") from None
    if checked is None:  # [bags, ids per bag]
        return ids.reshape(-1), torch.arange(ids.shape[0], device=ids.device) * ids.shape[1], w
    return ids, checked, w


class _Feature(NamedTuple):
    name: str
    ids: torch.Tensor  # 1-D, checked against its table's rows
    offsets: torch.Tensor  # int64, on the ids' device (checked once joined, or one by one)
    weights: torch.Tensor | None


def _weights(name: str, weights: Mapping, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """Feature ``name``'s weights by torch's rule (the shape of its ids as given, the table's dtype), 1-D."""
    w = weights.get(name)
    return None if w is None else check_weights(w, ids, "sum", dtype).reshape(-1)


def _one_by_one(present: list[str], num_rows: list[int], dtype: torch.dtype, inputs: tuple) -> list[_Feature]:
    """Each feature checked alone, in order: the first fault raises its own error."""
    return [_Feature(f, *feature_bags(f, inputs, rows, dtype)) for f, rows in zip(present, num_rows, strict=True)]


def _at_once(
    present: list[str], num_rows: list[int], dtype: torch.dtype, inputs: tuple, lazy: list[bool]
) -> list[_Feature] | None:
    """The features with their offsets left to :func:`_joined`, and the ids of the ``lazy`` ones (the
    caller's op checks them where they are on the CPU) to the op; None for a kind of input it leaves
    to :func:`_one_by_one` (offsets that are not one 1-D tensor on the ids' device)."""
    features, offsets, weights = inputs
    out = []
    for f, rows, left in zip(present, num_rows, lazy, strict=True):
        ids, off = as_ids(features[f]), offsets.get(f)
        w = _weights(f, weights, ids, dtype)  # against the ids as given (2-D weights for 2-D ids)
        if ids.dim() == 2 and off is None and ids.shape[0]:  # [bags, ids per bag]: valid offsets by construction
            ids, off = ids.reshape(-1), torch.arange(ids.shape[0], device=ids.device) * ids.shape[1]
        elif ids.dim() == 1 and isinstance(off, torch.Tensor):
            off = as_ids(off)
            if off.dim() != 1 or off.numel() == 0 or off.device != ids.device:
                return None
        else:
            return None
        if not (left and ids.is_cpu and not torch._C._functorch.is_functorch_wrapped_tensor(ids)):
            check_ids(ids, rows)
        out.append(_Feature(f, ids, off, w))
    return out


def _joined(checked: list[_Feature]) -> torch.Tensor:
    """The features' offsets end to end, each shifted by the ids before it."""
    offs = [c.offsets for c in checked]
    before = list(itertools.accumulate((c.ids.numel() for c in checked), initial=0))
    counts = [o.numel() for o in offs]
    joined = torch.cat(offs)  # a new tensor, even of one
    if len(set(counts)) == 1:  # bags of as many ids each: the shifts at once, a broadcast add
        joined.view(len(offs), -1).add_(torch.tensor(before[:-1], device=joined.device)[:, None])
    else:
        firsts = list(itertools.accumulate(counts, initial=0))
        for lo, hi, shift in zip(firsts[1:], firsts[2:], before[1:]):  # noqa: B905 (one more first)
            joined[lo:hi] += shift
    return joined


def _valid(checked: list[_Feature]) -> bool:
    """Whether each feature's offsets are from 0, non-decreasing and at most its ids, found at once: as
    rows of one matrix where all have as many bags, else joined (then the whole is non-decreasing,
    each feature's first is the count of ids before it, and the last is at most all the ids)."""
    offs = [c.offsets for c in checked]
    sizes = [c.ids.numel() for c in checked]
    if len({o.numel() for o in offs}) == 1:
        rows = torch.stack(offs) if len(offs) > 1 else offs[0][None]
        ends = rows[:, [0, -1]].tolist()  # every first and last, read at once
        valid = all(first == 0 and last <= n for (first, last), n in zip(ends, sizes, strict=True))
        # A descent anywhere: min of the differences (arithmetic and a reduction beat a comparison's bools).
        return valid and (rows.shape[1] < 2 or int(torch.diff(rows, dim=1).min()) >= 0)
    joined, before = _joined(checked), list(itertools.accumulate(sizes, initial=0))
    probe = joined[[*itertools.accumulate((o.numel() for o in offs[:-1]), initial=0), -1]].tolist()
    valid = probe[:-1] == before[:-1] and probe[-1] <= before[-1]
    return valid and (joined.numel() < 2 or int(torch.diff(joined).min()) >= 0)


def checked_features(
    present: list[str], num_rows: list[int], dtype: torch.dtype, inputs: tuple, lazy: list[bool] | None = None
) -> list[_Feature]:
    """Every feature checked (ids in their table's rows, offsets, weights), the first fault raising its
    error; the ids of ``lazy`` features on the CPU are left to the caller, who must refuse a bad
    one (:func:`refused`) before anything reads it."""
    try:
        checked = _at_once(present, num_rows, dtype, inputs, lazy or [False] * len(present))
        if checked is not None and _valid(checked):
            return checked
    except ShardvarError:
        pass  # a fault: which one, and in what order, is the features' own checks' to say
    return _one_by_one(present, num_rows, dtype, inputs)  # raises the first fault


def refused(present: list[str], num_rows: list[int], dtype: torch.dtype, inputs: tuple) -> None:
    """After an op refused what :func:`checked_features` left to it: the error of the first fault, in
    the order of the features' own checks (returns if it finds none: the op's error is the one)."""
    _one_by_one(present, num_rows, dtype, inputs)


def buffer(recycler: Recycler | None, key: str, size: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if recycler is not None and device.type == "cpu":
        return recycler.take(key, (size,), dtype, device)
    return torch.empty(size, dtype=dtype, device=device)


def _runs(keys: list[Any], bounds: list[int]) -> list[tuple[Any, int, int]]:
    """(key, first, stop) of each run of equal consecutive keys, ``bounds`` being each one's span."""
    out: list[tuple[Any, int, int]] = []
    for key, lo, hi in zip(keys, bounds, bounds[1:]):  # noqa: B905 (bounds has one more)
        if out and out[-1][0] == key:
            out[-1] = (key, out[-1][1], hi)
        else:
            out.append((key, lo, hi))
    return out


def pack(
    present: list[str],
    table_of: Mapping[str, str],
    layouts: Mapping[str, Any],
    starts: Mapping[str, int],
    dtype: torch.dtype,
    features: dict,
    offsets: dict,
    weights: dict,
    index: torch.dtype = torch.int64,
    recycler: Recycler | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, list[int]]:
    """Features' bags as one: (rows of the shared allocation, offsets, weights or None, bags per feature).

    Feature ``f``'s id ``i`` is row ``starts[t] + storage_row(i)`` of its table ``t = table_of[f]``;
    each feature's ids are checked against its table's rows (valid in the allocation is not
    enough) and its offsets against its ids, all before any is packed. Inputs come checked by
    ``split_inputs``; features without weights weigh 1 when others have them. Rows and offsets
    are of dtype ``index`` (int32 halves a batch's rows where the allocation's rows fit it), in
    the memory of the last call's where ``recycler`` is given and nothing holds them (CPU: no
    fresh pages to fault in; the rows live as long as the call's backward anyway).
    """
    tables = [table_of[f] for f in present]
    num_rows = [layouts[t].num_rows for t in tables]
    checked = checked_features(present, num_rows, dtype, (features, offsets, weights))
    device = checked[0].ids.device
    bounds = list(itertools.accumulate((c.ids.numel() for c in checked), initial=0))
    rows = buffer(recycler, "rows", bounds[-1], index, device)
    for c, lo, hi in zip(checked, bounds, bounds[1:]):  # noqa: B905 (bounds has one more)
        rows[lo:hi].copy_(c.ids)  # in the table's rows: they fit ``index``
    scratch = None
    for layout, lo, hi in _runs([layouts[t] for t in tables], bounds):  # tables of one layout: one pass each
        if not (layout.contiguous or layout.num_shards == 1) and scratch is None:  # rows not the ids
            scratch = buffer(recycler, "scratch", bounds[-1], index, device)
        piece = rows[lo:hi]
        layout.strategy.storage_rows_into(layout.sizes, piece, piece, scratch[lo:hi] if scratch is not None else piece)
    for t, lo, hi in _runs(tables, bounds):
        if starts[t]:
            rows[lo:hi] += starts[t]
    psw = None
    if any(c.weights is not None for c in checked):  # weight 1 is exactly an unweighted sum: the others keep theirs
        psw = torch.cat([c.weights if c.weights is not None else torch.ones_like(c.ids, dtype=dtype) for c in checked])
    return rows, _joined(checked).to(index), psw, [c.offsets.numel() for c in checked]
