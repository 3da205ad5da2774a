"""nn.Modules over sharded tables."""

from ._embedding import ShardedEmbedding, ShardedEmbeddingBag

__all__ = ["ShardedEmbedding", "ShardedEmbeddingBag"]
