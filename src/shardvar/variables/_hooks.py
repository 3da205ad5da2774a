"""What the layers above may attach to a store, declared here: attached through ``ShardStore.attach``.

A store is the variables layer's; the layers above add behaviour to it without reaching into it:

* a :class:`RowSource` (the distributed layer's ``Exchange``) fetches the rows of ids that other
  ranks own; every lookup of a store with one asks it;
* a :class:`RowSink` (a fused optimizer's update, ``optim/_fused.py``) takes a table's summed
  gradient rows in backward (a sparse collection's backward hands them over, ``variables/_bag_grad.py``);
* companions: the other stores over the same memory (a collection's group), which must agree
  before any of them moves rows.

Nothing else is attached, and nothing is assigned onto a store from outside (an architecture test
checks).
"""

from __future__ import annotations

from typing import Any, NoReturn, Protocol, runtime_checkable

import torch

from .._errors import ShardvarError, ShardvarTypeError

ShardStore = Any  # the store asking (``_store`` imports this module: no import back)

__all__ = ["KEEP", "Reading", "RowSink", "RowSource", "check_attached", "renamed"]

KEEP: Any = object()  # ShardStore.attach: an argument not given
_ATTACHED = ("exchange", "sink", "companions", "interleaved", "readers")  # public attributes before attach()


@runtime_checkable
class RowSource(Protocol):
    """Rows of a store's variable held by other processes (collective: every rank calls each method)."""

    @property
    def world(self) -> int:
        """How many processes hold the variable's shards (1: every row is local)."""
        ...

    def grouping_key(self, store: ShardStore, ids: torch.Tensor) -> tuple[torch.Tensor, int] | None:
        """A sort key of ``ids`` grouping them by the process that owns them, and its bound; None when
        an id is out of range (the source then reports it on every rank) or the key would overflow."""
        ...

    def rows(
        self, store: ShardStore, ids: torch.Tensor, *, sparse: bool, max_norm: float | None, norm_type: float
    ) -> torch.Tensor:
        """Rows ``ids`` (1-D, any order, duplicates allowed, already checked) as ``[len(ids), width]``,
        differentiable into the local shards."""
        ...

    def refuse(self, error: ShardvarError) -> NoReturn:
        """Called in place of :meth:`rows` by a rank whose input the lookup refused: raises the agreed
        error on every rank (the other ranks learn of it in their ``rows``)."""
        ...


@runtime_checkable
class RowSink(Protocol):
    """An update that takes a table's gradient in backward: ``sink(full slab rows, their summed gradient)``
    with distinct rows (of the slab as it lay when they were read)."""

    def __call__(self, rows: torch.Tensor, values: torch.Tensor) -> None: ...


class Reading:
    """A pending backward's token (``ShardStore.reading``): the store's rows stay put while one lives."""

    __slots__ = ("__weakref__",)


def renamed(state: dict[str, Any]) -> dict[str, Any]:
    """A pickled store's state with what was attached under its old public names (before ``attach``)."""
    return {("_" + k if k in _ATTACHED else k): v for k, v in state.items()}


def check_attached(store: ShardStore, exchange: Any, sink: Any, companions: Any) -> dict[str, Any]:
    """What ``store.attach`` was given (:data:`KEEP`: left out), checked: by name, the values to attach."""
    given = {"exchange": exchange, "sink": sink, "companions": companions}
    found = {name: value for name, value in given.items() if value is not KEEP}
    if found.get("exchange") is not None and not isinstance(exchange, RowSource):
        raise ShardvarTypeError(
            f"exchange must be a RowSource (world, grouping_key, rows, refuse) or None; got {type(exchange).__name__}"
        )
    if found.get("sink") is not None and not callable(sink):
        raise ShardvarTypeError(
            f"sink must be a RowSink (called with rows and their gradient) or None; got {sink!r:.60}"
        )
    if "companions" in found:
        others = () if companions is None else companions
        if not isinstance(others, tuple | list) or not all(
            isinstance(c, type(store)) and c is not store for c in others
        ):
            raise ShardvarTypeError(
                f"companions must be the other ShardStores over this store's memory; got {companions!r:.80}"
            )
        found["companions"] = tuple(others)
    return found
