"""ShardedVariable, the shard store behind every sharded thing, sharded lookups and scatter updates.

``functional`` holds the lookups over a :class:`ShardStore` (``embedding``, ``embedding_bag``,
``gather``) that the modules and the distributed layer build on.
"""

from . import _functional as functional
from ._autograd import SlabSplit, reading
from ._bag_grad import Part, pools_rows, sparse_bags
from ._create import create_partitioned_variables, shard_tensor, to_layout
from ._distinct import distinct, segments, sort_stable, sparse_rows
from ._functional import (
    BAG_MODES,
    bag_parts,
    check_bag,
    check_weights,
    checked,
    embedding_bag_rows,
    embedding_rows,
    gather_local,
    packed_bag_rows,
    packed_rows,
    segment_sum,
    slab_weight,
    spread,
)
from ._init import RowInitializer
from ._lookup import embedding_bag, embedding_lookup, embedding_lookup_sparse, safe_embedding_lookup_sparse
from ._memory import as_slab, lay_out, shards_over
from ._module import attribute_variables
from ._packed import FORMATS, RowFormat, row_format
from ._plan import storage_ids
from ._relayout import deinterleave, interleave
from ._sharded_variable import ShardedVariable
from ._state_dict import FORMS, check_not_assign, load_logical, register_logical_hooks, reorder, save_logical
from ._store import ShardStore
from ._tier import RowTier, TableStorage, TierSink
from ._update import scatter
from ._values import ids_device
from ._view import ShardsView

__all__ = [
    "BAG_MODES",
    "FORMATS",
    "FORMS",
    "Part",
    "pools_rows",
    "RowFormat",
    "SlabSplit",
    "as_slab",
    "bag_parts",
    "check_bag",
    "check_not_assign",
    "check_weights",
    "checked",
    "deinterleave",
    "distinct",
    "embedding_bag_rows",
    "embedding_rows",
    "gather_local",
    "ids_device",
    "interleave",
    "lay_out",
    "load_logical",
    "packed_bag_rows",
    "packed_rows",
    "reading",
    "register_logical_hooks",
    "reorder",
    "row_format",
    "save_logical",
    "scatter",
    "segment_sum",
    "segments",
    "shards_over",
    "sort_stable",
    "slab_weight",
    "sparse_bags",
    "sparse_rows",
    "spread",
    "storage_ids",
    "ShardsView",
    "RowInitializer",
    "RowTier",
    "TableStorage",
    "TierSink",
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
