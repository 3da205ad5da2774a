"""ShardedVariable, sharded lookups and scatter updates."""

from ._create import create_partitioned_variables, shard_tensor, to_layout
from ._gather import gather_rows
from ._init import RowInitializer
from ._lookup import embedding_bag, embedding_lookup, embedding_lookup_sparse, safe_embedding_lookup_sparse
from ._sharded_variable import ShardedVariable

__all__ = [
    "RowInitializer",
    "ShardedVariable",
    "create_partitioned_variables",
    "embedding_bag",
    "embedding_lookup",
    "embedding_lookup_sparse",
    "gather_rows",
    "safe_embedding_lookup_sparse",
    "shard_tensor",
    "to_layout",
]
