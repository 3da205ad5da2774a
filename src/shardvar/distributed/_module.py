"""DistributedEmbedding: an embedding table whose shards live on the ranks of a process group."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ..variables import RowInitializer
from ._comm import DEFAULT_TIMEOUT
from ._variable import DistributedShardedVariable

__all__ = ["DistributedEmbedding"]


class DistributedEmbedding(nn.Module):
    """``nn.Embedding`` with rows sharded over ranks; each rank holds and trains only its shards.

    Every rank constructs it with the same arguments and calls ``forward`` (and backward) on its
    own ids. Parameters are this rank's shards, ``shards.<index>``; keep them out of
    DistributedDataParallel (they are not replicated), e.g. by wrapping only the dense layers.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        partitioner: Any = None,
        partition_strategy: str = "div",
        *,
        initializer: RowInitializer | None = None,
        placement: Sequence[int] | None = None,
        group: Any = None,
        timeout: float = DEFAULT_TIMEOUT,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.variable = DistributedShardedVariable(
            (num_embeddings, embedding_dim),
            partitioner,
            partition_strategy=partition_strategy,
            dtype=dtype,
            initializer=initializer,
            placement=placement,
            group=group,
            timeout=timeout,
            name="weight",
        )
        self.layout = self.variable.layout
        self.shards = nn.ParameterDict({str(s): p for s, p in self.variable.local_shards().items()})

    def distributed_variables(self) -> dict[str, DistributedShardedVariable]:
        """The module's distributed parameters by local name (checkpoints store each as one variable)."""
        return {"weight": self.variable}

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return self.variable.lookup(input)

    def extra_repr(self) -> str:
        v = self.variable
        where = f"rank={v.comm.rank}/{v.comm.world}, owned={v.owned}"
        return f"{self.num_embeddings}, {self.embedding_dim}, layout={self.layout}, {where}"
