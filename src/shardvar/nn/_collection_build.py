"""A collection's tables: their configs checked, and built in place (each group's one allocation first,
each table drawn into its rows).

Tables built one by one and then copied into their group's allocation (the tables of one width
and pooling, which :func:`batch_tables` looks up in one kernel) would all be held twice at the
peak. Here the allocation comes first; each table's shards are Parameters over its rows, and
its values are drawn into them in logical order, a bounded piece at a time: torch's ``normal_``
draws the same numbers in pieces of whole 16-value blocks as in one call, so every table equals
the one its own constructor draws, at the tables' memory plus one piece.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import nn

from .._errors import ShardvarTypeError, ShardvarValueError
from .._pages import empty
from .._validate import check_bag_mode, check_choice, check_float_dtype, check_int
from ..layout import Layout
from ..variables import ShardStore, TableStorage, shards_over, to_layout
from ._jagged import check_names

__all__ = ["FeatureMap", "TableConfig", "build_tables", "check_tables", "feature_map"]


@dataclass(frozen=True)
class TableConfig:
    """One table of a collection: rows, width, how it is split (a count, partitioner or Layout), pooling,
    and the features it serves (``feature_names``; None: the one feature named as the table). A feature
    several tables serve is output once per table, as ``feature@table`` (see :func:`feature_map`).

    >>> TableConfig(100, 8, feature_names=["query_user", "candidate_user"]).feature_names
    ('query_user', 'candidate_user')
    """

    num_embeddings: int
    embedding_dim: int
    partitioner: Any = 1
    partition_strategy: str = "div"
    mode: str = "sum"
    feature_names: tuple[str, ...] | None = None
    storage: Any = None  # shardvar.Tiered(...): the table's rows in a file (a group of its own)

    def __post_init__(self) -> None:
        if self.storage is not None and not isinstance(self.storage, TableStorage):
            raise ShardvarTypeError(f"storage must be shardvar.Tiered(path, cache_bytes=...); got {self.storage!r:.80}")
        if self.feature_names is not None:
            names = check_names(self.feature_names, "feature_names")
            if not names:
                raise ShardvarValueError("feature_names is empty; a table serves at least one feature (None: its name)")
            object.__setattr__(self, "feature_names", names)  # frozen: set once, as a tuple


_TABLES = nn.ModuleDict()  # what a table's name must not shadow


def check_tables(tables: Any, sparse: bool, pooled: bool) -> None:
    """A non-empty dict of TableConfigs whose options a collection (pooled or not) can honour."""
    if not isinstance(tables, dict) or not tables:
        raise ShardvarTypeError(f"tables must be a non-empty dict of name -> TableConfig; got {tables!r:.80}")
    for name, cfg in tables.items():
        if not isinstance(name, str) or not name or "." in name:  # each is a module's name (the state dict's keys)
            got = f"{name!r:.60} ({type(name).__name__})"
            error = ShardvarTypeError if not isinstance(name, str) else ShardvarValueError
            raise error(f"table names must be non-empty strings without '.' (module names); got {got}")
        if hasattr(_TABLES, name):  # torch's ModuleDict keeps its modules as attributes beside its methods
            raise ShardvarValueError(
                f"table name {name!r} is an attribute of torch's ModuleDict (which holds the tables); "
                "name the table otherwise (the feature it serves may keep the name: feature_names)"
            )
        if not isinstance(cfg, TableConfig):
            raise ShardvarTypeError(f"table {name!r} must be a TableConfig; got {type(cfg).__name__}")
        if pooled:
            check_bag_mode(cfg.mode)
        else:
            check_choice(cfg.mode, "mode (an EmbeddingCollection does not pool)", ("sum",))
        if cfg.mode == "max" and sparse:
            raise ShardvarValueError(
                f"table {name!r}: mode 'max' has no sparse gradient (torch's rule); use sum or mean"
            )
        check_int(cfg.embedding_dim, "embedding_dim", minimum=1)


class FeatureMap(NamedTuple):
    """A collection's outputs: each output key's table, and each feature's output keys."""

    tables: dict[str, str]
    keys: dict[str, tuple[str, ...]]


def feature_map(tables: Mapping[str, TableConfig]) -> FeatureMap:
    """The output keys of ``tables`` by TorchRec's rule (``get_embedding_names_by_table``): a feature one
    table serves is keyed by its name, a feature several tables serve is keyed ``feature@table`` for
    each of them; keys in the tables' order, each table's in its ``feature_names`` order.

    >>> feature_map({"t1": TableConfig(9, 2, feature_names=["a", "b"]), "t2": TableConfig(9, 2, feature_names=["a"])})
    FeatureMap(tables={'a@t1': 't1', 'b': 't1', 'a@t2': 't2'}, keys={'a': ('a@t1', 'a@t2'), 'b': ('b',)})
    """
    served: dict[str, list[str]] = {}
    for name, cfg in tables.items():
        for feature in cfg.feature_names or (name,):
            served.setdefault(feature, []).append(name)
    key_of = {(f, t): f if len(ts) == 1 else f"{f}@{t}" for f, ts in served.items() for t in ts}
    out: dict[str, str] = {}
    for name, cfg in tables.items():
        for feature in cfg.feature_names or (name,):
            key = key_of[feature, name]
            if key in out:  # "a@t" names a feature and also keys feature "a" of table "t"
                first = next(f for (f, t), k in key_of.items() if k == key and t == out[key])
                raise ShardvarValueError(
                    f"feature {first!r} of table {out[key]!r} and feature {feature!r} of table {name!r} are both "
                    f"output as {key!r} (a feature several tables serve is output as 'feature@table'); rename one"
                )
            out[key] = name
    keys = {f: tuple(key_of[f, t] for t in ts) for f, ts in served.items()}
    return FeatureMap(out, keys)


PIECE_BYTES = 1 << 20  # the most drawn outside the tables at once (mod shards: logical rows are scattered)


def _store_over(slab: torch.Tensor, first: int, layout: Layout, shape: tuple[int, int]) -> ShardStore:
    """A store of ``layout``'s shards as Parameters over ``slab``'s rows from ``first`` on, back to back."""
    return ShardStore(layout, shape, dict(enumerate(shards_over(slab, first, layout.sizes))))


def pieces(rows: int, width: int, dtype: torch.dtype) -> list[tuple[int, int]]:
    """Row ranges whose ``normal_`` draws, one after the other, equal one draw of the whole table."""
    step = max(16, PIECE_BYTES // max(width * dtype.itemsize, 1) // 16 * 16)  # whole 16-value blocks
    cuts = [*list(range(0, rows, step))[: max(rows // step, 1)], rows]  # the last piece takes the rest
    return list(itertools.pairwise(cuts))


@torch.no_grad()
def _draw(store: ShardStore) -> None:
    """``nn.init.normal_`` of the logical table, written into the store's rows piece by piece."""
    slab = store.full_slab
    for a, b in pieces(store.shape[0], store.width, store.dtype):
        if store.logical_slab:
            nn.init.normal_(slab[a:b])
            continue
        piece = nn.init.normal_(torch.empty((b - a, store.width), dtype=store.dtype, device=slab.device))
        slab.index_copy_(0, store.slab_rows(torch.arange(a, b, device=slab.device)), piece)


def build_tables(
    tables: Mapping[str, Any], make: Callable[[Any, ShardStore | None], nn.Module], dtype: torch.dtype | None
) -> dict[str, nn.Module]:
    """``make(config, store)`` for each TableConfig, the stores of one (width, mode) sharing one allocation.

    A table whose layout is not split by rows, or whose rows are in a storage tier, gets ``store=None``:
    ``make`` builds (and checks) it its own way.
    """
    dtype = check_float_dtype(dtype) or torch.get_default_dtype()
    layouts = {
        name: to_layout(c.partitioner, (c.num_embeddings, c.embedding_dim), dtype, c.partition_strategy)
        for name, c in tables.items()
    }
    groups: dict[tuple[int, str], list[str]] = {}
    for name, c in tables.items():
        if layouts[name].axis == 0 and c.storage is None:  # a tiered table is never in a group's allocation
            groups.setdefault((c.embedding_dim, c.mode), []).append(name)
    stores: dict[str, ShardStore] = {}
    for (dim, _), names in groups.items():
        slab = empty((sum(tables[n].num_embeddings for n in names), dim), dtype=dtype)
        first = 0
        for n in names:
            stores[n] = _store_over(slab, first, layouts[n], (tables[n].num_embeddings, dim))
            first += tables[n].num_embeddings
    out = {}
    for name, c in tables.items():  # in the given order: each table draws what it would draw alone
        if name in stores:
            _draw(stores[name])
        out[name] = make(c, stores.get(name))
    return out
