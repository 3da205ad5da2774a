"""Values written into or read out of a store as a whole: materialising, and checking what is written."""

from __future__ import annotations

from typing import Any

import torch

from .._errors import ShardvarTypeError, ShardvarValueError
from .._validate import check_has_values
from ._functional import gather, slab_weight
from ._meta import check_readable
from ._spread import local
from ._store import ShardStore

__all__ = ["materialise", "as_value", "coerce", "check_local", "check_range", "device_of", "ids_device"]


def device_of(store: ShardStore) -> torch.device:
    """Where results read from the store go: its first slab's (or shard's) device."""
    return store.groups[0].device if store.groups else torch.device("cpu")


def ids_device(store: ShardStore) -> torch.device | None:
    """Where ids given as lists go to be checked: the store's device, or the host for a meta store."""
    device = device_of(store)
    return None if device.type == "meta" else device


def check_local(store: ShardStore, what: str) -> list[torch.Tensor]:
    """The store's shards, all of them; a distributed store cannot ``what`` (on no rank, also not on one
    that holds every shard: the ranks would part ways)."""
    if not local(store):
        raise ShardvarTypeError(
            f"{what} needs every shard in this process; a distributed variable's shards live on the ranks of "
            f"its group (this rank holds shards {sorted(store.local_shards())} of {store.layout.num_shards}): "
            "use lookups, or local_shards()"
        )
    return list(store.local_shards().values())


def materialise(store: ShardStore, copy: bool = True) -> torch.Tensor:
    """The whole logical tensor (collective for a distributed store); differentiable into the shards.

    With ``copy=False`` it aliases the shards where the layout allows (one slab holding contiguous
    shards in order is already the table), else it is a new tensor.
    """
    check_readable(store)
    if not local(store):  # collective, on every rank alike
        return gather(store, torch.arange(store.layout.num_rows, device=device_of(store)))
    if store.logical_slab:  # the slab is the table: a view of the shards, or one copy of it
        whole = slab_weight(store).view(store.shape)
        return whole if not copy else whole.clone()
    return store.layout.join(list(store.local_shards().values()))


def as_value(value: Any) -> torch.Tensor:
    """``value`` as a tensor; a ShardedVariable (anything exposing a ``store``) as its logical tensor."""
    store = getattr(value, "store", None)
    if isinstance(store, ShardStore):
        return materialise(store)
    if isinstance(value, torch.Tensor):
        return value
    if value is None:
        raise ShardvarTypeError("cannot write None into a variable; expected a tensor, number or nested list")
    try:
        return torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError, OverflowError) as e:
        raise ShardvarTypeError(f"cannot read {value!r:.60} as a tensor ({e})") from None


def check_range(t: torch.Tensor, dtype: torch.dtype) -> None:
    # Writing 300 into uint8 would wrap silently: refuse, naming the value and the dtype's range.
    if dtype.is_floating_point or dtype.is_complex or dtype == torch.bool or t.numel() == 0:
        return
    if t.dtype == dtype or t.dtype == torch.bool:
        return
    info = torch.iinfo(dtype)
    low, high = t.min(), t.max()
    if t.is_floating_point():
        low, high = low.floor(), high.ceil()
    for bad in (low, high):
        if not info.min <= int(bad) <= info.max:
            raise ShardvarValueError(f"value {int(bad)} is out of range for {dtype}: expected [{info.min}, {info.max}]")


def coerce(
    value: Any, dtype: torch.dtype, shape: tuple[int, ...] | torch.Size, what: str = "value", selection: bool = False
) -> torch.Tensor:
    """``value`` checked and cast to ``dtype`` and broadcast to ``shape``, or a clear error."""
    t = check_has_values(as_value(value), what)
    explicit = isinstance(value, torch.Tensor) or isinstance(getattr(value, "store", None), ShardStore)
    if not torch.can_cast(t.dtype, dtype) and (explicit or dtype != torch.bool):
        raise ShardvarTypeError(
            f"{what} of dtype {t.dtype} cannot be cast to the variable's dtype {dtype} (a lossy cast)"
        )
    check_range(t, dtype)
    try:
        return t.to(dtype).broadcast_to(shape)
    except RuntimeError:
        fit = "cannot be assigned to a selection of shape" if selection else "does not fit shape"
        raise ShardvarValueError(f"{what} of shape {list(t.shape)} {fit} {list(shape)}") from None
