"""Replicated tables of a distributed collection: small tables kept whole on every rank (data parallel).

Each rank looks its ids up in its own copy, with no exchange; in backward the gradient of every
replicated table of a (width, mode) group is summed over the ranks in one ``all_reduce`` (the
tables share one allocation), so the copies stay identical and equal one process trained on
every rank's loss, as the row-wise tables do. A sparse gradient is summed densely with a column
marking the rows any rank touched, then made sparse again over exactly those rows.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .._pages import zeros
from ..layout import Layout
from ..nn import TableConfig, jagged_split, pack
from ..variables import RowInitializer, ShardedVariable, embedding_bag_rows, embedding_rows, slab_weight, sparse_rows
from ._comm import Comm

__all__ = ["Replicas"]


# forward / setup_context / backward as torch.autograd.Function wants them: alike in shape to
# variables._autograd's Functions, sharing no rule with them.
class _SummedGrad(torch.autograd.Function):
    """Identity forward; backward sums the gradient over the ranks (dense, or sparse over the touched rows)."""

    @staticmethod
    def forward(weight: torch.Tensor, comm: Comm) -> torch.Tensor:
        return weight.view_as(weight)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
        ctx.comm = inputs[1]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        comm: Comm = ctx.comm
        if grad.layout != torch.sparse_coo:
            summed = grad.contiguous().clone()
            comm.all_reduce(summed, dist.ReduceOp.SUM, "replicated tables' gradient")
            return summed, None
        rows, width = grad.shape
        packed = zeros((rows, width + 1), dtype=grad.dtype, device=grad.device)
        packed.index_add_(0, grad._indices()[0], torch.cat([grad._values(), torch.ones_like(grad._values()[:, :1])], 1))
        comm.all_reduce(packed, dist.ReduceOp.SUM, "replicated tables' gradient")
        touched = packed[:, width].nonzero().squeeze(1)
        values = packed.index_select(0, touched)[:, :width]
        return sparse_rows(touched, values, rows), None


class _Table(nn.Module):
    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight)
        self.weight.replicated = True  # whole on every rank: a table optimizer saves its state once (Table.whole)


class Replicas:
    """The replicated tables of a collection; the collection registers ``embedding_bags`` (its state
    dict then names them ``embedding_bags.<name>.weight``, as the other tables are named)."""

    def __init__(
        self,
        tables: dict[str, TableConfig],
        sparse: bool,
        init: RowInitializer,
        first: dict[str, int],
        comm: Comm,
        pooled: bool = True,
    ) -> None:
        self.configs, self.sparse, self.comm, self.pooled = dict(tables), sparse, comm, pooled
        self.embedding_bags = nn.ModuleDict(
            {
                n: _Table(init.rows(first[n] + torch.arange(c.num_embeddings), (c.embedding_dim,), torch.float32))
                for n, c in tables.items()
            }
        )
        by_kind: dict[tuple[int, str], list[str]] = {}
        for n, c in tables.items():
            by_kind.setdefault((c.embedding_dim, c.mode), []).append(n)
        self.groups = list(by_kind.values())
        self._variables = [ShardedVariable([self.embedding_bags[n].weight for n in names]) for names in self.groups]

    def pack(self, features: dict, offsets: dict, weights: dict, table_of: dict[str, str]) -> list[tuple]:
        """Each group's features checked and packed (``nn._collection.pack``): no collective, nothing read."""
        packed = []
        for names, variable in zip(self.groups, self._variables, strict=True):
            store = variable.store
            layouts = {n: Layout.div(self.configs[n].num_embeddings, 1) for n in names}
            starts = dict(zip(names, store.layout.offsets, strict=False))
            present = [f for f in features if table_of[f] in names]
            packed.append((present, pack(present, table_of, layouts, starts, store.dtype, features, offsets, weights)))
        return packed

    def __call__(self, packed: list[tuple]) -> dict[str, torch.Tensor]:
        """Bags (or rows) of the features :meth:`pack` packed, group by group."""
        out: dict[str, torch.Tensor] = {}
        for names, variable, (present, inputs) in zip(self.groups, self._variables, packed, strict=True):
            store, mode = variable.store, self.configs[names[0]].mode
            rows, offs, psw, counts = inputs
            weight = _SummedGrad.apply(slab_weight(store), self.comm)
            if not self.pooled:  # a sequence collection's: every id's row
                out.update(jagged_split(embedding_rows(rows, weight, sparse=self.sparse), offs, counts, present))
                continue
            pooled = embedding_bag_rows(rows, weight, offs, mode=mode, per_sample_weights=psw, sparse=self.sparse)
            out.update(zip(present, pooled.split(counts), strict=True))
        return out
