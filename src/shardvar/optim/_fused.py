"""Updates inside backward: each shard is updated as soon as its gradient is accumulated.

``fuse(optimizer)`` registers ``register_post_accumulate_grad_hook`` on every shard of every
table: the hook applies the optimizer's rule to that shard's rows (the touched ones, for sparse
gradients) and drops the gradient at once, so no gradient of the table's size exists at any time
(a dense gradient lives for one shard at a time). The step count of each table advances once per
backward, at its end. ``optimizer.step()`` then has nothing left to do; ``handle.remove()``
restores the ordinary behaviour.
"""

from __future__ import annotations

from typing import Any

import torch

from .._errors import ShardvarValueError
from ._base import TableOptimizer
from ._tables import Table

__all__ = ["fuse", "FusedHandle"]


class FusedHandle:
    """The hooks ``fuse`` registered; ``remove()`` takes them away."""

    def __init__(self, optimizer: TableOptimizer) -> None:
        self.optimizer = optimizer
        self._hooks: list[Any] = []
        self._pending: dict[int, Table] = {}  # tables updated in the running backward

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        self.optimizer._fused = None

    def _finish(self) -> None:
        for t in self._pending.values():
            t.step += 1
        self._pending.clear()

    def _hook(self, table: Table, group: dict[str, Any], g: int, member: int) -> Any:
        def apply(p: torch.Tensor) -> None:
            if id(table) not in self._pending:
                if not self._pending:  # once per backward: the step counts advance when it ends
                    torch.autograd.Variable._execution_engine.queue_callback(self._finish)
                self._pending[id(table)] = table
            with torch.no_grad():
                self.optimizer._update_member(table, group, g, member, int(table.step) + 1)
            p.grad = None

        return apply


def fuse(optimizer: TableOptimizer) -> FusedHandle:
    """Apply ``optimizer``'s updates inside backward, shard by shard (see the module's docstring)."""
    if not isinstance(optimizer, TableOptimizer):
        raise ShardvarValueError(f"fuse needs a shardvar.optim optimizer; got {type(optimizer).__name__}")
    if getattr(optimizer, "_fused", None) is not None:
        raise ShardvarValueError("this optimizer is already fused; call .remove() on its handle first")
    handle = FusedHandle(optimizer)
    for tables, group in zip(optimizer._groups_tables, optimizer.param_groups, strict=True):
        for t in tables:
            shards = t.store.local_shards()
            for g, store_group in enumerate(t.store.groups):
                for k, s in enumerate(store_group.members):
                    hook = handle._hook(t, group, g, k)
                    handle._hooks.append(shards[s].register_post_accumulate_grad_hook(hook))
    optimizer._fused = handle
    return handle
