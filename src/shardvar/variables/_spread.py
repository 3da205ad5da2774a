"""Stores whose rows live on the ranks of a group (the distributed layer sets their ``exchange``):
when a read is collective, and how a lookup's refusal of its input becomes every rank's."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from .._errors import ShardvarError
from ._store import ShardStore

__all__ = ["checked", "exchange_of", "local", "spread"]


def exchange_of(store: ShardStore) -> Any:
    """The store's exchange when rows live on other ranks, or where the store holds none of them (a tiered
    table's rank serves its rows from its file); a one-process group holding every row needs none."""
    ex = store.exchange
    return ex if ex is not None and (ex.world > 1 or not store.is_complete) else None


def spread(store: ShardStore) -> bool:
    """Whether the store's rows live on the ranks of a group: every read is collective, even on a rank
    that holds every shard (the others call the same collectives), and no rank writes rows directly."""
    return exchange_of(store) is not None


def local(store: ShardStore) -> bool:
    """Whether this process reads and writes the store alone: every shard here, no rank to read with."""
    return store.is_complete and not spread(store)


T = TypeVar("T")


def checked(store: ShardStore, check: Callable[[], T]) -> T:
    """``check()``: a lookup's checks of its input, run before anything else. Where the store's rows
    live on several ranks, a refusal is every rank's: this rank's error takes the place of the
    lookup's first collective (``exchange.refuse``), and every rank raises it, naming this rank;
    ranks whose input is good learn of it in that collective. So ``check`` must run no collective."""
    exchange = exchange_of(store)
    if exchange is None:
        return check()
    try:
        return check()
    except ShardvarError as e:
        exchange.refuse(e)
        raise
