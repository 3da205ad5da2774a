"""DistributedDynamicEmbedding: a dynamic table whose ids live on the rank their hash names.

Rank ``r`` owns shard ``r`` of the rows (div layout of ``capacity``) and the SlotTable of the
ids placed there. A call sends each rank's distinct ids (with their counts) to their owners in
one all_to_all, the owners resolve them (admit, evict, initialise: the same rules as the local
table, applied to exactly the ids one process would see) and answer with row numbers, and the
rows travel through the fixed table's exchange. So N processes train exactly the table one
process would on all their ids. A checkpoint holds the logical rows and metadata; after a load
into another world size the ids travel to their new owners with their rows and optimizer state.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .._deprecation import renamed
from .._errors import ShardvarError, ShardvarValueError
from .._pages import empty, empty_like
from ..dynamic import KEY, USED, DynamicEmbedding, SlotTable, as_keys, one_of, shard_of, stable_order, state_views
from ..layout import Layout
from ._agree import agree, refuse
from ._comm import DEFAULT_TIMEOUT, Comm
from ._module import DistributedEmbedding

__all__ = ["DistributedDynamicEmbedding"]


def route(
    comm: Comm, payload: torch.Tensor, owner: torch.Tensor, what: str
) -> tuple[torch.Tensor, list, list, torch.Tensor]:
    """Rows of ``payload`` to their ``owner`` ranks: (received, sent counts, received counts, send order)."""
    order = torch.argsort(owner, stable=True)
    sent = torch.bincount(owner, minlength=comm.world)
    got_list = agree(comm, None, sent, f"{what} counts")  # raises if a rank refused its input (see _keys)
    sent_list = sent.tolist()
    out = empty((sum(got_list), *payload.shape[1:]), dtype=payload.dtype, device=payload.device)
    comm.all_to_all(out, payload.index_select(0, order).contiguous(), got_list, sent_list, what)
    return out, sent_list, got_list, order


def answer(comm: Comm, values: torch.Tensor, sent: list, got: list, order: torch.Tensor) -> torch.Tensor:
    """Send ``values`` (one per row received by :func:`route`) back; returns them in the caller's order."""
    back = empty((sum(sent), *values.shape[1:]), dtype=values.dtype, device=values.device)
    comm.all_to_all(back, values.contiguous(), sent, got, "answers")
    out = empty_like(back)
    out[order] = back
    return out


class DistributedDynamicEmbedding(DynamicEmbedding):
    """``DynamicEmbedding`` over the ranks of a process group; every rank calls it with its own ids."""

    @renamed(num_shards="partitioner")
    def __init__(
        self, embedding_dim: int, capacity: int, *, group: Any = None, timeout: float = DEFAULT_TIMEOUT, **options: Any
    ) -> None:
        comm = Comm(group, timeout)
        count = options.pop("partitioner", comm.world)
        if options.get("devices") is not None or count != comm.world:
            raise ShardvarValueError(
                f"a distributed dynamic table has one shard per rank ({comm.world}); do not pass partitioner or "
                f"devices; got partitioner={count!r}, devices={options.get('devices')!r:.60}"
            )
        object.__setattr__(self, "comm", comm)  # _build_rows needs it, before nn.Module.__init__
        object.__setattr__(self, "_group", group)
        super().__init__(embedding_dim, capacity, comm.world, **options)  # validates every option
        agreed = (self.embedding_dim, self.capacity, repr(self.eviction), repr(self.admission), repr(self.initializer))
        everyone = comm.all_gather_object(agreed, "the dynamic table's options")
        if any(other != agreed for other in everyone):
            raise ShardvarValueError(f"ranks built the table with different options: {everyone}")

    def _build_rows(self, layout: Layout, dtype: torch.dtype, devices: Any) -> tuple[nn.Module, SlotTable]:
        """This rank's shard of the rows (a DistributedEmbedding) and the SlotTable of the ids placed on it."""
        table = DistributedEmbedding(
            self.capacity, self.embedding_dim, layout, placement=list(range(self.comm.world)), sparse=self.sparse,
            group=self._group, timeout=self.comm.timeout, dtype=dtype,
        )  # fmt: skip
        with torch.no_grad():
            table.store.local_shards()[self.comm.rank].zero_()
        return table, SlotTable(layout, self.comm.rank, 1, self.eviction, self.admission, self.comm.device)

    def _resolve(self, keys: torch.Tensor) -> torch.Tensor:
        unique, inverse, counts = torch.unique(keys, return_inverse=True, return_counts=True)
        owner = shard_of(unique, self.comm.world)
        received, sent, got, order = route(self.comm, torch.stack((unique, counts), 1), owner, "ids")
        local = super()._resolve(received[:, 0]) if not self.training else self._resolve_owned(received)
        first = self.table.layout.offsets[self.comm.rank]
        rows = torch.where(local >= 0, local + first, local)
        return answer(self.comm, rows, sent, got, order)[inverse]

    def _resolve_owned(self, received: torch.Tensor) -> torch.Tensor:
        if self.auto_step:
            self.slots.step += 1
        self.slots.expire()
        slot, new_slots, new_keys = self.slots.resolve(received[:, 0], received[:, 1])
        if new_slots.numel():
            shard = self.table.store.local_shards()[self.comm.rank]
            with torch.no_grad():
                shard[new_slots] = self.initializer(new_keys, self.embedding_dim, shard.dtype)
            first = self.table.layout.offsets[self.comm.rank]
            for _, pending in self._attached:
                pending.append(new_slots + first)
        return slot

    def _rows(self, slot: torch.Tensor) -> torch.Tensor:
        ok = slot >= 0
        rows = self.table(slot[ok])  # collective: every rank calls it, with or without ids
        if bool(ok.all()):
            return rows
        out = self.default.expand(slot.numel(), -1).clone()
        out[ok] = rows
        return out

    def _keys(self, ids: Any, check: Callable[[], Any] | None = None) -> torch.Tensor:
        """``ids`` as keys, checked as the local table checks them (with ``check``, first). A refusal is
        every rank's: it takes the place of the ids' route, whose split sizes carry the verdicts."""
        try:
            if check is not None:
                check()
            return as_keys(ids, self.slots.meta.device)
        except ShardvarError as e:
            refuse(self.comm, e)

    def forward(self, ids: Any) -> torch.Tensor:
        keys = self._keys(ids)
        return self._rows(self._resolve(keys.reshape(-1))).view(*keys.shape, self.embedding_dim)

    def contains(self, ids: Any) -> torch.Tensor:
        """Collective: whether each id holds a row (on its owner)."""
        shape = (keys := self._keys(ids)).shape
        unique, inverse = torch.unique(keys.reshape(-1), return_inverse=True)
        received, sent, got, order = route(self.comm, unique, shard_of(unique, self.comm.world), "ids")
        found = (self.slots.find(received)[0] >= 0).to(torch.int64)
        return answer(self.comm, found, sent, got, order)[inverse].bool().view(shape)

    def evict(self, ids: Any = None, *, count: int | None = None, older_than: int | None = None) -> torch.Tensor:
        """``ids``: collective, each owner frees the rows of its ids; returns the evicted ids (on every rank
        that asked for them). ``count`` / ``older_than``: this rank's rows only."""
        if ids is None:
            return super().evict(count=count, older_than=older_than)
        keys = self._keys(ids, lambda: one_of(ids, count, older_than)).reshape(-1)
        unique = torch.unique(keys)
        received, sent, got, order = route(self.comm, unique, shard_of(unique, self.comm.world), "ids")
        slot = self.slots.find(received)[0]
        self.slots.remove(slot[slot >= 0].unique())
        evicted = answer(self.comm, (slot >= 0).to(torch.int64), sent, got, order).bool()
        return unique[evicted]

    def to_fixed(self, as_module: bool = False) -> tuple[Any, torch.Tensor]:
        """Collective: every rank gets (rows of all held ids, sorted id map), as the local table's."""
        held = self.slots.held()
        mine = (self.slots.meta[held, KEY].cpu(), self.table.store.local_shards()[self.comm.rank][held].detach().cpu())
        parts = self.comm.all_gather_object(mine, "held ids and rows")
        keys, order = torch.cat([k for k, _ in parts]).sort()
        rows = torch.cat([r for _, r in parts])[order]
        if not as_module:
            return rows, keys
        return nn.Embedding.from_pretrained(rows, freeze=False), keys

    @property
    def num_ids(self) -> int:
        """Ids held on this rank."""
        return int(self.slots.meta[:, USED].sum())

    def checkpoint_hook(self, event: str) -> None:
        if event == "before_save" and self.slots.sketch.numel():
            # each owner counted its own ids: the elementwise max over-estimates no id (count-min stays an upper bound)
            self.comm.all_reduce(self.slots.sketch, dist.ReduceOp.MAX, "admission counts")
        if event == "after_load":
            self._replace_after_load()

    def _row_tensors(self) -> list[tuple[torch.Tensor, float]]:
        """This rank's rows and every attached optimizer's per-row state of them, with their fresh values."""
        rank = self.comm.rank
        out = [(self.table.store.local_shards()[rank], 0.0)]
        for ref, _ in self._attached:
            views = state_views(ref(), self.table.store) if ref() is not None else []
            out += [(v[rank], fresh) for v, fresh in views if rank in v]
        return out

    @torch.no_grad()
    def _replace_after_load(self) -> None:
        """Send every held id whose owner changed to its owner, with its rows; owners keep the best by policy."""
        meta, rank = self.slots.meta, self.comm.rank
        held = self.slots.held()
        owner = shard_of(meta[held, KEY], self.comm.world)
        moving = torch.tensor([int((owner != rank).sum())], device=meta.device)
        self.comm.all_reduce(moving, dist.ReduceOp.SUM, "ids to re-place")
        if int(moving) == 0:
            self.slots.rebuild_index()
            return
        tensors = self._row_tensors()
        arrived_meta = route(self.comm, meta[held], owner, "slot metadata")[0]
        arrived = [route(self.comm, t[held].reshape(held.numel(), t[0].numel()), owner, "rows")[0] for t, _ in tensors]
        scores = [-col for col in self.eviction.scores(arrived_meta)]
        order = stable_order(*scores)[: self.slots.sizes[0]]  # the best ids by policy, up to capacity
        meta.zero_()
        meta[: order.numel()] = arrived_meta[order]
        for (t, fresh), rows in zip(tensors, arrived, strict=True):
            t.fill_(fresh)
            t[: order.numel()] = rows[order].view(-1, *t.shape[1:])
        self.slots.rebuild_index()
