"""The tables an optimizer updates, and their state laid out like them.

A *table* is one logical parameter: a sharded one (a ShardedEmbedding's weight, a partitioned
parameter, a ShardedVariable, a distributed table's local shards) or a plain parameter, seen as
one shard. Its state (Adagrad's sums, Adam's moments) is allocated per store group: one tensor
per slab, with each shard's state a view at that shard's rows, so an update runs once per slab,
not once per shard, and the checkpoint saves the state as logical variables in the table's layout.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .._errors import ShardvarTypeError, ShardvarValueError
from .._pages import empty
from ..nn import sharded_parameters
from ..variables import RowTier, ShardedVariable, ShardStore, ShardsView

__all__ = ["Table", "TierTable", "find_tables"]


@dataclass(eq=False)
class Table:
    """A logical parameter the optimizer updates: its store, and its state per slot and group."""

    name: str
    store: ShardStore
    state: dict[str, list[torch.Tensor]] = field(default_factory=dict)  # slot -> one tensor per group
    step: torch.Tensor = field(default_factory=lambda: torch.zeros((), dtype=torch.float64))
    # A parameter every rank holds whole (marked ``replicated``: a distributed collection's replicated
    # table): its state is checkpointed as the parameter is, written once, not as every rank's shard 0.
    whole: bool = False
    row_wise: dict[str, bool] = field(default_factory=dict)  # slot -> one value per row (else per element)

    @property
    def params(self) -> list[torch.Tensor]:
        shards = self.store.local_shards()
        return [shards[s] for s in sorted(shards)]

    def add_slot(self, slot: str, row_wise: bool, fill: float) -> None:
        """Allocate a slot: shaped like the table (element-wise) or one value per row (row-wise)."""
        if row_wise and self.store.layout.axis != 0:
            raise ShardvarValueError(
                f"table {self.name!r} is split along axis {self.store.layout.axis}; a row-wise optimizer needs "
                "tables split by rows (axis 0)"
            )
        tensors = []
        self.row_wise[slot] = row_wise  # a rank holding none of the table's shards has no tensor to tell
        for g, group in enumerate(self.store.groups):
            rows = self.store.group_rows(g)
            shape = (group.rows,) if row_wise else tuple(rows.shape)
            tensors.append(empty(shape, dtype=rows.dtype, device=rows.device).fill_(fill))
        self.state[slot] = tensors

    def checkpointed(self, slot: str) -> ShardsView | torch.Tensor:
        """The slot as the checkpoint takes it: a whole table's state tensor itself (a plain tensor, written
        once in a distributed save), else a sharded object in the table's layout (each rank its shards)."""
        return self.state[slot][0] if self.whole else self.slot_variable(slot)

    def group_tensors(self, g: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The rows of group ``g`` an update reads and writes, and their state by slot."""
        return self.store.group_rows(g), {slot: xs[g] for slot, xs in self.state.items()}

    def slot_variable(self, slot: str) -> ShardsView:
        """The slot as a sharded object in the table's layout (views of the state tensors)."""
        store, layout = self.store, self.store.layout
        shards, row_wise = {}, self.row_wise[slot]
        for g, group in enumerate(store.groups):
            state = self.state[slot][g]
            if not row_wise:
                shards.update(store.split_grad(g, state))  # the same views a slab's gradient splits into
                continue
            for k, s in enumerate(group.members):
                shards[s] = state[group.plan.member_slice(k)]
        shape = (layout.num_rows,) if row_wise else tuple(store.shape)
        return ShardsView(layout, shape, self.store.dtype, shards)


class TierTable(Table):
    """A table whose rows live in a storage tier (``storage=``): updated in its cache's slots, its state
    in the cache's state columns (kept with each row in the backing file). Only a fused update reaches it."""

    def __init__(self, name: str, module: nn.Module) -> None:
        super().__init__(name, None)  # type: ignore[arg-type]  # no store: the tier holds the rows
        self.tier: RowTier = module.tier
        self.anchor: torch.Tensor = module.tiered_rows
        self.layout = module.layout

    @property
    def params(self) -> list[torch.Tensor]:
        return [self.anchor]

    def add_slot(self, slot: str, row_wise: bool, fill: float) -> None:
        self.tier.add_slot(slot, 1 if row_wise else self.tier.values.shape[1], fill)
        self.row_wise[slot] = row_wise
        self.state[slot] = []

    def group_tensors(self, g: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        state = self.tier.state
        columns = self.tier.slot_columns()
        views = {s: state[:, a] if self.row_wise[s] else state[:, a : a + w] for s, (a, w) in columns.items()}
        return self.tier.values, {s: views[s] for s in self.state}

    def checkpointed(self, slot: str) -> ShardsView | torch.Tensor:
        """The slot's column(s) of the backing file, in the table's layout, streamed by a checkpoint."""
        return self.tier.sharded(self.layout, slot, self.row_wise[slot])


def _plain(name: str, p: torch.Tensor) -> Table:
    if not isinstance(p, torch.Tensor) or not p.is_leaf:
        raise ShardvarTypeError(f"parameter {name!r} must be a leaf tensor (an nn.Parameter); got {type(p).__name__}")
    if p.dim() == 0:
        raise ShardvarValueError(f"parameter {name!r} is 0-d; table optimizers update tensors with rows")
    return Table(name, ShardedVariable([p]).store, whole=getattr(p, "replicated", False) is True)


def _from_module(module: nn.Module, prefix: str) -> list[Table]:
    tables, taken = [], set()
    for mod_name, sub in module.named_modules():
        if isinstance(getattr(sub, "tier", None), RowTier):  # a tiered table: its rows are in its tier
            tables.append(TierTable(f"{prefix}{mod_name}.weight" if mod_name else f"{prefix}weight", sub))
            taken.add(id(sub.tiered_rows))
            continue
        for local, value in sharded_parameters(sub, recurse=False).items():
            store = getattr(value, "store", None)
            if store is None:  # a view without a store of its own: its shards are found below, as parameters
                continue
            name = f"{mod_name}.{local}" if mod_name else local
            if getattr(value, "packed", None) is not None:  # the checkpoint protocol's mark of packed rows
                raise ShardvarTypeError(
                    f"table {prefix + name!r} is quantized ({value.packed['dtype']}) and inference-only: an optimizer "
                    "cannot update it; train the float table and quantize it again"
                )
            tables.append(Table(prefix + name, store))
            taken |= {id(p) for p in store.local_shards().values()}
    for name, p in module.named_parameters():
        if id(p) not in taken and p.requires_grad:
            tables.append(_plain(prefix + name, p))
            taken.add(id(p))
    return tables


def _one(item: Any, name: str) -> list[Table]:
    if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str):
        return _one(item[1], item[0])
    if isinstance(item, ShardedVariable):  # before nn.Module: a variable is one (of its shards)
        return [Table(name, item.store)]
    if isinstance(item, nn.Module):  # named: its tables are "<name>.<parameter>"
        return _from_module(item, "" if name.startswith("#") else f"{name}.")
    if isinstance(item, ShardStore):
        return [Table(name, item)]
    if isinstance(item, torch.Tensor):
        return [_plain(name, item)]
    raise ShardvarTypeError(
        f"cannot optimize a {type(item).__name__}: give modules, ShardedVariables, parameters, "
        "(name, parameter) pairs or param-group dicts"
    )


def _items(params: Any, what: str) -> list[Any]:
    if isinstance(params, (nn.Module, ShardedVariable, ShardStore, torch.Tensor)):
        return [params]
    if isinstance(params, (set, frozenset)):  # unnamed tables are numbered in order: a set's changes between runs
        raise ShardvarTypeError(
            f"optimizer parameters need to be organized in ordered collections (a list); got a set as {what}: "
            "its order changes between runs, and with it the tables the saved state is loaded into"
        )
    if isinstance(params, (str, bytes, dict)) or not isinstance(params, Iterable):
        raise ShardvarTypeError(
            f"cannot optimize a {type(params).__name__} given as {what}: give modules, ShardedVariables, parameters, "
            "(name, parameter) pairs or param-group dicts"
        )
    return list(params)


def find_tables(
    params: Any, numbers: Iterator[int] | None = None, existing: Iterable[Table] = ()
) -> list[dict[str, Any]]:
    """Param groups of tables: ``[{"tables": [Table, ...], **options}, ...]``, names unique.

    Every form ``torch.optim`` takes works: modules, parameters (or any iterable of them),
    ``(name, table)`` pairs (``named_parameters()``), and param-group dicts with their own options.
    A table given without a name is named ``#<i>``, ``i`` counting the items given, across groups
    (from ``numbers``, default 0 on); names and parameters must also differ from ``existing`` tables'.
    """
    groups, loose, count = [], [], numbers if numbers is not None else itertools.count()
    for i, item in enumerate(_items(params, "params")):
        if isinstance(item, dict):
            if "params" not in item:
                raise ShardvarValueError(f"param group {i} has no 'params' entry")
            inner = _items(item["params"], f"param group {i}'s 'params'") if item["params"] is not None else []
            tables = [t for x in inner for t in _one(x, f"#{next(count)}")]
            groups.append({**{k: v for k, v in item.items() if k != "params"}, "tables": tables})
        else:
            loose += _one(item, f"#{next(count)}")
    if loose:
        groups.insert(0, {"tables": loose})
    seen: dict[str, Table] = {}
    owner: dict[int, str] = {}
    for t in [*existing, *(t for group in groups for t in group["tables"])]:
        if t.name in seen:
            raise ShardvarValueError(f"two tables are named {t.name!r}; name them with (name, table) pairs")
        for p in t.params:
            if id(p) in owner:
                raise ShardvarValueError(f"table {t.name!r} shares a parameter with {owner[id(p)]!r}")
            owner[id(p)] = t.name
        seen[t.name] = t
    if not seen:
        raise ShardvarValueError(f"the optimizer got no tables to update from params={params!r:.80}")
    return groups
