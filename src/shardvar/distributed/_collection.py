"""DistributedEmbeddingBagCollection: many tables over ranks, all looked up in one exchange.

The tables of one (width, mode) group are the pieces of one distributed table whose shards are
the tables' shards, in order (an explicit div layout of their sizes): a table's id ``i`` is the
group's row ``start + storage_row(i)``. A step then makes the group's collectives once (the
split sizes, the ids, the rows back, the gradient rows in backward), whatever the number of
tables. Each table keeps its own layout and placement (``"row"``: its shards round robin over
the ranks; ``"table"``: whole on one rank, chosen round robin over the tables; or a rank) and is
checkpointed as its own logical variable, so it restores into another world size, other layouts,
a local ``EmbeddingBagCollection`` or plain ``nn.EmbeddingBag``s. ``DistributedEmbeddingCollection`` is the
same over ``nn.Embedding``-like groups: each feature's rows, not bags, in the same one exchange per group.
"""

from __future__ import annotations

import itertools
from typing import Any, ClassVar

import torch
from torch import nn

from .._errors import ShardvarDistributedError, ShardvarError, ShardvarTypeError, ShardvarValueError
from ..layout import Layout
from ..nn import (
    Features,
    PerFeature,
    Pooled,
    ShardedEmbedding,
    ShardedEmbeddingBag,
    TableConfig,
    TieredTable,
    check_tables,
    feature_map,
    jagged_split,
    pack,
    row_dtype,
    split_inputs,
)
from ..variables import RowInitializer, ShardedVariable, ShardStore, to_layout
from ._agree import agree, refuse
from ._comm import DEFAULT_TIMEOUT, Comm
from ._module import _Distributed
from ._placement import plan_collection
from ._replicas import Replicas
from ._tiered import _TieredRanks

__all__ = ["DistributedEmbeddingBagCollection", "DistributedEmbeddingCollection", "lookup_collection"]


class _Unnamed:
    """The group's distributed table; the collection names its tables, so it names none itself."""

    def sharded_variables(self) -> dict[str, Any]:
        return {}

    def distributed_variables(self) -> dict[str, Any]:
        return {}


# A group's table is the local module over a store spread over ranks (`_Distributed`'s construction),
# composed as the public distributed modules are, rather than a subclass of them.
class _GroupBag(_Unnamed, _Distributed, ShardedEmbeddingBag):
    """A pooled collection's group: bags of the group's rows."""


class _GroupRows(_Unnamed, _Distributed, ShardedEmbedding):
    """A sequence collection's group: every id's row."""


class _TieredGroup:
    """A collection's tiered table (a mixin): a group of its own, each rank's shards in its own file. Its
    store's rows are the group's (an explicit layout of the table's shards, ids packed to them as for every
    group); its ``layout`` is the table's (the same shards, in order), in which optimizers and checkpoints see
    it, named as the local collection's table (``<prefix>.<table>``: the collection registers it there)."""

    def __init__(self, *args: Any, table_layout: Layout, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.layout = table_layout

    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        pass  # the table is its ``sharded_variables`` (streamed by a checkpoint); it has no tensor in RAM


class _GroupTieredBag(_TieredGroup, _TieredRanks, TieredTable, _GroupBag):
    """A pooled collection's tiered table."""


class _GroupTieredRows(_TieredGroup, _TieredRanks, TieredTable, _GroupRows):
    """A sequence collection's tiered table."""


TIERED_GROUPS = {_GroupBag: _GroupTieredBag, _GroupRows: _GroupTieredRows}


class _Renumbered:
    """Draws the group's row ``g`` as the collection's row ``numbers[g]`` (its tables end to end, in the
    collection's order, by logical id): a table's initial values depend on neither grouping nor placement."""

    def __init__(self, init: RowInitializer, numbers: torch.Tensor) -> None:
        self.init, self.numbers = init, numbers

    def rows(self, ids: torch.Tensor, row_shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.init.rows(self.numbers[ids.reshape(-1).to(torch.int64).cpu()], row_shape, dtype)


def _ranks(spec: Any, layout: Layout, index: int, world: int, name: str) -> list[int]:
    if spec == "row":
        return [(index + s) % world for s in range(layout.num_shards)]  # rotated: tables spread their first shards
    if spec == "table":
        return [index % world] * layout.num_shards
    if isinstance(spec, int) and not isinstance(spec, bool) and 0 <= spec < world:
        return [spec] * layout.num_shards
    raise ShardvarValueError(
        f"placement of table {name!r} must be 'row', 'table', 'replicate' or a rank in [0, {world}); got {spec!r}"
    )


_FIELDS = ("num_embeddings", "embedding_dim", "partitioner", "partition_strategy", "mode", "feature_names")


def _checked_placement(tables: dict[str, TableConfig], placement: Any, world: int) -> dict[str, Any]:
    """The placement of each named table (``"auto"``: planned for ``world`` ranks), its names checked."""
    placement = plan_collection(tables, world) if placement == "auto" else placement or {}
    if not isinstance(placement, dict):
        raise ShardvarTypeError(f"placement must be a dict of table -> placement, or 'auto'; got {placement!r}")
    unknown = sorted(set(placement) - set(tables))
    if unknown:
        raise ShardvarValueError(f"placement names tables {unknown} that are not in the collection")
    return placement


def _agree(comm: Comm, tables: dict[str, TableConfig], placement: dict[str, Any], sparse: bool) -> None:
    """Every rank was given the same tables: else one short error naming the table, the argument
    and both values (the packed groups the tables become would only differ in their shapes)."""
    described = {n: {f: repr(getattr(c, f)) for f in _FIELDS} for n, c in tables.items()}
    for name, fields in described.items():
        fields["placement"] = repr(placement.get(name, "row"))
        fields["storage"] = "tiered" if tables[name].storage is not None else "in RAM"
    mine = (list(described), described, sparse)
    everyone = comm.all_gather_object(mine, "the collection's tables")
    for rank, (names, configs, other_sparse) in enumerate(everyone):
        here = f"on rank {comm.rank} but {{}} on rank {rank}"
        if names != mine[0]:
            raise ShardvarDistributedError(
                f"ranks disagree about the collection's tables: {mine[0]} {here.format(names)}"
            )
        if other_sparse != sparse:
            raise ShardvarDistributedError(
                f"ranks disagree about the collection: sparse is {sparse} {here.format(other_sparse)}"
            )
        for name, fields in described.items():
            for field, value in fields.items():
                if configs[name][field] != value:
                    raise ShardvarDistributedError(
                        f"ranks disagree about table {name!r}: {field} is {value} {here.format(configs[name][field])}"
                    )


class DistributedEmbeddingBagCollection(nn.Module):
    """Named tables sharded over the ranks of a process group, looked up in one exchange per group.

    Every rank builds it with the same arguments and calls it with every table's feature (its own
    ids). ``placement`` maps a table to ``"row"`` (default), ``"table"``, a rank or ``"replicate"``
    (whole on every rank, data parallel: for small tables); ``placement="auto"`` asks
    :func:`plan_collection` (replicate the tiny, split the large by rows, balance the rest whole).
    A table whose ``TableConfig`` has ``storage=`` is a group of its own, each rank's shards in its own
    file (see ``DistributedEmbedding``), under the local collection's name ``<prefix>.<table>``.
    """

    pooled: ClassVar[bool] = True  # bags per feature; the sequence twin returns every id's row
    prefix: ClassVar[str] = "embedding_bags"  # the tables' names: <prefix>.<table>.weight

    def __init__(
        self,
        tables: dict[str, TableConfig],
        *,
        placement: dict[str, Any] | str | None = None,
        sparse: bool = False,
        initializer: RowInitializer | None = None,
        group: Any = None,
        timeout: float = DEFAULT_TIMEOUT,
    ) -> None:
        super().__init__()
        check_tables(tables, sparse, self.pooled)
        world = Comm(group, timeout).world
        placement = _checked_placement(tables, placement, world)
        _agree(Comm(group, timeout), tables, placement, sparse)
        self.configs = dict(tables)
        self.served = feature_map(tables)
        self.feature_tables = self.served.tables  # each output key's table
        init = initializer or RowInitializer()
        first = dict(zip(tables, [0, *itertools.accumulate(c.num_embeddings for c in tables.values())], strict=False))
        replicated = {n: c for n, c in tables.items() if placement.get(n) == "replicate"}
        tiered = sorted(n for n, c in replicated.items() if c.storage is not None)
        if tiered:  # every rank would hold the whole table in RAM
            raise ShardvarValueError(
                f"tables {tiered} have storage= and placement 'replicate': a tiered table is split over ranks"
            )
        comm = self.comm = Comm(group, timeout)
        self.replicas = Replicas(replicated, sparse, init, {n: first[n] for n in replicated}, comm, self.pooled)
        self.add_module(self.prefix, self.replicas.embedding_bags)  # the replicated tables' parameters
        self.layouts: dict[str, Layout] = {}
        by_kind: dict[tuple[int, str, str], list[str]] = {}
        for name, cfg in tables.items():
            if name in replicated:
                continue
            count = cfg.partitioner if placement.get(name, "row") == "row" else 1
            self.layouts[name] = to_layout(count, (cfg.num_embeddings, cfg.embedding_dim), None, cfg.partition_strategy)
            alone = name if cfg.storage is not None else ""  # a tiered table: a group of its own, over its files
            by_kind.setdefault((cfg.embedding_dim, cfg.mode, alone), []).append(name)
        self.groups: list[list[str]] = list(by_kind.values())
        self.starts: dict[str, int] = {}
        build = {"tables": tables, "placement": placement, "first": first, "init": init, "sparse": sparse,
                 "group": group, "timeout": timeout, "world": world}  # fmt: skip
        self.bags = nn.ModuleList(self._group_table(kind, names, **build) for kind, names in by_kind.items())

    def _group_table(
        self, kind: tuple[int, str, str], names: list[str], *, tables: dict[str, TableConfig], placement: dict,
        first: dict[str, int], init: RowInitializer, sparse: bool, group: Any, timeout: float, world: int,
    ) -> nn.Module:  # fmt: skip
        """The distributed table of one group: its tables' shards end to end, placed on their ranks."""
        dim, mode, alone = kind
        sizes, ranks, numbers, start = [], [], [], 0
        for name in names:
            layout = self.layouts[name]
            self.starts[name] = start
            start += layout.num_rows
            sizes += list(layout.sizes)
            ranks += _ranks(placement.get(name, "row"), layout, list(tables).index(name), world, name)
            numbers += [first[name] + layout.shard_ids(s) for s in range(layout.num_shards)]
        cls, options = (_GroupBag, {"mode": mode}) if self.pooled else (_GroupRows, {})
        if alone:
            table = {"storage": tables[alone].storage, "table_layout": self.layouts[alone]}
            cls, options = TIERED_GROUPS[cls], {**options, **table}
        bag = cls(
            start, dim, Layout.explicit(sizes), sparse=sparse, placement=ranks,
            initializer=_Renumbered(init, torch.cat(numbers)), group=group, timeout=timeout, **options,
        )  # fmt: skip
        if alone:  # named as the local collection's table (its optimizer state and checkpoint too)
            self.replicas.embedding_bags[alone] = bag
        else:
            bag.set_state_dict_form("sharded")  # this rank's shards; tables are saved by the collection
        return bag

    @property
    def embedding_tables(self) -> tuple[str, ...]:
        """Its tables' variables (row-wise and replicated), which a checkpoint records as embedding tables."""
        return tuple(f"{self.prefix}.{name}.weight" for name in self.configs)

    def sharded_variables(self) -> dict[str, ShardedVariable]:
        """Each table as one logical variable, named as in the local collection, in its own layout: this
        rank's shards of it (the group's own tensors) in a store of the table's, so a table optimizer
        keeps one state, and one step count, per table, checkpointed under the table's name."""
        out = {}
        for names, bag in zip(self.groups, self.bags, strict=True):
            if isinstance(bag, TieredTable):  # its own module, ``<prefix>.<table>``, names it
                continue
            local, first = bag.store.local_shards(), 0
            for name in names:
                layout = self.layouts[name]
                mine = {s: local[first + s] for s in range(layout.num_shards) if first + s in local}
                cfg = self.configs[name]
                shape = (cfg.num_embeddings, cfg.embedding_dim)
                store = ShardStore(layout, shape, mine, dtype=bag.store.dtype, adopt=False)  # the group's memory
                out[f"{self.prefix}.{name}.weight"] = ShardedVariable.from_store(store)
                first += layout.num_shards
        return out

    # EmbeddingBagCollection.forward's signature, so `duplicates` pairs the two: a collection and
    # its distributed twin take the same inputs. No rule is repeated past the signature.
    def forward(self, features: Features, offsets: PerFeature = None, per_sample_weights: PerFeature = None) -> Pooled:
        """Bags per feature. Collective: every rank calls it, with every feature of every table.

        A table's features go in one request, so an id two of them hold is sent and fetched once;
        a refusal of any rank's input is every rank's (:func:`lookup_collection`).
        """
        return lookup_collection(self, self.bags, self.replicas, features, offsets, per_sample_weights)


def lookup_collection(
    collection: Any, bags: Any, replicas: Any, features: Any, offsets: Any, per_sample_weights: Any
) -> dict[str, Any]:
    """A distributed collection's lookup (its ``comm``, ``groups``, ``layouts``, ``starts``, ``served``)
    with ``bags`` as its groups' tables and ``replicas`` as its replicated tables: the float collection's,
    or its quantized twin's (packed tables, the same exchange). Every input is checked first, and a
    refusal is every rank's (:func:`._agree.agree`, in the first group's split sizes; in an all_reduce
    of one int when every table is replicated)."""
    try:
        features, replicated, groups = _pack(collection, bags, replicas, features, offsets, per_sample_weights)
    except ShardvarError as e:
        refuse(collection.comm, e, carries_counts=bool(bags))  # in place of the first collective
    if not bags and collection.comm.world > 1:  # no collective in forward to carry the verdicts
        agree(collection.comm, None)
    out: dict[str, torch.Tensor] = replicas(replicated)
    for bag, (present, packed) in zip(bags, groups, strict=True):
        rows, offs, psw, counts = packed
        if not collection.pooled:
            out.update(jagged_split(bag(rows), offs, counts, present))
            continue
        out.update(zip(present, bag(rows, offs, per_sample_weights=psw).split(counts), strict=True))
    return {f: out[f] for f in features}


def _pack(collection: Any, bags: Any, replicas: Any, features: Any, offsets: Any, weights: Any) -> tuple:
    """(ids by output key, the replicated tables' packed inputs, each exchanged group's (keys, packed
    inputs)): every rule of the local collection checked, no collective run."""
    table_of, keys_of = collection.served
    modes = {f: collection.configs[t].mode if collection.pooled else None for f, t in table_of.items()}
    features, offsets, weights = split_inputs(features, offsets, weights, modes, (), keys_of)
    if set(features) != set(modes):
        given = sorted(f for f, keys in keys_of.items() if keys[0] in features)
        raise ShardvarValueError(f"every rank gives every feature {sorted(keys_of)}; got {given}")
    replicated = replicas.pack(features, offsets, weights, table_of)
    groups = []
    layouts, starts = collection.layouts, collection.starts
    for names, bag in zip(collection.groups, bags, strict=True):
        present = [f for f in features if table_of[f] in names]
        groups.append((present, pack(present, table_of, layouts, starts, row_dtype(bag), features, offsets, weights)))
    return features, replicated, groups


class DistributedEmbeddingCollection(DistributedEmbeddingBagCollection):
    """``EmbeddingCollection`` sharded over ranks: each feature's rows as ``JaggedRows``, every table of a
    width served in one exchange per step (the pooled collection's placement, checkpoints and rules).

    Its tables are named ``embeddings.<table>.weight``, as the local ``EmbeddingCollection``'s.
    """

    pooled = False
    prefix = "embeddings"
