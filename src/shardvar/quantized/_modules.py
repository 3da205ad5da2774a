"""Inference modules over packed tables: drop-ins for ShardedEmbedding(Bag) (the collections: ``_collections``).

A packed table keeps its float twin's layout: its shards (``shard_<i>`` buffers, packed rows as
``[rows, width]``) are views of one packed slab, so a lookup is one kernel call. The modules are
inference-only: their rows are bytes with no gradient, so a forward that could train them
(training mode with autograd on) or asking them for gradients raises instead of silently
leaving the table unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .._errors import ShardvarValueError
from ..layout import Layout
from ..variables import RowFormat, ShardStore, checked, ids_device
from . import _lookup

__all__ = ["PackedVariable", "QuantizedEmbedding", "QuantizedEmbeddingBag"]

_INFERENCE_ONLY = (
    "{name} is inference-only: its rows are quantized ({fmt}) and cannot be trained; {fix}. "
    "Train the float table and quantize it again (shardvar.quantize)"
)


@dataclass(frozen=True)
class PackedVariable:
    """A packed table as the checkpoint sees it: a sharded object of stored rows plus its format."""

    layout: Layout
    shape: tuple[int, int]  # [rows, stored elements per row]
    dtype: torch.dtype  # the storage dtype (uint8, or float16)
    store: ShardStore
    packed: dict[str, Any]  # {"dtype": format name, "dim": the table's width}

    def local_shards(self) -> dict[int, torch.Tensor]:
        return self.store.local_shards()


class _QuantizedTable(nn.Module):
    """A ``[num_embeddings, embedding_dim]`` table held as packed rows in ``fmt``, split by ``layout``."""

    lookup_dtype = torch.float32  # what its lookups return (and per_sample_weights take): rows dequantized
    embedding_tables = ("weight",)  # a checkpoint records its variable as an embedding table

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        layout: Layout,
        fmt: RowFormat,
        shards: dict[int, torch.Tensor],
        *,
        padding_idx: int | None = None,
        exchange: Any = None,
    ) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.layout, self.format = num_embeddings, embedding_dim, layout, fmt
        self.padding_idx = padding_idx
        self._store = ShardStore(layout, (num_embeddings, fmt.width(embedding_dim)), shards, dtype=fmt.storage)
        self._store.attach(exchange=exchange)
        for s, t in self._store.local_shards().items():
            self.register_buffer(f"shard_{s}", t)
        self.eval()  # serving is what it is for; train() makes a grad-enabled forward refuse

    @property
    def store(self) -> ShardStore:
        """The store over the ``shard_<i>`` buffers (rebuilt if ``.to(...)`` replaced them)."""
        current = {int(n[6:]): t for n, t in self._buffers.items() if n.startswith("shard_")}
        if any(current[s] is not t for s, t in self._store.local_shards().items()):
            self._store = self._store.with_shards(current, dtype=self.format.storage)
        return self._store.refresh()

    @property
    def dtype(self) -> torch.dtype:
        """The quantized dtype: torch.quint8, torch.quint4x2 or torch.float16."""
        return self.format.dtype

    @property
    def nbytes(self) -> int:
        """Bytes of this process's packed rows, scale and bias included."""
        return self.store.nbytes

    def sharded_variables(self) -> dict[str, PackedVariable]:
        store = self.store
        packed = {"dtype": self.format.name, "dim": self.embedding_dim}
        return {"weight": PackedVariable(self.layout, tuple(store.shape), store.dtype, store, packed)}

    def dequantize(self) -> torch.Tensor:
        """The whole table as float32 ``[num_embeddings, embedding_dim]`` (every rank's rows: collective)."""
        return self.lookup(torch.arange(self.num_embeddings, device=ids_device(self.store)))

    def lookup(self, ids: Any) -> torch.Tensor:
        """Rows ``ids`` (any shape) dequantized to float32."""
        checked(self.store, self._check_inference)  # a distributed table's ranks agree on it
        return _lookup.rows(self.store, self.format, ids, self.embedding_dim)

    def requires_grad_(self, requires_grad: bool = True) -> _QuantizedTable:
        if requires_grad:
            raise ShardvarValueError(
                _INFERENCE_ONLY.format(name=type(self).__name__, fmt=self.format.name, fix="it has no gradient")
            )
        return self

    def _check_inference(self) -> None:
        if self.training and torch.is_grad_enabled():
            raise ShardvarValueError(
                _INFERENCE_ONLY.format(
                    name=type(self).__name__,
                    fmt=self.format.name,
                    fix="call .eval() or look up under torch.no_grad() / torch.inference_mode()",
                )
            )

    def extra_repr(self) -> str:
        s = f"{self.num_embeddings}, {self.embedding_dim}, dtype={self.format.name}, layout={self.layout}"
        return s + (f", padding_idx={self.padding_idx}" if self.padding_idx is not None else "")


class QuantizedEmbedding(_QuantizedTable):
    """``ShardedEmbedding``'s forward (rows, dequantized to float32) over a packed table."""

    def forward(self, input: Any) -> torch.Tensor:
        return self.lookup(input)


class QuantizedEmbeddingBag(_QuantizedTable):
    """``ShardedEmbeddingBag``'s forward (sum, mean, max; offsets, per_sample_weights, padding_idx,
    include_last_offset) over a packed table: the result of bagging the dequantized rows."""

    def __init__(self, *args: Any, mode: str = "mean", include_last_offset: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.mode, self.include_last_offset = mode, include_last_offset

    def forward(self, input: Any, offsets: Any = None, per_sample_weights: Any = None) -> torch.Tensor:
        checked(self.store, self._check_inference)  # a distributed table's ranks agree on it
        # The float bag's forward arguments passed on by name: alike in shape to ShardedEmbeddingBag's
        # call (`duplicates` pairs them) because this is its drop-in, not because a rule repeats.
        return _lookup.bag(
            self.store,
            self.format,
            input,
            offsets,
            mode=self.mode,
            per_sample_weights=per_sample_weights,
            padding_idx=self.padding_idx,
            include_last_offset=self.include_last_offset,
        )

    def extra_repr(self) -> str:
        return super().extra_repr() + f", mode={self.mode!r}"
