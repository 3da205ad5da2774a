"""TableOptimizer: a torch.optim.Optimizer whose updates run once per slab of each table.

Sparse gradients (``sparse=True`` tables): the shards' gradients of a slab are joined into slab
rows and summed per distinct row once; only those rows of the weight and of the state are read,
updated and written back. Dense gradients: the update runs in place on the whole slab (the
shards' gradients are joined into one slab gradient first). Everything is checked before any
table changes. ``param_groups`` carry the options, so learning-rate schedulers work.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any, ClassVar

import torch

from .._errors import ShardvarError, ShardvarIndexError, ShardvarTypeError, ShardvarValueError
from .._pages import zeros, zeros_like
from .._validate import check_number
from ..variables import ShardsView
from ._kernel import Rule, rowwise
from ._tables import Table, find_tables

__all__ = ["TableOptimizer", "Update"]

# rule(weight rows, {slot: state rows}, gradient rows, step, options, sparse): updates in place
Update = Callable[[torch.Tensor, dict[str, torch.Tensor], torch.Tensor, int, dict[str, Any], bool], None]


def _check_rows(table: Table, shards: list[int], rows: list[torch.Tensor]) -> None:
    """Every shard's gradient rows lie inside it: one read of all their bounds (on a GPU, one wait)."""
    found = [(s, r) for s, r in zip(shards, rows, strict=True) if r.numel()]
    if not found:
        return
    bounds = torch.stack([torch.stack(r.aminmax()) for _, r in found]).tolist()
    for (s, _), (low, high) in zip(found, bounds, strict=True):
        if low < 0 or high >= table.store.layout.sizes[s]:
            raise ShardvarIndexError(
                f"table {table.name!r}: shard {s} has a sparse gradient for rows {low}..{high}, "
                f"outside its {table.store.layout.sizes[s]} rows"
            )


def _summed(rows: torch.Tensor, values: torch.Tensor, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct ``rows`` and their summed ``values``; ``keys`` (the rows member by member, in member
    order) ascend when every member's rows are distinct: nothing to add then (a collection's gradient
    is summed per row)."""
    if rows.numel() < 2 or bool((keys[1:] > keys[:-1]).all()):
        return rows, values
    unique, inverse = torch.unique(rows, return_inverse=True)
    out = zeros((unique.numel(), values.shape[1]), dtype=values.dtype, device=values.device)
    return unique, out.index_add_(0, inverse, values)


def sparse_group_grad(
    table: Table, g: int, grads: dict[int, torch.Tensor | None], summed: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """(slab rows, gradient rows) of group ``g`` from sparse gradients of its members (by member position).

    Members whose rows are distinct and ascending each (a collection's) give distinct rows: nothing
    to sum then, whether the members lie back to back or row by row.
    """
    group = table.store.groups[g]
    given = [(k, x) for k, x in sorted(grads.items()) if x is not None]
    local = [x._indices()[0] for _, x in given]
    _check_rows(table, [group.members[k] for k, _ in given], local)
    width, plan = table.store.width, group.plan
    rows = torch.cat([plan.to_group(k, r) for (k, _), r in zip(given, local, strict=True)])
    values = torch.cat([x._values().reshape(r.numel(), width) for (_, x), r in zip(given, local, strict=True)])
    if not summed:
        return rows, values
    if not plan.interleaved:
        return _summed(rows, values, rows)  # back to back: the rows are their own keys
    keys = torch.cat([plan.to_member_major(k, r) for (k, _), r in zip(given, local, strict=True)])
    return _summed(rows, values, keys)


def _slab_grad(table: Table, g: int, summed: bool = True) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(distinct slab rows, their summed gradient) when sparse, (None, dense slab gradient), or (None, None).

    ``summed=False`` keeps duplicate rows (for linear updates, which ``index_add_`` applies directly).
    """
    store = table.store
    group = store.groups[g]
    shards = store.local_shards()
    grads = [shards[s].grad for s in group.members]
    if all(x is None for x in grads):
        return None, None
    if any(x is not None and x.is_sparse for x in grads):
        return sparse_group_grad(table, g, dict(enumerate(grads)), summed)
    dense = zeros_like(store.group_rows(g))
    for view, x in zip(store.split_grad(g, dense).values(), grads, strict=True):
        if x is not None:
            view.copy_(x)
    return None, dense


class TableOptimizer(torch.optim.Optimizer):
    """Base of shardvar's optimizers: subclasses give ``slots`` and ``update``."""

    slots: ClassVar[dict[str, tuple[bool, str | float]]] = {}  # slot -> (row-wise, initial value or option)
    update: Update

    def __init__(self, params: Any, defaults: dict[str, Any]) -> None:
        self._check_options(defaults)
        self._groups_tables: list[list[Table]] = []
        numbers = itertools.count()  # "#<i>" of the tables given without a name, counted on by add_param_group
        self._found = find_tables(params, numbers)  # torch's __init__ hands them to add_param_group one by one
        self._next_number = next(numbers)
        super().__init__([{"params": []} for _ in self._found], defaults)
        del self._found

    _fused: Any = None  # the FusedHandle while fused
    _next_number = 0  # the number of the next table given without a name

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """``torch.optim``'s: the group's tables (unnamed ones numbered on), its options checked, its state
        made (and fused, if the optimizer is). Refused with nothing changed if an option is bad or a table
        is optimized already."""
        numbers = itertools.count(self._next_number)
        if self.__dict__.get("_found"):  # one of __init__'s groups, found with the others
            group = self._found.pop(0)
        elif not isinstance(param_group, dict):
            raise ShardvarTypeError(f"param_group must be a dict with 'params'; got {type(param_group).__name__}")
        else:
            [group] = find_tables([param_group], numbers, self.tables)
        options = {k: v for k, v in group.items() if k != "tables"}
        super().add_param_group({**options, "params": [p for t in group["tables"] for p in t.params]})
        try:  # the group's own options, before any state exists
            self._check_options(self.param_groups[-1])
        except ShardvarError as e:
            self.param_groups.pop()
            raise type(e)(f"param group {len(self.param_groups)}: {e}") from None
        self._groups_tables.append(group["tables"])
        self._next_number = next(numbers)
        self._add_slots()
        if self._fused is not None:
            self._fused.attach(group["tables"], self.param_groups[-1])

    def _add_slots(self) -> None:
        """Every table gets the state the groups need and it lacks (SGD's buffers once a group has momentum)."""
        self.slots = self.needed_slots()
        for tables, group in zip(self._groups_tables, self.param_groups, strict=True):
            for t in tables:
                for slot, (row_wise, fill) in self.slots.items():
                    if slot not in t.state:
                        t.add_slot(slot, row_wise, float(group[fill] if isinstance(fill, str) else fill))

    def __getstate__(self) -> dict[str, Any]:  # torch's keeps only defaults, state and param_groups
        return self.__dict__.copy()

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def linear(self, group: dict[str, Any]) -> bool:
        """Whether the update is ``weight -= lr * grad`` (sparse rows then need no summing)."""
        return False

    def native_rule(self, state: dict[str, torch.Tensor], group: dict, step: int) -> tuple[Rule, torch.Tensor] | None:
        """The native kernels' form of this optimizer's update at ``step`` and the row-wise state it updates
        (``optim._kernel``), or None: the torch ops run."""
        return None

    def update_rows(self, weight: torch.Tensor, state: dict[str, torch.Tensor], rows: torch.Tensor | None,
                    grad: torch.Tensor, group: dict, step: int) -> bool:  # fmt: skip
        """Update the distinct ``rows`` (None: all) of ``weight`` and ``state`` in place in one native pass over
        them, or return False (nothing changed): no kernel for this rule or these tensors, so the torch ops run."""
        kernel, found = rowwise(), self.native_rule(state, group, step)
        if kernel is None or found is None:
            return False
        return kernel.rows(found[0], weight, found[1], rows, grad)  # dense: every row, a sparse step's arithmetic

    def update_bags(self, weight: torch.Tensor, state: dict[str, torch.Tensor], ids: torch.Tensor,
                    offsets: torch.Tensor, grad: torch.Tensor, group: dict,
                    step: int) -> Callable[[], None] | None:  # fmt: skip
        """The update of the rows of ``weight`` (and ``state``) that the sum bags ``(ids, offsets)`` read, each with
        the sum of its bags' ``grad``, in one native pass: a job to run on any thread (the tables of a
        collection are updated at once); None: no such kernel here."""
        kernel, found = rowwise(), self.native_rule(state, group, step)
        if kernel is None or found is None:
            return None
        return kernel.bags(found[0], weight, found[1], ids, offsets, grad)

    def needed_slots(self) -> dict[str, tuple[bool, str | float]]:
        """The state every table gets (SGD's momentum buffer only if a group has momentum)."""
        return dict(self.slots)

    def _check_options(self, group: dict[str, Any]) -> None:
        """Check one param group's options (or the defaults); subclasses add their own options."""
        check_number(group["lr"], "lr", minimum=0)
        check_number(group.get("weight_decay", 0.0), "weight_decay", minimum=0)

    @property
    def tables(self) -> list[Table]:
        return [t for tables in self._groups_tables for t in tables]

    def sharded_variables(self) -> dict[str, ShardsView | torch.Tensor]:
        """Every table's state as logical variables (``<table>/<slot>``) and step counts, for checkpoints."""
        out: dict[str, ShardsView | torch.Tensor] = {}
        for t in self.tables:
            for slot in self.slots:
                out[f"{t.name}/{slot}"] = t.checkpointed(slot)
            # a table held elsewhere only: a rank that steps it saves its step count (a tiered one: held here)
            if t.store is None or t.store.local_shards():
                out[f"{t.name}/step"] = t.step
        return out

    @property
    def state_bytes(self) -> int:
        return sum(x.numel() * x.element_size() for t in self.tables for xs in t.state.values() for x in xs)

    def _plan(self) -> list[tuple[Table, dict[str, Any], int, torch.Tensor | None, torch.Tensor]]:
        work = []
        for tables, group in zip(self._groups_tables, self.param_groups, strict=True):
            self._check_options(group)
            for t in tables:
                if t.store is None:  # a tiered table: updated only in backward, by a fused optimizer
                    continue
                for g in range(len(t.store.groups)):
                    rows, grad = _slab_grad(t, g, summed=not self.linear(group))
                    if grad is not None:
                        work.append((t, group, g, rows, grad))
        return work

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        work = self._plan()  # every table's gradient joined (and checked) before any is changed
        stepped = {id(t): t for t, *_ in work}
        for t in stepped.values():
            t.step += 1
        for t, group, g, rows, grad in work:
            self._apply(t, group, g, rows, grad, int(t.step), rows is not None)
        return loss

    def _apply(
        self, t: Table, group: dict, g: int, rows: torch.Tensor | None, grad: torch.Tensor, step: int, sparse: bool
    ) -> None:
        """Update group ``g`` of table ``t``: the whole slab (``rows`` None) or those slab rows."""
        weight, state = t.group_tensors(g)
        if sparse and self.linear(group):  # duplicates add up in the update itself, as torch's sparse add_ does
            weight.index_add_(0, rows, grad, alpha=-group["lr"])
            return
        if self.update_rows(weight, state, rows, grad, group, step):  # every path the same arithmetic, where it can
            return
        if rows is None:  # dense: in place on the slab and its state
            self.update(weight, state, grad, step, group, False)
            return
        w = weight.index_select(0, rows)
        s = {slot: x.index_select(0, rows) for slot, x in state.items()}
        self.update(w, s, grad, step, group, sparse)
        weight.index_copy_(0, rows, w)
        for slot, x in state.items():
            x.index_copy_(0, rows, s[slot])

    def _update_sparse(self, t: Table, group: dict, g: int, grads: dict[int, torch.Tensor], step: int) -> None:
        """Update group ``g`` of table ``t`` from its members' sparse gradients (by member position)."""
        rows, values = sparse_group_grad(t, g, grads, summed=not self.linear(group))
        self._apply(t, group, g, rows, values, step, True)

    def _update_member(self, t: Table, group: dict, g: int, k: int, step: int) -> None:
        """Update member ``k`` of group ``g`` from its own gradient (the fused path, one shard at a time)."""
        store = t.store
        plan = store.groups[g].plan
        s = plan.members[k]
        x = store.local_shards()[s].grad
        if x is None:
            return
        if x.is_sparse:
            self._update_sparse(t, group, g, {k: x}, step)
            return
        rows = plan.member_rows(k, x.device)
        grad = torch.movedim(x, store.layout.axis, 0).reshape(plan.sizes[k], store.width)
        self._apply(t, group, g, rows, grad, step, False)

    def state_dict(self) -> dict[str, Any]:
        """Options and each table's state (logical tensors by name), as torch optimizers give them."""
        groups = [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups]
        state = {}
        for name, v in self.sharded_variables().items():
            if not isinstance(v, torch.Tensor) and len(v.shards) < v.layout.num_shards:  # not a raw KeyError
                raise ShardvarValueError(
                    f"state {name!r} is distributed: this process holds shards {sorted(v.shards)} of "
                    f"{v.layout.num_shards}, and a state dict holds whole tensors; save the optimizer with "
                    "shardvar.distributed.save (each rank its shards; it restores into any layout)"
                )
            state[name] = v.clone() if isinstance(v, torch.Tensor) else v.join()
        return {"param_groups": groups, "state": state}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load what :meth:`state_dict` gave (same tables and options keys); all checked first."""
        mine = self.sharded_variables()
        state = state_dict.get("state", {})
        if set(state) != set(mine) or len(state_dict.get("param_groups", [])) != len(self.param_groups):
            raise ShardvarValueError(
                f"this state dict holds {sorted(state)[:4]}...; the optimizer has {sorted(mine)[:4]}..."
            )
        for name, v in mine.items():
            if tuple(state[name].shape) != tuple(v.shape):
                raise ShardvarValueError(f"state {name!r} is {list(state[name].shape)}; expected {list(v.shape)}")
        for name, v in mine.items():
            if isinstance(v, torch.Tensor):
                v.copy_(state[name])
                continue
            for s, part in zip(range(v.layout.num_shards), v.layout.split(state[name]), strict=True):
                if s in v.shards:
                    v.shards[s].copy_(part)
        for group, saved in zip(self.param_groups, state_dict["param_groups"], strict=True):
            group.update({k: x for k, x in saved.items() if k != "params"})
