"""Validation of logical ids: integer dtype, inside [0, num_rows)."""

from __future__ import annotations

import torch

from .._errors import ShardvarIndexError, ShardvarTypeError
from .._validate import check_has_values

__all__ = ["as_ids", "check_ids", "last_occurrence", "group_positions"]

_INTEGER_DTYPES = frozenset(
    {torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.uint16, torch.uint32, torch.uint64}
)


def as_ids(
    ids: object, device: torch.device | str | None = None, *, allow_meta: bool = False, what: str = "ids"
) -> torch.Tensor:
    """Turn ids (tensor, list, numpy array or int) into an int64 tensor, refusing non-integers.

    Ids on the meta device are refused (they hold no ids) unless ``allow_meta``: a lookup that
    only plans shapes over a meta table. ``what`` names them in errors (``"offsets"``: integers
    read by the same rule).
    """
    if isinstance(ids, torch.Tensor):
        if ids.dtype not in _INTEGER_DTYPES:
            raise ShardvarTypeError(f"{what} must be an integer tensor; got dtype {ids.dtype}")
        if not allow_meta:
            check_has_values(ids, what)
        if ids.is_nested:
            raise ShardvarTypeError(
                f"ids must be a plain tensor here; got a nested tensor (layout={ids.layout}); jagged ids are taken "
                "by the lookups (embedding_lookup, sparse_read, the embedding modules)"
            )
        t = ids
    else:
        if isinstance(ids, bool) or (isinstance(ids, (list, tuple)) and any(isinstance(i, bool) for i in ids)):
            raise ShardvarTypeError(f"{what} must be integers; got booleans in {ids!r}")
        try:
            t = torch.as_tensor(ids)
        except (TypeError, ValueError, RuntimeError) as e:
            raise ShardvarTypeError(f"{what} must be integers; could not read {ids!r} as a tensor ({e})") from None
        if t.numel() == 0 and t.dtype not in _INTEGER_DTYPES:
            t = t.to(torch.int64)  # [] has no dtype of its own; an empty list is a valid empty id list
        if t.dtype not in _INTEGER_DTYPES:
            raise ShardvarTypeError(f"{what} must be integers; got dtype {t.dtype} from {ids!r}")
    if t.dtype == torch.uint64:
        wrapped = t.reshape(-1).view(torch.int64) < 0  # values >= 2**63 wrap negative in int64
        if bool(wrapped.any()):
            at = int(torch.nonzero(wrapped)[0])
            value = int(t.reshape(-1).view(torch.int64)[at]) + 2**64
            raise ShardvarIndexError(f"{what} must fit in int64; got {value} at position {at}")
    if device is not None:
        t = t.to(device)
    return t if t.dtype == torch.int64 else t.to(torch.int64)  # no call at all for the usual ids


def check_ids(ids: torch.Tensor, num_rows: int) -> None:
    """Raise ShardvarIndexError naming the first id outside [0, num_rows) and where it sits."""
    if ids.numel() == 0:
        return
    low, high = torch.aminmax(ids)  # one pass, no temporaries: this runs on every lookup
    # Read at once: on a GPU each read waits for the device.
    low, high = (int(low), int(high)) if ids.device.type == "cpu" else torch.stack((low, high)).tolist()
    if low < 0 or high >= num_rows:
        bad = (ids < 0) | (ids >= num_rows)
        flat = int(torch.nonzero(bad.reshape(-1))[0])
        value = int(ids.reshape(-1)[flat])
        if ids.dim() > 1:
            position = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), ids.shape))
        else:
            position = flat
        raise ShardvarIndexError(f"ids must be in [0, {num_rows}); got {value} at position {position}")


def last_occurrence(ids: torch.Tensor) -> torch.Tensor:
    """Positions of the last occurrence of each distinct id, so a duplicated write is 'last wins'."""
    if ids.numel() <= 1:
        return torch.arange(ids.numel(), device=ids.device)
    unique, inverse = torch.unique(ids, return_inverse=True)
    last = torch.full((unique.numel(),), -1, dtype=torch.int64, device=ids.device)
    return last.scatter_reduce_(0, inverse, torch.arange(ids.numel(), device=ids.device), "amax")


def group_positions(keys: torch.Tensor, num_groups: int) -> list[tuple[int, torch.Tensor]]:
    """For each key value in [0, num_groups) present: (value, positions holding it, ascending).

    One stable sort for all groups, so the cost does not grow with the number of groups.
    """
    if num_groups == 1:
        return [(0, torch.arange(keys.numel(), device=keys.device))] if keys.numel() else []
    order = torch.argsort(keys, stable=True)
    counts = torch.bincount(keys, minlength=num_groups).tolist()
    return [(g, pos) for g, pos in enumerate(order.split(counts)) if pos.numel()]
