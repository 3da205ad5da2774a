"""Shards spread over the ranks of a torch.distributed process group (gloo on CPU, NCCL on CUDA)."""

from ._checkpoint import load, save
from ._collection import DistributedEmbeddingBagCollection, DistributedEmbeddingCollection
from ._comm import DEFAULT_TIMEOUT, Comm
from ._dynamic import DistributedDynamicEmbedding
from ._module import DistributedEmbedding, DistributedEmbeddingBag
from ._placement import plan_collection
from ._quantized import QuantizedDistributedEmbeddingBagCollection, QuantizedDistributedEmbeddingCollection
from ._tiered import DistributedTieredEmbedding, DistributedTieredEmbeddingBag
from ._variable import DistributedShardedVariable, distributed_store, round_robin

__all__ = [
    "DEFAULT_TIMEOUT",
    "Comm",
    "DistributedDynamicEmbedding",
    "DistributedEmbedding",
    "DistributedEmbeddingBag",
    "DistributedEmbeddingBagCollection",
    "DistributedEmbeddingCollection",
    "DistributedShardedVariable",
    "DistributedTieredEmbedding",
    "DistributedTieredEmbeddingBag",
    "QuantizedDistributedEmbeddingBagCollection",
    "QuantizedDistributedEmbeddingCollection",
    "distributed_store",
    "load",
    "plan_collection",
    "round_robin",
    "save",
]
