"""What the layers above attach to a store: typed hooks, attached through one checked method."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch

from shardvar import ShardvarError
from shardvar.layout import Layout
from shardvar.variables import ShardStore
from shardvar.variables._hooks import RowSink, RowSource


class Source:
    """A RowSource of one process: every row local (what a one-rank group's exchange is)."""

    world = 1

    def grouping_key(self, store: ShardStore, ids: torch.Tensor) -> None:
        return None

    def rows(self, store: ShardStore, ids: torch.Tensor, *, sparse: bool, max_norm: float | None, norm_type: float):
        return store.full_slab.index_select(0, store.slab_rows(ids))

    def refuse(self, error: Exception):
        raise error


def _store() -> ShardStore:
    return ShardStore.allocate(Layout.mod(8, 2), (8, 3), torch.float32, values=torch.arange(24.0).view(8, 3))


def test_attach_sets_what_is_named_and_keeps_the_rest() -> None:
    store, other, source = _store(), _store(), Source()
    taken = []
    assert store.attach(exchange=source) is store
    store.attach(sink=lambda rows, values: taken.append(rows), companions=[other])
    assert store.exchange is source and store.companions == (other,) and isinstance(store.sink, RowSink)
    assert isinstance(source, RowSource)
    store.sink(torch.tensor([1]), torch.zeros(1, 3))
    assert len(taken) == 1
    store.attach(sink=None)  # detaches the sink only
    assert store.sink is None and store.exchange is source and store.companions == (other,)
    store.attach(exchange=None, companions=None)
    assert store.exchange is None and store.companions == ()


@pytest.mark.parametrize(
    ("given", "match"),
    [
        ({"exchange": object()}, "exchange must be a RowSource .* got object"),
        ({"exchange": lambda ids: ids}, "exchange must be a RowSource .* got function"),
        ({"sink": 3}, "sink must be a RowSink .* got 3"),
        ({"companions": "abc"}, "companions must be the other ShardStores"),
        ({"companions": [torch.zeros(1)]}, "companions must be the other ShardStores"),
        ({"exchange": Source(), "sink": 3}, "sink must be a RowSink"),  # nothing attached: not the exchange either
    ],
)
def test_attach_refuses_what_is_not_a_hook_and_changes_nothing(given: dict, match: str) -> None:
    store, other = _store(), _store()
    store.attach(companions=(other,))
    with pytest.raises(ShardvarError, match=match) as info:
        store.attach(**given)
    assert isinstance(info.value, TypeError)
    assert store.exchange is None and store.sink is None and store.companions == (other,)


def test_a_store_is_not_its_own_companion() -> None:
    store = _store()
    with pytest.raises(TypeError, match="companions must be the other ShardStores"):
        store.attach(companions=(store,))


@pytest.mark.parametrize("name", ["exchange", "sink", "companions", "interleaved"])
def test_hooks_and_row_state_are_read_only(name: str) -> None:
    store = _store()
    with pytest.raises(AttributeError):
        setattr(store, name, None)


def test_a_copy_drops_the_sink_and_pending_readers_and_keeps_the_rest() -> None:
    store, source = _store(), Source()
    store.attach(exchange=source, sink=lambda rows, values: None)
    token = store.reading()
    assert store.rows_held
    for again in (copy.deepcopy(store), pickle.loads(pickle.dumps(store))):
        assert again.sink is None and not again.rows_held
        assert type(again.exchange) is Source and again.companions == ()
        assert torch.equal(again.full_slab, store.full_slab)
    del token
    assert not store.rows_held


def test_a_store_pickled_before_attach_loads() -> None:
    """A store pickled when hooks were public attributes (``store.exchange = ...``) loads with them attached."""
    store = _store()
    state = {k.lstrip("_") if k in ("_exchange", "_sink", "_companions", "_interleaved") else k: v
             for k, v in store.__getstate__().items()}  # fmt: skip
    state["readers"] = None
    old = ShardStore.__new__(ShardStore)
    old.__setstate__({**state, "exchange": Source()})
    assert isinstance(old.exchange, Source) and old.sink is None and not old.interleaved and not old.rows_held
    assert torch.equal(old.full_slab, store.full_slab)


def test_with_shards_keeps_the_exchange() -> None:
    store, source = _store(), Source()
    store.attach(exchange=source, sink=lambda rows, values: None)
    shards = {s: t.clone() for s, t in store.local_shards().items()}
    other = store.with_shards(shards)
    assert other.exchange is source and other.sink is None
    assert other.local_shards()[1] is shards[1]
    assert torch.equal(other.full_slab, store.full_slab)
