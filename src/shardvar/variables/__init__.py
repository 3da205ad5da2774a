"""ShardedVariable, the shard store behind every sharded thing, sharded lookups and scatter updates.

``functional`` holds the lookups over a :class:`ShardStore` (``embedding``, ``embedding_bag``,
``gather``) that the modules and the distributed layer build on.
"""

from . import _functional as functional
from ._create import create_partitioned_variables, shard_tensor, to_layout
from ._init import RowInitializer
from ._lookup import embedding_bag, embedding_lookup, embedding_lookup_sparse, safe_embedding_lookup_sparse
from ._module import attribute_variables
from ._sharded_variable import ShardedVariable
from ._store import ShardStore
from ._view import ShardsView

__all__ = [
    "ShardsView",
    "RowInitializer",
    "attribute_variables",
    "ShardStore",
    "ShardedVariable",
    "create_partitioned_variables",
    "embedding_bag",
    "embedding_lookup",
    "embedding_lookup_sparse",
    "functional",
    "safe_embedding_lookup_sparse",
    "shard_tensor",
    "to_layout",
]
