"""EmbeddingBagCollection: many tables, each sharded by its own layout, looked up in one kernel.

Each table is a ``ShardedEmbeddingBag`` (so its state dict, checkpoints, optimizers and
``.to()`` are a table's), and the shards of all tables with the same width, mode and dtype are
moved into one allocation, back to back (``Tensor.set_``: the Parameters keep their identity).
A forward then shifts each table's ids to its rows in that allocation and runs one
``F.embedding_bag`` over it for every table of the group: the table-batched lookup that makes
26 tables cost one kernel, not 26. A sparse sum or mean group (the training path whose backward
sums each row's gradient, :mod:`..variables._bag_grad`) instead gives each table's ids and offsets as they
are to a kernel over the table's rows of the allocation (:mod:`._pooled`): shifting and packing
every feature's ids cost more than the kernels they save. If a table's shards move later
(``.to(...)``), the group is looked up table by table.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from .._errors import ShardvarError, ShardvarTypeError, ShardvarValueError
from ..layout import Layout, as_ids
from ..variables import ShardedVariable, as_slab, embedding_bag_rows, embedding_rows, lay_out, slab_weight
from ._collection_build import FeatureMap, TableConfig, build_tables, check_tables, feature_map
from ._embedding import ShardedEmbedding, ShardedEmbeddingBag
from ._jagged import Features, KeyedJagged, PerFeature, Pooled, jagged_split
from ._pack import feature_bags, pack
from ._pooled import sparse_pooled
from ._tiered import TieredTable

__all__ = ["EmbeddingBagCollection", "TableConfig", "KeyedJagged", "pack"]

Table = ShardedEmbedding | ShardedEmbeddingBag  # a pooled collection's tables are bags, a sequence one's not


class EmbeddingBagCollection(nn.Module):
    """Named ``ShardedEmbeddingBag`` tables looked up together: ``ebc({"user": ids, ...}) -> {"user": bags}``.

    >>> ebc = EmbeddingBagCollection({"a": TableConfig(10, 4, 2, "mod"), "b": TableConfig(7, 4, 3)})
    >>> out = ebc({"a": torch.tensor([[1, 2], [3, 4]]), "b": torch.tensor([[0, 6], [5, 5]])})
    >>> {k: tuple(v.shape) for k, v in out.items()}, list(ebc.state_dict())
    ({'a': (2, 4), 'b': (2, 4)}, ['embedding_bags.a.weight', 'embedding_bags.b.weight'])
    """

    def __init__(
        self, tables: dict[str, TableConfig], *, sparse: bool = False, dtype: torch.dtype | None = None
    ) -> None:
        super().__init__()
        check_tables(tables, sparse, pooled=True)
        self.served = feature_map(tables)
        self.feature_tables = self.served.tables  # each output key's table

        def make(cfg: TableConfig, store: Any) -> ShardedEmbeddingBag:
            return ShardedEmbeddingBag(
                cfg.num_embeddings, cfg.embedding_dim, cfg.partitioner, cfg.partition_strategy, mode=cfg.mode,
                sparse=sparse, dtype=dtype, _store=store, storage=cfg.storage,
            )  # fmt: skip

        self.embedding_bags = nn.ModuleDict(build_tables(tables, make, dtype))
        self._groups = batch_tables(self.embedding_bags)

    def forward(self, features: Features, offsets: PerFeature = None, per_sample_weights: PerFeature = None) -> Pooled:
        """Bags per feature: ``{feature: [bags, dim]}`` (``concat`` joins them for the dense layers); a feature
        several tables serve gives bags per table, ``{feature@table: ...}`` (:func:`feature_map`).

        The features of one table are looked up together, in one kernel with the other tables of
        its group: a table's rows are read once per call, however many features it serves.
        """
        groups, served = self._groups, self.served
        return lookup_tables(self.embedding_bags, groups, features, offsets, per_sample_weights, served)

    def _apply(self, fn: Any, recurse: bool = True) -> EmbeddingBagCollection:
        super()._apply(fn, recurse)
        self._groups = batch_tables(self.embedding_bags)  # see batch_tables: a move splits the groups
        return self

    @staticmethod
    def concat(pooled: dict[str, torch.Tensor]) -> torch.Tensor:
        """The bags of every feature side by side, ``[batch, sum of dims]``, in the dict's order."""
        return torch.cat(list(pooled.values()), dim=1)


def _batchable(bag: Table) -> bool:
    """Looked up with other tables in one kernel: no option that needs the table's own call."""
    plain = bag.padding_idx is None and bag.max_norm is None and not bag.scale_grad_by_freq
    plain = plain and not isinstance(bag, TieredTable)  # its rows are in its tier: its own lookup
    return plain and not getattr(bag, "include_last_offset", False) and bag.layout.axis == 0


def batch_tables(bags: Mapping[str, Table]) -> list[tuple[list[str], ShardedVariable | None]]:
    """Move the shards of the tables of each (width, pooling mode, dtype, sparse) into one allocation.

    Called again after ``module.to()`` / ``.cuda()`` / ``.double()``: torch moves each shard into
    memory of its own, which would leave every table to its own lookup (and its own checks: on a
    GPU each waits for the device); the group's allocation is made again on the new device.

    Tables with an option only their own call applies (padding_idx, max_norm, ...) stay apart
    (group variable None) and are looked up by their own forward.
    """
    by_kind: dict[tuple, list[str]] = {}
    groups: list[tuple[list[str], ShardedVariable | None]] = []
    for name, bag in bags.items():
        if not _batchable(bag):
            groups.append(([name], None))
            continue
        by_kind.setdefault((bag.embedding_dim, getattr(bag, "mode", None), bag.store.dtype, bag.sparse), []).append(
            name
        )
    for names in by_kind.values():
        shards = [p for n in names for p in bags[n].weight.variables]
        device = shards[0].device
        if any(p.device != device for p in shards):
            groups += [([n], None) for n in names]  # tables on several devices: one by one
            continue
        if as_slab(list(shards)) is None or not all(bags[n].store.rows_as_kept for n in names):
            # Not built in one allocation: table after table, each table's shards back to back, or row by
            # row where a fused optimizer keeps them so (``store.interleaved``).
            lay_out([(bags[n].weight.variables, bags[n].store.interleaved) for n in names])
            for n in names:  # each table's store lets go of its own allocation: the tables are held once
                bags[n].store.refresh()
        variable = ShardedVariable(shards)
        for n in names:  # the stores over the group's memory: a fused optimizer moves rows only if none else is
            bags[n].store.attach(companions=(variable._store, *(bags[m].store for m in names if m != n)))
        groups.append((names, variable))
    return groups


def lookup_tables(
    bags: Mapping[str, Table],
    groups: list[tuple[list[str], ShardedVariable | None]],
    features: Any,
    offsets: dict[str, Any] | None,
    per_sample_weights: dict[str, Any] | None,
    served: FeatureMap | None = None,
) -> dict[str, torch.Tensor]:
    """The result of each output key of ``served`` (:func:`feature_map`; default: each table serves the
    feature of its name) whose feature is given, one kernel per group of :func:`batch_tables`;
    everything checked first."""
    table_of, keys_of = served if served is not None else ({n: n for n in bags}, None)
    modes = {k: pooling(bags[t]) for k, t in table_of.items()}
    last = () if not isinstance(features, KeyedJagged) else [k for k, t in table_of.items() if _reads_end(bags[t])]
    features, offsets, weights = split_inputs(features, offsets, per_sample_weights, modes, last, keys_of)
    out: dict[str, torch.Tensor] = {}
    for names, variable in _reading_first(bags, groups, table_of, (features, offsets, weights)):
        present = [f for f in features if table_of[f] in names]
        if present:
            out.update(_lookup_group(bags, present, table_of, names, variable, (features, offsets, weights)))
    return {f: out[f] for f in features}


def _reads_end(table: Table) -> bool:
    """Whether the table reads its bags' offsets with the ids' end last (``include_last_offset``)."""
    return getattr(table, "include_last_offset", False)


def _reading_first(
    tables: Mapping[str, Table], groups: list, table_of: Mapping[str, str], inputs: tuple[dict, dict, dict]
) -> list:
    """The groups, those whose lookup writes its table (``max_norm`` renormalises rows) last, their features
    checked before any group runs: a refused input leaves every table as it was."""
    writing = [
        i for i, (n, v) in enumerate(groups) if v is None and getattr(tables[n[0]], "max_norm", None) is not None
    ]
    if not writing:
        return groups
    for f in inputs[0]:
        t = table_of[f]
        if any(t in groups[i][0] for i in writing):
            feature_bags(f, inputs, tables[t].layout.num_rows, row_dtype(tables[t]))
    return [g for i, g in enumerate(groups) if i not in writing] + [groups[i] for i in writing]


def row_dtype(table: Any) -> torch.dtype:
    """The dtype of the rows a table's lookup returns, which its per_sample_weights take (torch's rule): its
    store's, or what a table of stored bytes (a packed one, ``lookup_dtype``) dequantizes them to."""
    return getattr(table, "lookup_dtype", None) or table.store.dtype


def pooling(table: Table) -> str | None:
    """How a table pools its bags (its ``mode``), or None for a table that returns every id's row."""
    return getattr(table, "mode", None)


def split_inputs(
    features: Any,
    offsets: Any,
    per_sample_weights: Any,
    modes: Mapping[str, str | None],
    last_offset: Sequence[str] = (),
    keys_of: Mapping[str, Sequence[str]] | None = None,
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """(ids, offsets, weights) by output key, from dicts or a KeyedJagged given by feature, checked against
    each key's table's mode (``modes``; None: a table that does not pool).

    A feature's output keys are ``keys_of[feature]`` (None: each key of ``modes`` is a feature's;
    :func:`feature_map`): a feature several tables serve is given once and each of its keys gets
    its tensors (the same objects: its ids are read once per table). Keys come in the order of the
    features given, a feature's keys in the collection's order. A KeyedJagged's offsets of the keys
    in ``last_offset`` end with the ids' end, as their tables read them (``include_last_offset``),
    as offsets given in a dict do. Whatever the grouping of the tables, weights given for some
    features weight those and the others pool unweighted; offsets or weights for a feature without
    ids are refused.
    """
    if isinstance(features, KeyedJagged):
        if offsets is not None or per_sample_weights is not None:
            raise ShardvarValueError(
                f"a KeyedJagged carries its own lengths and weights; got offsets={offsets!r:.40} and "
                f"per_sample_weights={per_sample_weights!r:.40} besides: leave them out"
            )
        features, offsets, per_sample_weights = features.split()
    if not isinstance(features, dict):
        raise ShardvarTypeError(
            f"features must be a dict of name -> ids, or a KeyedJagged; got {type(features).__name__}"
        )
    names = keys_of if keys_of is not None else modes
    unknown = sorted(set(features) - set(names), key=str)
    if unknown:
        raise ShardvarValueError(f"no feature named {unknown}; the features are {list(names)}")
    given = {"offsets": offsets or {}, "per_sample_weights": per_sample_weights or {}}
    for what, by_name in given.items():
        if not isinstance(by_name, dict):
            raise ShardvarTypeError(f"{what} must be a dict of name -> tensor; got {type(by_name).__name__}")
        stray = sorted(set(by_name) - set(features), key=str)
        if stray:
            raise ShardvarValueError(f"{what} given for {stray}, which have no ids; the features are {list(features)}")
    offsets, weights = given.values()
    if keys_of is not None and len(keys_of) != len(modes):  # a feature several tables serve: under each key
        features, offsets, weights = (_by_key(x, features, keys_of) for x in (features, offsets, weights))
    for k in set(last_offset) & offsets.keys():  # a new tensor: another key of the feature keeps its own
        offsets[k] = torch.cat([offsets[k], offsets[k].new_tensor([features[k].numel()])])
    for k in weights:
        if modes[k] is None:
            raise ShardvarValueError(f"feature {k!r} is not pooled (an EmbeddingCollection's): it takes no weights")
        if modes[k] != "sum":
            raise ShardvarValueError(
                f"per_sample_weights go with mode 'sum' (torch's rule); feature {k!r} has mode {modes[k]!r}"
            )
    return features, offsets, weights


def _by_key(by_feature: dict[str, Any], features: dict[str, Any], keys_of: Mapping[str, Sequence[str]]) -> dict:
    """Each feature's tensor under each of its keys, in the order of ``features`` (as given)."""
    return {k: by_feature[f] for f in features if f in by_feature for k in keys_of[f]}


def _lookup_group(
    tables: Mapping[str, Table],
    present: list[str],
    table_of: Mapping[str, str],
    names: list[str],
    variable: ShardedVariable | None,
    inputs: tuple[dict, dict, dict],
) -> dict[str, torch.Tensor]:
    for n in names:  # shards moved one by one (``p.data = ...``): a table kept row by row (its optimizer
        if tables[n]._store.interleaved:  # state in that order) adopts them so, before the group would
            tables[n].store.refresh()  # adopt them back to back
    store = variable.store if variable is not None else None
    if store is None or store.full_slab is None:  # a table apart, or its shards moved: table by table
        return {f: x for n in names for f, x in _lookup_table(tables[n], n, present, table_of, inputs).items()}
    starts = dict(zip(names, _starts(tables, names), strict=True))
    place = {n: i for i, n in enumerate(names)}  # each table's features together, tables in row order
    present = sorted(present, key=lambda f: place[table_of[f]])
    table = tables[names[0]]
    if pooling(table) is not None and table.sparse and table.mode != "max":  # table by table, summed per row
        return sparse_pooled(tables, names, present, table_of, starts, store, inputs)
    # A table whose rows are its ids (see ShardStore.logical_slab) is packed as one shard: no arithmetic.
    layouts = {n: tables[n].layout if not tables[n].store.logical_slab else _one_shard(tables[n]) for n in names}
    narrow = store.full_slab.shape[0] <= torch.iinfo(torch.int32).max  # 32-bit rows: half the bytes to move and keep
    index = torch.int32 if narrow else torch.int64
    packed = pack(present, table_of, layouts, starts, store.dtype, *inputs, index=index, recycler=store.recycler)
    rows, offs, psw, counts = packed
    weight = slab_weight(store)
    if pooling(table) is None:  # a sequence collection: every id's row, bag by bag
        return jagged_split(embedding_rows(rows, weight, sparse=table.sparse), offs, counts, present)
    pooled = embedding_bag_rows(rows, weight, offs, mode=table.mode, per_sample_weights=psw, sparse=table.sparse)
    return dict(zip(present, pooled.split(counts), strict=True))


def _lookup_table(
    table: Table, name: str, present: list[str], table_of: Mapping[str, str], inputs: tuple[dict, dict, dict]
) -> dict[str, Any]:
    """The result of a table's features by its own forward: one call for all of them."""
    mine = [f for f in present if table_of[f] == name]
    features, offsets, weights = inputs
    if not mine:
        return {}
    pooled = pooling(table) is not None
    if len(mine) == 1 and pooled:  # as given: 2-D ids, offsets as the table reads them (include_last_offset)
        f = mine[0]
        try:
            as_ids(features[f])  # the collection's ids (a table alone also takes nested ones)
            return {f: table(features[f], offsets.get(f), per_sample_weights=weights.get(f))}
        except ShardvarError as e:  # checked by the table's forward before its lookup, by the same rules
            raise type(e)(f"feature {f!r}: {e}") from None
    logical = {name: _one_shard(table)}  # the table's own ids: its forward finds their shards
    ids, offs, psw, counts = pack(mine, table_of, logical, {name: 0}, row_dtype(table), *inputs)
    if not pooled:
        return jagged_split(table(ids), offs, counts, mine)
    return dict(zip(mine, table(ids, offs, per_sample_weights=psw).split(counts), strict=True))


def _one_shard(table: Table) -> Layout:
    return Layout.div(table.num_embeddings, 1)


def _starts(tables: Mapping[str, Table], names: list[str]) -> list[int]:
    out, start = [], 0
    for n in names:
        out.append(start)
        start += tables[n].num_embeddings
    return out
