"""Optimizer state of single rows: fresh state for a reused row, and state that moves with its row.

A row given to a new id must not inherit the momentum or accumulator of the id evicted from it.
Any state tensor shaped ``[rows, ...]`` like a shard (torch.optim's per-parameter state) or laid
out like the table (shardvar.optim's slots, element- or row-wise) is reset to its fresh value:
0, except where ``FRESH`` names the option that gives it (Adagrad's accumulator). An optimizer
can take over by defining ``reset_state_rows(param, rows)``.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from ..optim import TableOptimizer
from ..variables import ShardStore

__all__ = ["FRESH", "reset_rows", "move_rows"]

FRESH: dict[str, str] = {"sum": "initial_accumulator_value"}  # state key -> option holding its fresh value


def _by_shard(store: ShardStore, slots: torch.Tensor) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """(shard, its parameter, local rows of ``slots`` in it), for the shards ``slots`` touch."""
    shards = store.local_shards()
    owner, local = store.layout.locate(slots.cpu())
    for s in owner.unique().tolist():
        yield s, shards[s], local[owner == s].to(shards[s].device)


def state_views(optimizer: torch.optim.Optimizer, store: ShardStore) -> Iterator[tuple[dict, torch.Tensor, float]]:
    """(per-shard views of state laid out by rows, its fresh value) for every state of the table."""
    if isinstance(optimizer, TableOptimizer):
        params = {id(p) for p in store.local_shards().values()}
        for tables, group in zip(optimizer._groups_tables, optimizer.param_groups, strict=True):
            for t in tables:
                if not params & {id(p) for p in t.params}:
                    continue
                for slot, (_, fill) in optimizer.slots.items():
                    yield t.slot_variable(slot).shards, float(group[fill] if isinstance(fill, str) else fill)
        return
    for group in optimizer.param_groups:
        members = {id(q) for q in group["params"]}
        by_key: dict[str, dict[int, torch.Tensor]] = {}
        for s, p in store.local_shards().items():
            for key, value in optimizer.state.get(p, {}).items() if id(p) in members else ():
                if isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape[0] == p.shape[0]:
                    by_key.setdefault(key, {})[s] = value
        for key, views in by_key.items():
            yield views, float(group.get(FRESH[key], 0.0)) if key in FRESH else 0.0


@torch.no_grad()
def reset_rows(optimizer: torch.optim.Optimizer, store: ShardStore, slots: torch.Tensor) -> None:
    """Set the optimizer state of rows ``slots`` (logical rows of ``store``) to fresh values."""
    if slots.numel() == 0:
        return
    reset = getattr(optimizer, "reset_state_rows", None)
    for s, param, rows in _by_shard(store, slots):
        if reset is not None:
            reset(param, rows)
            continue
        for views, fresh in state_views(optimizer, store):
            if s in views:
                views[s][rows] = fresh


@torch.no_grad()
def move_rows(optimizer: torch.optim.Optimizer, store: ShardStore, source: torch.Tensor, dest: torch.Tensor) -> None:
    """Move state rows ``source`` to ``dest`` (logical rows); every other row becomes fresh."""
    for views, fresh in state_views(optimizer, store):
        if len(views) != store.layout.num_shards:
            continue  # state of only some shards (not yet created for the rest): nothing to move
        full = store.layout.join([views[s] for s in range(store.layout.num_shards)])
        moved = torch.full_like(full, fresh)
        moved[dest.to(full.device)] = full[source.to(full.device)]
        for s, part in enumerate(store.layout.split(moved)):
            views[s].copy_(part)
