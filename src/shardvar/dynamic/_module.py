"""DynamicEmbedding(Bag): a table whose ids come from an unbounded space and get rows as they appear.

The rows are a ``ShardedEmbedding`` (``table``) of ``capacity`` rows split into ``partitioner``
blocks (div layout), so gradients, sparse gradients, every optimizer, ``.to()`` and checkpoints
work as for a fixed table; ``slots`` (a SlotTable) maps ids to rows. In training mode each call
is one step: it counts the ids, admits new ones, evicts if a shard is full and initialises the
new rows from their ids. In eval mode nothing changes and an unknown id reads ``default``.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn

from .._deprecation import renamed
from .._errors import ShardvarTypeError, ShardvarValueError
from .._validate import check_bag_mode, check_bool, check_int
from ..layout import Layout
from ..nn import ShardedEmbedding
from ..variables import ShardStore, scatter, to_layout
from ..variables import _functional as functional
from ._hash import IdInitializer, as_keys
from ._optim import move_rows, reset_rows
from ._policy import KEY, SEEN, USED, CountAdmission, ProbabilityAdmission, as_eviction, lowest_per_group
from ._slots import SlotTable

__all__ = ["DynamicEmbedding", "DynamicEmbeddingBag"]


def _check_admission(admission: Any) -> Any:
    if admission is None or isinstance(admission, (CountAdmission, ProbabilityAdmission)):
        return admission
    raise ShardvarTypeError(f"admission must be None, CountAdmission(k) or ProbabilityAdmission(p); got {admission!r}")


def _after_load_state_dict(module: nn.Module, _keys: Any) -> None:
    module.checkpoint_hook("after_load")  # torch's load_state_dict: rebuild the index, re-place ids


def _shard_count(partitioner: Any, capacity: int, dim: int, dtype: torch.dtype | None) -> int:
    """How many hash shards ``partitioner`` (a count, or as the modules' ``partitioner=``) gives the rows."""
    if isinstance(partitioner, int) and not isinstance(partitioner, bool):
        n = check_int(partitioner, "partitioner (a shard count)", minimum=1)
        if n > capacity:
            raise ShardvarValueError(f"partitioner={n} shards exceeds capacity={capacity}: each shard needs a row")
        return n
    layout = to_layout(partitioner, (capacity, dim), dtype or torch.get_default_dtype())
    if layout.axis != 0:
        raise ShardvarValueError(f"a dynamic table splits rows (axis 0); {partitioner!r:.60} splits axis {layout.axis}")
    return layout.num_shards


class _DynamicTable(nn.Module):
    @renamed(num_shards="partitioner")
    def __init__(
        self,
        embedding_dim: int,
        capacity: int,
        partitioner: Any = 1,
        *,
        eviction: Any = "lru",
        admission: Any = None,
        initializer: Any = None,
        default: torch.Tensor | None = None,
        sparse: bool = False,
        auto_step: bool = True,
        dtype: torch.dtype | None = None,
        devices: list[torch.device | str] | None = None,
    ) -> None:
        super().__init__()
        self.embedding_dim = check_int(embedding_dim, "embedding_dim", minimum=1)
        self.capacity = check_int(capacity, "capacity", minimum=1)
        self.num_shards = _shard_count(partitioner, self.capacity, self.embedding_dim, dtype)
        self.eviction, self.admission = as_eviction(eviction), _check_admission(admission)
        self.initializer = IdInitializer() if initializer is None else initializer
        if not callable(self.initializer):
            raise ShardvarTypeError(f"initializer must be callable (keys, dim, dtype) -> rows; got {initializer!r}")
        self.sparse, self.auto_step = check_bool(sparse, "sparse"), check_bool(auto_step, "auto_step")
        dtype = dtype or torch.get_default_dtype()
        layout = Layout.div(self.capacity, self.num_shards)
        self.table, self.slots = self._build_rows(layout, dtype, devices)
        device = self.slots.meta.device
        row = torch.zeros(self.embedding_dim, dtype=dtype) if default is None else torch.as_tensor(default)
        if tuple(row.shape) != (self.embedding_dim,):
            raise ShardvarValueError(
                f"default must be one row of {self.embedding_dim} values; got shape {list(row.shape)}"
            )
        self.register_buffer("default", row.to(device=device, dtype=dtype))
        self._attached: list[tuple[weakref.ref, list[torch.Tensor]]] = []
        self.register_load_state_dict_post_hook(_after_load_state_dict)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_attached"] = []  # a copy or a pickle is attached to no optimizer (attach it again)
        return state

    def _build_rows(self, layout: Layout, dtype: torch.dtype, devices: Any) -> tuple[nn.Module, SlotTable]:
        """The rows (a ShardedEmbedding) and the SlotTable of every shard."""
        shape = (self.capacity, self.embedding_dim)
        store = ShardStore.allocate(layout, shape, dtype, devices=devices, requires_grad=True)
        with torch.no_grad():
            for shard in store.local_shards().values():
                shard.zero_()  # free rows are never read; zeros keep a checkpoint of them deterministic
        table = ShardedEmbedding(self.capacity, self.embedding_dim, sparse=self.sparse, _store=store)
        device = next(iter(store.local_shards().values())).device
        return table, SlotTable(layout, 0, self.num_shards, self.eviction, self.admission, device)

    @property
    def store(self) -> ShardStore:
        return self.table.store

    @property
    def num_ids(self) -> int:
        """How many ids hold a row."""
        return int(self.slots.meta[:, USED].sum())

    def held_ids(self) -> torch.Tensor:
        """The ids that hold a row, sorted."""
        return self.slots.meta[self.slots.held(), KEY].sort().values

    def contains(self, ids: Any) -> torch.Tensor:
        keys = as_keys(ids, self.slots.meta.device)
        return (self.slots.find(keys.reshape(-1))[0] >= 0).view(keys.shape)

    def advance(self, steps: int = 1) -> None:
        """Move the step counter on (with ``auto_step=False``; TTL counts these steps)."""
        self.slots.step += check_int(steps, "steps", minimum=0)

    def _resolve(self, keys: torch.Tensor) -> torch.Tensor:
        """Rows of ``keys`` (flat); in training, admitting, evicting and initialising as one step."""
        if not self.training:
            return self.slots.find(keys)[0]
        if self.auto_step:
            self.slots.step += 1
        self.slots.expire()
        slot, new_slots, new_keys = self.slots.resolve(keys)
        if new_slots.numel():
            with torch.no_grad():
                rows = self.initializer(new_keys, self.embedding_dim, self.store.dtype)
                scatter(self.store, "scatter_update", new_slots, rows)
            for _, pending in self._attached:
                pending.append(new_slots)
        return slot

    def _rows(self, slot: torch.Tensor) -> torch.Tensor:
        """``[len(slot), dim]`` rows; -1 reads ``default`` and gets no gradient."""
        ok = slot >= 0
        if bool(ok.all()):
            return functional.embedding(self.store, slot, sparse=self.sparse)
        out = self.default.expand(slot.numel(), -1).clone()
        if bool(ok.any()):
            out[ok] = functional.embedding(self.store, slot[ok], sparse=self.sparse)
        return out

    def evict(self, ids: Any = None, *, count: int | None = None, older_than: int | None = None) -> torch.Tensor:
        """Free rows on demand: of ``ids``, of the ``count`` the policy ranks lowest, or of ids unseen
        for more than ``older_than`` steps (give exactly one). Returns the evicted ids."""
        one_of(ids, count, older_than)
        meta, held = self.slots.meta, self.slots.held()
        if ids is not None:
            slot = self.slots.find(as_keys(ids, meta.device).reshape(-1))[0]
            victims = slot[slot >= 0].unique()
        elif count is not None:
            want = torch.tensor([check_int(count, "count", minimum=0)], device=meta.device)
            scores = [c[held] for c in self.eviction.scores(meta)]
            victims = held[lowest_per_group(torch.zeros_like(held), want, *scores)]
        else:
            age = self.slots.step - meta[held, SEEN]
            victims = held[age > check_int(older_than, "older_than", minimum=0)]
        return self.slots.remove(victims)

    def attach_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Give rows handed to new ids fresh state in ``optimizer`` (reset before its next step), and
        move their state when a load re-places ids."""
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ShardvarTypeError(f"optimizer must be a torch.optim.Optimizer; got {type(optimizer).__name__}")
        if any(ref() is optimizer for ref, _ in self._attached):
            raise ShardvarValueError(f"this {type(optimizer).__name__} is already attached to the table")
        pending: list[torch.Tensor] = []
        store_of = weakref.ref(self)

        def reset(opt: torch.optim.Optimizer, *_: Any) -> None:
            module = store_of()
            if module is not None and pending:
                reset_rows(opt, module.store, torch.cat(pending).unique())
            pending.clear()

        optimizer.register_step_pre_hook(reset)
        self._attached.append((weakref.ref(optimizer), pending))

    def checkpoint_hook(self, event: str) -> None:
        """After a load: rebuild the id index, and move ids whose shard changed (with optimizer state)."""
        if event != "after_load":
            return
        meta = self.slots.meta
        held = self.slots.held()
        if (
            bool(((meta[:, USED] != 0) & (meta[:, USED] != 1)).any())
            or held.numel() != meta[held, KEY].unique().numel()
        ):
            raise ShardvarValueError("the loaded slot metadata is corrupt: an id holds two rows or a flag is not 0/1")
        moves = self.slots.placement_moves()
        if moves is None:
            self.slots.rebuild_index()
            return
        source, dest = moves
        with torch.no_grad():
            rows = functional.gather(self.store, source)
            for shard in self.store.local_shards().values():
                shard.zero_()
            scatter(self.store, "scatter_update", dest, rows)
        for ref, _ in self._attached:
            if ref() is not None:
                move_rows(ref(), self.store, source, dest)
        self.slots.move(source, dest)

    def to_fixed(self, as_module: bool = False) -> tuple[Any, torch.Tensor]:
        """(rows of the held ids as a tensor, or a ShardedEmbedding with ``num_shards``, sorted id map):
        row ``i`` belongs to ``id_map[i]``; look ids up with ``torch.searchsorted(id_map, ids)``."""
        held = self.slots.held()
        keys, order = self.slots.meta[held, KEY].sort()
        with torch.no_grad():
            rows = functional.gather(self.store, held[order]).clone()
        if not as_module:
            return rows, keys
        shards = min(self.num_shards, max(keys.numel(), 1))
        return ShardedEmbedding(rows.shape[0], self.embedding_dim, partitioner=shards, _weight=rows), keys

    def extra_repr(self) -> str:
        admission = f", admission={self.admission}" if self.admission is not None else ""
        shape = f"{self.embedding_dim}, capacity={self.capacity}, num_shards={self.num_shards}"
        return f"{shape}, eviction={self.eviction}{admission}"


def one_of(ids: Any, count: Any, older_than: Any) -> None:
    """What ``evict`` takes: exactly one of ``ids``, ``count`` and ``older_than``."""
    given = [n for n, v in (("ids", ids), ("count", count), ("older_than", older_than)) if v is not None]
    if len(given) != 1:
        raise ShardvarValueError(f"give exactly one of ids, count, older_than; got {given or 'none'}")


class DynamicEmbedding(_DynamicTable):
    """``nn.Embedding`` over ids from an unbounded space (any int64, or strings): see the module docstring."""

    def forward(self, ids: Any) -> torch.Tensor:
        keys = as_keys(ids, self.slots.meta.device)
        return self._rows(self._resolve(keys.reshape(-1))).view(*keys.shape, self.embedding_dim)


class DynamicEmbeddingBag(_DynamicTable):
    """``nn.EmbeddingBag`` (sum, mean, max) over a dynamic table."""

    @renamed(num_shards="partitioner")
    def __init__(
        self, embedding_dim: int, capacity: int, partitioner: Any = 1, *, mode: str = "mean", **kwargs: Any
    ) -> None:
        self_mode = check_bag_mode(mode)
        super().__init__(embedding_dim, capacity, partitioner, **kwargs)
        self.mode = self_mode

    def forward(self, ids: Any, offsets: Any = None, per_sample_weights: Any = None) -> torch.Tensor:
        keys = as_keys(ids, self.slots.meta.device)
        offsets = functional.check_bag(keys, offsets, include_last_offset=False)  # checked before any change
        weights = functional.check_weights(per_sample_weights, keys, self.mode, self.store.dtype)
        slot = self._resolve(keys.reshape(-1)).view(keys.shape)
        if bool((slot >= 0).all()):
            return functional.embedding_bag(
                self.store, slot, offsets, mode=self.mode, per_sample_weights=weights, sparse=self.sparse
            )
        rows = self._rows(slot.reshape(-1))
        positions = torch.arange(slot.numel(), device=slot.device).view(slot.shape)
        return functional.embedding_bag_rows(positions, rows, offsets, mode=self.mode, per_sample_weights=weights)
