"""ShardedEmbedding and ShardedEmbeddingBag: drop-ins for nn.Embedding and nn.EmbeddingBag.

Both keep their table in a :class:`ShardStore` and look it up with ``F.embedding`` /
``F.embedding_bag`` semantics through ``variables.functional``; the distributed modules are these
same classes over a store whose other shards live on other ranks.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .._errors import ShardvarValueError
from .._pages import empty
from .._validate import (
    check_bag_mode,
    check_bool,
    check_device,
    check_float_dtype,
    check_int,
    check_number,
)
from ..layout import Layout
from ..variables import ShardStore, functional, to_layout
from ._sharded_weight import ShardedWeight
from ._tiered import TieredTable, forward_bag, forward_embedding

__all__ = ["ShardedEmbedding", "ShardedEmbeddingBag", "TieredEmbedding", "TieredEmbeddingBag"]


def _initial_weight(
    shape: tuple[int, int], weight: torch.Tensor | None, device: Any, dtype: torch.dtype | None
) -> torch.Tensor:
    device = None if device is None else check_device(device)  # a bad device: shardvar's error, not torch's
    if weight is None:
        out = empty(shape, device=device, dtype=dtype)
        nn.init.normal_(out)  # drawn once for the whole table: values never depend on the layout
        return out
    if not isinstance(weight, torch.Tensor) or tuple(weight.shape) != shape:
        got = list(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__
        raise ShardvarValueError(f"_weight has shape {got}; expected {list(shape)}")
    return weight.detach().to(device=device or weight.device, dtype=dtype or weight.dtype)


class _ShardedTable(ShardedWeight):
    """The shards of one ``[num_embeddings, embedding_dim]`` table, as nn.Parameters ``shard_<i>`` (a mixin).

    The concrete modules also subclass ``nn.Embedding`` / ``nn.EmbeddingBag`` (without their
    full-size ``weight``), so code that checks for an embedding (DDP's sparse gradients, model
    initialisers that fill ``module.weight.data``) treats them as one.
    """

    def __new__(cls, *args: Any, storage: Any = None, **kwargs: Any) -> Any:
        # storage=shardvar.Tiered(...): the table's tiered twin (a subclass: isinstance still holds)
        if storage is not None and not issubclass(cls, TieredTable):
            if cls not in _TIERED:
                raise ShardvarValueError(
                    f"storage= is not supported by {cls.__name__} (its rows are held in RAM): a tiered table is a "
                    "ShardedEmbedding, a ShardedEmbeddingBag or a TableConfig of a local collection"
                )
            cls = _TIERED[cls]
        return super().__new__(cls)

    # nn.Embedding's signature plus the layout's arguments, as DynamicEmbedding's and (for
    # nn.Linear) ShardedLinear's are: alike in shape because each is a drop-in for a torch module.
    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        partitioner: Any = 1,
        partition_strategy: str = "div",
        padding_idx: int | None = None,
        max_norm: float | None = None,
        norm_type: float = 2.0,
        scale_grad_by_freq: bool = False,
        sparse: bool = False,
        _weight: torch.Tensor | None = None,
        _freeze: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        devices: list[torch.device | str] | None = None,
        *,
        _store: ShardStore | None = None,
        storage: Any = None,  # given (shardvar.Tiered): __new__ made this a TieredEmbedding(Bag)
    ) -> None:
        nn.Module.__init__(self)  # not nn.Embedding's: it would allocate the whole table
        dtype = check_float_dtype(dtype)
        self.num_embeddings = check_int(num_embeddings, "num_embeddings", minimum=0)
        self.embedding_dim = check_int(embedding_dim, "embedding_dim", minimum=0)
        shape = (self.num_embeddings, self.embedding_dim)
        self.layout: Layout = (
            _store.layout
            if _store is not None
            else to_layout(partitioner, shape, dtype or torch.float32, partition_strategy)
        )
        if self.layout.axis != 0:
            raise ShardvarValueError(f"an embedding table is split by rows (axis 0); got {self.layout}")
        self.padding_idx = functional.check_padding_idx(padding_idx, self.num_embeddings)
        self.max_norm = check_number(max_norm, "max_norm", positive=True, allow_none=True)
        self.norm_type = check_number(norm_type, "norm_type")
        self.scale_grad_by_freq = check_bool(scale_grad_by_freq, "scale_grad_by_freq")
        self.sparse = check_bool(sparse, "sparse")
        if _store is None:
            weight = _initial_weight(shape, _weight, device, dtype)
            if self.padding_idx is not None and _weight is None:
                weight[self.padding_idx].zero_()
            _store = ShardStore.allocate(
                self.layout, shape, weight.dtype, devices=devices, values=weight, requires_grad=True
            )
        for p in _store.local_shards().values():
            p.requires_grad_(not check_bool(_freeze, "freeze"))
        self._adopt(_store)

    def _fill_padding_idx_with_zero(self) -> None:
        if self.padding_idx is not None:
            self.weight[self.padding_idx] = 0

    def reset_parameters(self) -> None:
        weight = empty((self.num_embeddings, self.embedding_dim), dtype=self.store.dtype)
        nn.init.normal_(weight)
        if self.padding_idx is not None:
            weight[self.padding_idx].zero_()
        self.weight.assign(weight)

    def extra_repr(self) -> str:
        s = f"{self.num_embeddings}, {self.embedding_dim}, layout={self.layout}"
        for name in ("padding_idx", "max_norm"):
            if getattr(self, name) is not None:
                s += f", {name}={getattr(self, name)}"
        if self.scale_grad_by_freq:
            s += ", scale_grad_by_freq=True"
        if self.sparse:
            s += ", sparse=True"
        return s

    @classmethod
    def from_pretrained(cls, embeddings: torch.Tensor, freeze: bool = True, **kwargs: Any):
        """Build from an existing ``[num_embeddings, embedding_dim]`` weight (copied into shards).

        With ``freeze=True`` (the default, as nn.Embedding's) the shards do not require grad.
        """
        if not isinstance(embeddings, torch.Tensor) or embeddings.dim() != 2:
            got = list(embeddings.shape) if isinstance(embeddings, torch.Tensor) else type(embeddings).__name__
            raise ShardvarValueError(f"embeddings must be a 2-D tensor; got {got}")
        return cls(*embeddings.shape, _weight=embeddings, _freeze=freeze, **kwargs)


class ShardedEmbedding(_ShardedTable, nn.Embedding):
    """``nn.Embedding`` whose table is split into shards by a partitioner, config or shard count.

    >>> torch.manual_seed(0) and None
    >>> emb = ShardedEmbedding(10, 3, partitioner=4, partition_strategy="mod")
    >>> emb(torch.tensor([[1, 9]])).shape
    torch.Size([1, 2, 3])
    >>> [tuple(p.shape) for p in emb.parameters()]
    [(3, 3), (3, 3), (2, 3), (2, 3)]
    """

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return functional.embedding(
            self.store,
            input,
            padding_idx=self.padding_idx,
            max_norm=self.max_norm,
            norm_type=self.norm_type,
            scale_grad_by_freq=self.scale_grad_by_freq,
            sparse=self.sparse,
        )


class ShardedEmbeddingBag(_ShardedTable, nn.EmbeddingBag):
    """``nn.EmbeddingBag`` (modes sum, mean, max) over a sharded table."""

    # Alike in shape to _ShardedTable's signature (`duplicates` pairs them), on purpose: a drop-in
    # takes nn.EmbeddingBag's positional order (mode before sparse, padding_idx last), which is
    # not nn.Embedding's; every rule past the signature is the base class's.
    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        partitioner: Any = 1,
        partition_strategy: str = "div",
        max_norm: float | None = None,
        norm_type: float = 2.0,
        scale_grad_by_freq: bool = False,
        mode: str = "mean",
        sparse: bool = False,
        _weight: torch.Tensor | None = None,
        include_last_offset: bool = False,
        padding_idx: int | None = None,
        **kwargs: Any,
    ) -> None:
        self_mode = check_bag_mode(mode)
        super().__init__(
            num_embeddings,
            embedding_dim,
            partitioner,
            partition_strategy,
            padding_idx=padding_idx,
            max_norm=max_norm,
            norm_type=norm_type,
            scale_grad_by_freq=scale_grad_by_freq,
            sparse=sparse,
            _weight=_weight,
            **kwargs,
        )
        self.mode, self.include_last_offset = self_mode, check_bool(include_last_offset, "include_last_offset")

    def forward(
        self, input: torch.Tensor, offsets: torch.Tensor | None = None, per_sample_weights: torch.Tensor | None = None
    ) -> torch.Tensor:
        # Every option passed on by name: alike in shape to other keyword pass-throughs, not a rule.
        return functional.embedding_bag(
            self.store,
            input,
            offsets,
            mode=self.mode,
            per_sample_weights=per_sample_weights,
            padding_idx=self.padding_idx,
            include_last_offset=self.include_last_offset,
            max_norm=self.max_norm,
            norm_type=self.norm_type,
            scale_grad_by_freq=self.scale_grad_by_freq,
            sparse=self.sparse,
        )

    def extra_repr(self) -> str:
        return super().extra_repr() + f", mode={self.mode!r}"


class TieredEmbedding(TieredTable, ShardedEmbedding):
    """A ShardedEmbedding whose rows live in a backing file, the hot ones in a bounded cache (``storage=``)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return forward_embedding(self, input)


class TieredEmbeddingBag(TieredTable, ShardedEmbeddingBag):
    """A ShardedEmbeddingBag whose rows live in a backing file, the hot ones in a bounded cache (``storage=``)."""

    def forward(
        self, input: torch.Tensor, offsets: torch.Tensor | None = None, per_sample_weights: torch.Tensor | None = None
    ) -> torch.Tensor:
        return forward_bag(self, input, offsets, per_sample_weights)


_TIERED: dict[type, type] = {ShardedEmbedding: TieredEmbedding, ShardedEmbeddingBag: TieredEmbeddingBag}
