"""Embedding tables whose rows live in a storage tier (``storage=shardvar.Tiered(...)``).

``ShardedEmbedding(..., storage=...)`` builds a :class:`TieredEmbedding` (a ShardedEmbedding):
its arguments are checked as for any table (on the meta device, so nothing table-sized is
allocated), then the storage is opened and filled from the module's initializer, streamed block
by block: the same ``nn.init.normal_`` draws, in the same pieces, as an in-memory table's
(``_collection_build``), so both tables are equal under the same seed.

A lookup resolves the batch's distinct ids to cache slots, reads those rows, and runs the lookup
kernel (``functional.embedding_rows`` / ``embedding_bag_rows``) over them with each id's position
(padding, bags, per-sample weights as for any table). Its backward hands each looked-up id's
gradient row to the tier's sink: the update of a shardvar
optimizer fused into backward (``optim.fuse``), which is the only way a tiered table trains.

The distributed twins (``distributed._tiered``) are this mixin over a distributed module: their
``_open`` fills each rank's file with its own shards' rows, and their owners hand the gradient rows
that come back to the sink with the same :func:`to_sink`.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from .._errors import ShardvarIndexError, ShardvarTypeError, ShardvarValueError
from ..variables import Part, RowTier, TableStorage, check_bag, check_weights, functional, pools_rows, sparse_bags
from ._collection_build import pieces

__all__ = ["TieredTable", "tiered_blocks", "to_sink", "unfused"]

TRAINS = (
    "a tiered table trains only through a shardvar.optim optimizer fused into backward "
    "(RowWiseAdagrad, RowWiseAdam, Adagrad, Adam or SGD, then shardvar.optim.fuse(optimizer))"
)


def tiered_blocks(
    rows: int, dim: int, dtype: torch.dtype, weight: torch.Tensor | None, padding_idx: int | None
) -> Iterator[torch.Tensor]:
    """The table's initial rows in order, a piece at a time (what the in-memory table would hold)."""
    for a, b in pieces(rows, dim, dtype):
        block = (
            weight[a:b].detach().to("cpu", dtype)
            if weight is not None
            else nn.init.normal_(torch.empty((b - a, dim), dtype=dtype))
        )
        if weight is None and padding_idx is not None and a <= padding_idx < b:
            block[padding_idx - a].zero_()
        yield block


class _TierRows(torch.autograd.Function):
    """The rows at ``slots`` of the tier's cache; backward hands their gradient to the tier's sink."""

    @staticmethod
    def forward(ctx: Any, anchor: torch.Tensor, tier: RowTier, slots: torch.Tensor, token: Any) -> torch.Tensor:
        ctx.tier, ctx.slots, ctx.token = tier, slots, token
        return tier.values.index_select(0, slots)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, ...]:
        ctx.token = None  # the batch's rows may move once its update is done
        to_sink(ctx.tier, ctx.slots, grad)
        return None, None, None, None


def unfused(tier: RowTier) -> ShardvarTypeError | None:
    """The refusal of a backward into ``tier`` when no fused optimizer holds it (None: one does)."""
    return ShardvarTypeError(TRAINS + "; no fused optimizer holds this table") if tier.sink is None else None


def to_sink(tier: RowTier, slots: torch.Tensor, grad: torch.Tensor) -> None:
    """Hand the gradient rows of the rows at ``slots`` (one each, dense or sparse) to the tier's sink."""
    error = unfused(tier)
    if error is not None:
        raise error
    if grad.is_sparse:  # one row per looked-up id: the sink sums them per row, as an in-memory table's update
        tier.sink(slots[grad._indices()[0]], grad._values())
    else:
        tier.sink(slots, grad)


class _SlotSink:
    """A tiered bag's sink: the summed rows of cache slots (:func:`to_sink`), or, where the tier's fused
    optimizer takes it (``bags``), a sum bag's gradient whole."""

    def __init__(self, tier: RowTier) -> None:
        self.tier = tier

    def __call__(self, slots: torch.Tensor, summed: torch.Tensor) -> None:
        to_sink(self.tier, slots, summed)

    def bags(self, slots: torch.Tensor, offsets: torch.Tensor, grad: torch.Tensor) -> Any:
        whole = getattr(self.tier.sink, "bags", None)  # None: no fused optimizer (``__call__`` says so)
        return None if whole is None else whole(slots, offsets, grad)


class TieredTable:
    """What ShardedEmbedding(Bag) become over a storage tier (mixed in before the module's class)."""

    tier: RowTier

    def __init__(self, *args: Any, storage: Any, **kwargs: Any) -> None:
        if not isinstance(storage, TableStorage):
            raise ShardvarTypeError(f"storage must be shardvar.Tiered(path, cache_bytes=...); got {storage!r:.80}")
        if kwargs.get("devices") is not None:
            raise ShardvarValueError("a tiered table's cache is in CPU memory: leave devices None")
        weight = kwargs.get("_weight", args[9] if len(args) > 9 else None)  # _weight's place in both signatures
        device = kwargs.pop("device", None)
        if device is not None and torch.device(device).type != "cpu":
            raise ShardvarValueError(f"a tiered table's cache is in CPU memory; got device={device!r}")
        super().__init__(*args, device="meta", **kwargs)  # every argument checked; nothing allocated
        if self.max_norm is not None:  # it would renormalise rows of the file in every lookup
            raise ShardvarValueError(f"max_norm is not supported by a tiered table; got max_norm={self.max_norm}")
        frozen = not next(iter(self._parameters.values())).requires_grad if self._parameters else False
        dtype = self.lookup_dtype = self._store.dtype  # the meta store stays: it holds no memory
        for name in list(self._parameters):
            del self._parameters[name]
        self.tier = self._open(storage, dtype, weight)
        # What autograd hangs the table's backward on (holds nothing): an optimizer over it is refused in
        # backward unless it is shardvar's, fused.
        self.tiered_rows = nn.Parameter(torch.empty(0), requires_grad=not frozen)
        self._state_dict_hooks.clear()  # the in-memory table's logical form reads .weight: not here
        self._load_state_dict_pre_hooks.clear()

    def _open(self, storage: TableStorage, dtype: torch.dtype, weight: torch.Tensor | None) -> RowTier:
        """The table's tier, filled with its initial rows (a distributed twin's: this rank's shards' only)."""
        blocks = tiered_blocks(self.num_embeddings, self.embedding_dim, dtype, weight, self.padding_idx)
        return storage.open(self.num_embeddings, self.embedding_dim, dtype, blocks)

    @property
    def store(self) -> Any:
        raise ShardvarTypeError("a tiered table has no store in RAM: its rows live in its backing file")

    @property
    def weight(self) -> Any:
        raise ShardvarTypeError(
            "a tiered table's weight is not materialised (it may not fit in memory): look rows up, read them with "
            "table.tier.peek(ids), or save a checkpoint"
        )

    def sharded_variables(self) -> dict[str, Any]:
        """The table as a sharded object over its backing file (a checkpoint streams it, or loads into it)."""
        return {"weight": self.tier.sharded(self.layout)}

    def checkpoint_hook(self, event: str) -> None:
        if event == "after_load":  # the file was written under the cache: its rows are stale
            self.tier.reload()

    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        # ``weight``: the table over its file, as a checkpoint takes it (never materialised here); the
        # anchor holds nothing and is left out, so the keys are an in-memory table's
        destination[prefix + "weight"] = self.sharded_variables()["weight"]

    def _load_from_state_dict(self, state_dict: dict, prefix: str, *args: Any) -> None:
        if any(k.startswith(prefix) for k in state_dict):
            raise ShardvarTypeError(
                "a tiered table does not load a state dict (it would hold the whole table in memory): restore it "
                "from a checkpoint with shardvar.load, which streams the rows into its backing file"
            )

    def reset_parameters(self) -> None:
        raise ShardvarTypeError("a tiered table is initialised once, when its backing file is created")

    def cache_stats(self) -> dict[str, float]:
        """The cache's hit rate, hits, misses, evictions, rows written back, bytes read and written."""
        return self.tier.cache_stats()

    @property
    def cache(self) -> Any:
        """The tier's row cache (give it to ``shardvar.tiered.Prefetcher``)."""
        return self.tier.cache

    def close(self) -> None:
        """Write back the rows that changed and close the backing file cleanly."""
        self.tier.close()

    def extra_repr(self) -> str:
        return super().extra_repr() + f", storage={self.tier.spec!r}"

    def _rows(self, input: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int | None]:
        """(the rows of the batch's distinct ids, each id's position among them, the padding row's)."""
        ids = _checked_ids(input, self.num_embeddings)
        unique, inverse = torch.unique(ids.reshape(-1), return_inverse=True)
        grad = torch.is_grad_enabled() and self.tiered_rows.requires_grad
        slots, token = self.tier.resolve(unique, grad=grad, of=(ids, inverse))  # (the batch: taken if resolved ahead)
        rows = _TierRows.apply(self.tiered_rows, self.tier, slots, token) if grad else self.tier.values[slots]
        pad = None
        if self.padding_idx is not None:
            at = torch.searchsorted(unique, torch.tensor([self.padding_idx]))
            if int(at) < unique.numel() and int(unique[at]) == self.padding_idx:
                pad = int(at)
        return rows, inverse.view(ids.shape), pad


def _checked_ids(input: Any, rows: int) -> torch.Tensor:
    if not isinstance(input, torch.Tensor) or input.dtype not in (torch.int32, torch.int64):
        got = input.dtype if isinstance(input, torch.Tensor) else type(input).__name__
        raise ShardvarTypeError(f"ids must be an int32 or int64 tensor; got {got}")
    if input.numel() and (int(input.min()) < 0 or int(input.max()) >= rows):
        raise ShardvarIndexError(f"ids must be in [0, {rows}); got {int(input.min())}..{int(input.max())}")
    return input.to(torch.int64)


def forward_embedding(module: Any, input: torch.Tensor) -> torch.Tensor:
    rows, positions, pad = module._rows(input)
    # sparse: one gradient row per id, summed per row by the update as in memory (torch has no sparse
    # gradient with scale_grad_by_freq, nor for max bags: then the op's dense one over the batch's rows)
    scale = module.scale_grad_by_freq
    return functional.embedding_rows(positions, rows, pad, None, 2.0, scale, sparse=not scale)


def forward_bag(module: Any, input: torch.Tensor, offsets: Any, per_sample_weights: Any) -> torch.Tensor:
    if pools_rows(module.mode, module.scale_grad_by_freq, module.padding_idx, None, module.include_last_offset):
        return _slot_bags(module, input, offsets, per_sample_weights)  # (max_norm: refused at construction)
    rows, positions, pad = module._rows(input)
    return functional.embedding_bag_rows(
        positions,
        rows,
        offsets,
        None,
        2.0,
        module.scale_grad_by_freq,
        module.mode,
        module.mode != "max" and not module.scale_grad_by_freq,
        per_sample_weights,
        module.include_last_offset,
        pad,
    )


def _slot_bags(module: Any, input: torch.Tensor, offsets: Any, weights: Any) -> torch.Tensor:
    """Sum or mean bags straight over the cache's slots, the gradient summed per slot (the sparse product,
    ``variables._bag_grad``) and handed to the sink a slice at a time: an in-memory bag's work and sums,
    with no copy of the batch's rows and no gradient row per id."""
    ids = _checked_ids(input, module.num_embeddings)
    bag_offsets = check_bag(ids, offsets, False)
    weights = check_weights(weights, ids, module.mode, module.lookup_dtype)  # all checked before the cache moves
    grad = torch.is_grad_enabled() and module.tiered_rows.requires_grad
    tier = module.tier
    slots, token = tier.resolve(ids, grad=grad)
    if slots.dim() == 2:  # fixed-size bags: each bag's first id
        bag_offsets = torch.arange(slots.shape[0]) * slots.shape[1]
        slots, weights = slots.reshape(-1), None if weights is None else weights.reshape(-1)
    bag_offsets = bag_offsets.to(slots.dtype)
    if not grad:
        return functional.embedding_bag_rows(slots, tier.values, bag_offsets, None, 2.0, False, module.mode, False,
                                             weights)  # fmt: skip
    # the part holds the token until backward ran: the batch's rows stay in their slots until then; the
    # summed rows come as distinct ascending slots, nothing left to sum
    part = Part(0, tier.values.shape[0], _SlotSink(tier), token)
    return sparse_bags(tier.values, module.mode, [part], ([slots], [bag_offsets], [weights]), (module.tiered_rows,))[0]
