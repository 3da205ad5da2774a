"""nn.Modules over sharded tables, and any module's parameters stored as shards."""

from ._collection import (
    EmbeddingBagCollection,
    KeyedJagged,
    TableConfig,
    check_tables,
    feature_map,
    lookup_tables,
    pack,
    row_dtype,
    split_inputs,
)
from ._collection_build import FeatureMap, pieces
from ._collection_modules import EmbeddingBagDict, EmbeddingBagList
from ._embedding import ShardedEmbedding, ShardedEmbeddingBag
from ._jagged import Features, JaggedRows, PerFeature, Pooled, jagged_split
from ._linear import ShardedLinear
from ._parameter import ShardsParametrization, set_state_dict_form, shard_parameter, sharded_parameters
from ._sequence import EmbeddingCollection
from ._tiered import TieredTable, to_sink, unfused

__all__ = [
    "Features",
    "PerFeature",
    "Pooled",
    "FeatureMap",
    "check_tables",
    "feature_map",
    "jagged_split",
    "lookup_tables",
    "pack",
    "pieces",
    "row_dtype",
    "split_inputs",
    "to_sink",
    "unfused",
    "EmbeddingBagCollection",
    "EmbeddingBagDict",
    "EmbeddingBagList",
    "EmbeddingCollection",
    "JaggedRows",
    "KeyedJagged",
    "TableConfig",
    "TieredTable",
    "ShardedEmbedding",
    "ShardedEmbeddingBag",
    "ShardedLinear",
    "ShardsParametrization",
    "set_state_dict_form",
    "shard_parameter",
    "sharded_parameters",
]
