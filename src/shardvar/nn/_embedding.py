"""ShardedEmbedding and ShardedEmbeddingBag: drop-ins for nn.Embedding and nn.EmbeddingBag."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .._errors import ShardvarValueError
from ..layout import as_ids
from ..variables import ShardedVariable, embedding_bag, gather_rows, shard_tensor, to_layout
from ..variables._update import split_by_shard

__all__ = ["ShardedEmbedding", "ShardedEmbeddingBag"]


class _ShardedTable(nn.Module):
    """The shards of one ``[num_embeddings, embedding_dim]`` table, as nn.Parameters ``shards.0``, ..."""

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
    ) -> None:
        super().__init__()
        shape = (num_embeddings, embedding_dim)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.layout = to_layout(partitioner, shape, dtype or torch.float32, partition_strategy)
        if self.layout.axis != 0:
            raise ShardvarValueError(f"an embedding table is split by rows (axis 0); got {self.layout}")
        if padding_idx is not None:
            if not -num_embeddings <= padding_idx < num_embeddings:
                raise ShardvarValueError(
                    f"padding_idx must be within [-{num_embeddings}, {num_embeddings}); got {padding_idx}"
                )
            padding_idx %= num_embeddings
        self.padding_idx, self.max_norm, self.norm_type = padding_idx, max_norm, norm_type
        self.scale_grad_by_freq, self.sparse = scale_grad_by_freq, sparse
        if _weight is None:
            weight = torch.empty(shape, device=device, dtype=dtype)
            nn.init.normal_(weight)  # drawn once for the whole table: values never depend on the layout
            if padding_idx is not None:
                weight[padding_idx].zero_()
        else:
            if tuple(_weight.shape) != shape:
                raise ShardvarValueError(f"_weight has shape {list(_weight.shape)}; expected {list(shape)}")
            weight = _weight.detach().to(device=device or _weight.device, dtype=dtype or _weight.dtype)
        variable = shard_tensor(weight, self.layout, devices=devices, requires_grad=not _freeze)
        self.shards = nn.ParameterList(variable.variables)

    @property
    def weight(self) -> ShardedVariable:
        """The table as one ShardedVariable over this module's shard parameters."""
        return ShardedVariable(list(self.shards), strategy=self.layout.strategy, name="weight")

    def sharded_variables(self) -> dict[str, ShardedVariable]:
        """The module's sharded parameters by local name (checkpoints store each as one variable)."""
        return {"weight": self.weight}

    def _renorm(self, ids: torch.Tensor) -> None:
        # nn.Embedding's max_norm rewrites the looked-up rows in place; so do we, shard by shard.
        with torch.no_grad():
            for s, _, rows in split_by_shard(self.layout, torch.unique(ids.reshape(-1))):
                shard = self.shards[s]
                torch.embedding_renorm_(shard, rows.to(shard.device), self.max_norm, self.norm_type)

    def _ids(self, input: torch.Tensor) -> torch.Tensor:
        return as_ids(input, device=None if isinstance(input, torch.Tensor) else self.shards[0].device)

    def reset_parameters(self) -> None:
        weight = torch.empty(self.num_embeddings, self.embedding_dim, dtype=self.shards[0].dtype)
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
        """Build from an existing ``[num_embeddings, embedding_dim]`` weight (copied into shards)."""
        if embeddings.dim() != 2:
            raise ShardvarValueError(f"embeddings must be 2-D; got shape {list(embeddings.shape)}")
        return cls(*embeddings.shape, _weight=embeddings, _freeze=freeze, **kwargs)


class ShardedEmbedding(_ShardedTable):
    """``nn.Embedding`` whose table is split into shards by a partitioner, config or shard count.

    >>> torch.manual_seed(0) and None
    >>> emb = ShardedEmbedding(10, 3, partitioner=4, partition_strategy="mod")
    >>> emb(torch.tensor([[1, 9]])).shape
    torch.Size([1, 2, 3])
    >>> [tuple(p.shape) for p in emb.parameters()]
    [(3, 3), (3, 3), (2, 3), (2, 3)]
    """

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        ids = self._ids(input)
        if self.max_norm is not None:
            self._renorm(ids)
        return gather_rows(
            list(self.shards),
            self.layout,
            ids,
            padding_idx=self.padding_idx,
            sparse=self.sparse,
            scale_grad_by_freq=self.scale_grad_by_freq,
        )


class ShardedEmbeddingBag(_ShardedTable):
    """``nn.EmbeddingBag`` (modes sum, mean, max) over a sharded table."""

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
        if mode not in ("sum", "mean", "max"):
            raise ShardvarValueError(f"mode must be 'sum', 'mean' or 'max'; got {mode!r}")
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
        self.mode, self.include_last_offset = mode, include_last_offset

    def forward(
        self, input: torch.Tensor, offsets: torch.Tensor | None = None, per_sample_weights: torch.Tensor | None = None
    ) -> torch.Tensor:
        ids = self._ids(input)
        if self.max_norm is not None:
            self._renorm(ids)
        return embedding_bag(
            self.weight,
            ids,
            offsets,
            mode=self.mode,
            per_sample_weights=per_sample_weights,
            padding_idx=self.padding_idx,
            include_last_offset=self.include_last_offset,
            sparse=self.sparse,
            scale_grad_by_freq=self.scale_grad_by_freq,
        )

    def extra_repr(self) -> str:
        return super().extra_repr() + f", mode={self.mode!r}"
