"""EmbeddingBagCollection: many tables, each sharded by its own layout, looked up in one kernel.

Each table is a ``ShardedEmbeddingBag`` (so its state dict, checkpoints, optimizers and
``.to()`` are a table's), and the shards of all tables with the same width, mode and dtype are
moved into one allocation, back to back (``Tensor.set_``: the Parameters keep their identity).
A forward then shifts each table's ids to its rows in that allocation and runs one
``F.embedding_bag`` over it for every table of the group: the table-batched lookup that makes
26 tables cost one kernel, not 26. If a table's shards move later (``.to(...)``), the group is
looked up table by table.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .._errors import ShardvarTypeError, ShardvarValueError
from .._pages import empty
from .._validate import check_choice, check_int
from ..layout import as_ids, check_ids
from ..variables import ShardedVariable
from ..variables._functional import _check_bag, slab_weight
from ._embedding import ShardedEmbeddingBag

__all__ = ["EmbeddingBagCollection", "TableConfig", "KeyedJagged"]


@dataclass(frozen=True)
class TableConfig:
    """One table of a collection: rows, width, how it is split (a count, partitioner or Layout), pooling."""

    num_embeddings: int
    embedding_dim: int
    partitioner: Any = 1
    partition_strategy: str = "div"
    mode: str = "sum"


@dataclass(frozen=True)
class KeyedJagged:
    """Ids of several features as one jagged batch: ``values`` of key k are ``lengths[k]`` per bag.

    ``lengths`` is ``[len(keys), batch]``; ``weights`` (optional) are per-id weights for sum bags.
    """

    keys: tuple[str, ...]
    values: torch.Tensor
    lengths: torch.Tensor
    weights: torch.Tensor | None = None

    def split(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """Per key: (ids, offsets, weights)."""
        lengths = torch.as_tensor(self.lengths)
        if lengths.dim() != 2 or lengths.shape[0] != len(self.keys):
            raise ShardvarValueError(f"lengths must be [{len(self.keys)} keys, batch]; got {list(lengths.shape)}")
        per_key = lengths.sum(1).tolist()
        if sum(per_key) != self.values.numel():
            raise ShardvarValueError(f"lengths add up to {sum(per_key)} ids; values holds {self.values.numel()}")
        ids = dict(zip(self.keys, self.values.split(per_key), strict=True))
        offsets = {k: torch.cumsum(row, 0) - row for k, row in zip(self.keys, lengths, strict=True)}
        weights = {} if self.weights is None else dict(zip(self.keys, self.weights.split(per_key), strict=True))
        return ids, offsets, weights


def _as_bags(name: str, ids: Any, offsets: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """1-D ids and checked offsets (a bad offset would otherwise reach into another table's ids)."""
    ids = as_ids(ids)
    try:
        checked = _check_bag(ids, offsets, include_last_offset=False)
    except ShardvarValueError as e:
        raise ShardvarValueError(f"feature {name!r}: {e}") from None
    if checked is None:  # [bags, ids per bag]
        return ids.reshape(-1), torch.arange(ids.shape[0], device=ids.device) * ids.shape[1]
    return ids, checked


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
        if not isinstance(tables, dict) or not tables:
            raise ShardvarTypeError(f"tables must be a non-empty dict of name -> TableConfig; got {tables!r:.80}")
        for name, cfg in tables.items():
            if not isinstance(cfg, TableConfig):
                raise ShardvarTypeError(f"table {name!r} must be a TableConfig; got {type(cfg).__name__}")
            check_choice(cfg.mode, "mode", ("sum", "mean", "max"))
            if cfg.mode == "max" and sparse:
                raise ShardvarValueError(
                    f"table {name!r}: mode 'max' has no sparse gradient (torch's rule); use sum or mean"
                )
            check_int(cfg.embedding_dim, "embedding_dim", minimum=1)
        self.embedding_bags = nn.ModuleDict(
            {
                name: ShardedEmbeddingBag(
                    cfg.num_embeddings,
                    cfg.embedding_dim,
                    cfg.partitioner,
                    cfg.partition_strategy,
                    mode=cfg.mode,
                    sparse=sparse,
                    dtype=dtype,
                )
                for name, cfg in tables.items()
            }
        )
        self._groups = batch_tables(self.embedding_bags)

    def forward(
        self,
        features: dict[str, Any] | KeyedJagged,
        offsets: dict[str, Any] | None = None,
        per_sample_weights: dict[str, Any] | None = None,
    ) -> dict[str, torch.Tensor]:
        """Bags per feature: ``{name: [bags, dim]}`` (``concat`` joins them for the dense layers)."""
        return lookup_tables(self.embedding_bags, self._groups, features, offsets, per_sample_weights)

    @staticmethod
    def concat(pooled: dict[str, torch.Tensor]) -> torch.Tensor:
        """The bags of every feature side by side, ``[batch, sum of dims]``, in the dict's order."""
        return torch.cat(list(pooled.values()), dim=1)


def _batchable(bag: ShardedEmbeddingBag) -> bool:
    """Looked up with other tables in one kernel: no option that needs the table's own call."""
    plain = bag.padding_idx is None and bag.max_norm is None and not bag.scale_grad_by_freq
    return plain and not bag.include_last_offset and bag.layout.axis == 0


def batch_tables(bags: Mapping[str, ShardedEmbeddingBag]) -> list[tuple[list[str], ShardedVariable | None]]:
    """Move the shards of the tables of each (width, mode, dtype, sparse) into one allocation.

    Tables with an option only their own call applies (padding_idx, max_norm, ...) stay apart
    (group variable None) and are looked up by their own forward.
    """
    by_kind: dict[tuple, list[str]] = {}
    groups: list[tuple[list[str], ShardedVariable | None]] = []
    for name, bag in bags.items():
        if not _batchable(bag):
            groups.append(([name], None))
            continue
        by_kind.setdefault((bag.embedding_dim, bag.mode, bag.store.dtype, bag.sparse), []).append(name)
    for (dim, _, dtype, _), names in by_kind.items():
        shards = [p for n in names for p in bags[n].shards]
        device = shards[0].device
        if any(p.device != device for p in shards):
            groups += [([n], None) for n in names]  # tables on several devices: one by one
            continue
        slab = empty((sum(p.shape[0] for p in shards), dim), dtype=dtype, device=device)
        start = 0
        with torch.no_grad():
            for p in shards:
                slab[start : start + p.shape[0]].copy_(p)
                p.set_(slab.untyped_storage(), start * dim, p.shape, p.stride())
                start += p.shape[0]
        groups.append((names, ShardedVariable(shards)))
    return groups


def lookup_tables(
    bags: Mapping[str, ShardedEmbeddingBag],
    groups: list[tuple[list[str], ShardedVariable | None]],
    features: Any,
    offsets: dict[str, Any] | None,
    per_sample_weights: dict[str, Any] | None,
) -> dict[str, torch.Tensor]:
    """Bags of each feature, one kernel per group of :func:`batch_tables`; everything checked first."""
    if isinstance(features, KeyedJagged):
        if offsets is not None or per_sample_weights is not None:
            raise ShardvarValueError("a KeyedJagged carries its own lengths and weights")
        features, offsets, per_sample_weights = features.split()
    if not isinstance(features, dict):
        raise ShardvarTypeError(
            f"features must be a dict of name -> ids, or a KeyedJagged; got {type(features).__name__}"
        )
    unknown = sorted(set(features) - set(bags), key=str)
    if unknown:
        raise ShardvarValueError(f"no table named {unknown}; the tables are {list(bags)}")
    offsets, weights = offsets or {}, per_sample_weights or {}
    out: dict[str, torch.Tensor] = {}
    for names, variable in groups:
        present = [n for n in names if n in features]
        if present:
            out.update(_lookup_group(bags, present, names, variable, features, offsets, weights))
    return {n: out[n] for n in features}


def _lookup_group(
    tables: Mapping[str, ShardedEmbeddingBag],
    present: list[str],
    names: list[str],
    variable: ShardedVariable | None,
    features: dict,
    offsets: dict,
    weights: dict,
) -> dict[str, torch.Tensor]:
    bags = [tables[n] for n in present]
    store = variable.store if variable is not None else None
    if store is None or store.full_slab is None:  # a table apart, or its shards moved: one by one
        return {
            n: b(*_as_bags(n, features[n], offsets.get(n)), per_sample_weights=weights.get(n))
            for n, b in zip(present, bags, strict=True)
        }
    starts = dict(zip(names, _starts(tables, names), strict=True))
    layouts = {n: b.layout for n, b in zip(present, bags, strict=True)}
    rows, offs, psw, counts = pack(present, layouts, starts, bags[0].mode, store.dtype, features, offsets, weights)
    pooled = F.embedding_bag(
        rows, slab_weight(store), offs, mode=bags[0].mode, sparse=bags[0].sparse, per_sample_weights=psw
    )
    return dict(zip(present, pooled.split(counts), strict=True))


def pack(
    names: list[str],
    layouts: dict[str, Any],
    starts: dict[str, int],
    mode: str,
    dtype: torch.dtype,
    features: dict,
    offsets: dict,
    weights: dict,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, list[int]]:
    """Tables' bags as one: (rows of the shared allocation, offsets, weights or None, bags per table).

    Table ``n``'s id ``i`` is row ``starts[n] + storage_row(i)``; each table's ids are checked
    against its own rows (valid in the allocation is not enough) and its offsets against its ids.
    """
    weighted = [n in weights for n in names]
    if any(weighted) and (not all(weighted) or mode != "sum"):
        raise ShardvarValueError(
            f"per_sample_weights go with mode 'sum' and every feature of tables {names} (mode {mode!r}); "
            f"got them for {[n for n in names if n in weights]}"
        )
    rows, offs, psw, counts, total = [], [], [], [], 0
    for n in names:
        ids, off = _as_bags(n, features[n], offsets.get(n))
        layout = layouts[n]
        check_ids(ids, layout.num_rows)
        rows.append(starts[n] + layout.strategy.storage_rows(layout.sizes, ids))
        offs.append(off + total)
        counts.append(off.numel())
        total += ids.numel()
        if n in weights:
            w = torch.as_tensor(weights[n], dtype=dtype).reshape(-1)
            if w.numel() != ids.numel():
                raise ShardvarValueError(f"feature {n!r}: {w.numel()} per_sample_weights for {ids.numel()} ids")
            psw.append(w)
    return torch.cat(rows), torch.cat(offs), torch.cat(psw) if psw else None, counts


def _starts(tables: Mapping[str, ShardedEmbeddingBag], names: list[str]) -> list[int]:
    out, start = [], 0
    for n in names:
        out.append(start)
        start += tables[n].num_embeddings
    return out
