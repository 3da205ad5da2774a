"""nn.Modules over sharded tables, and any module's parameters stored as shards."""

from ._collection import EmbeddingBagCollection, KeyedJagged, TableConfig
from ._collection_modules import EmbeddingBagDict, EmbeddingBagList
from ._embedding import ShardedEmbedding, ShardedEmbeddingBag
from ._jagged import JaggedRows
from ._linear import ShardedLinear
from ._parameter import ShardsParametrization, set_state_dict_form, shard_parameter, sharded_parameters
from ._sequence import EmbeddingCollection

__all__ = [
    "EmbeddingBagCollection",
    "EmbeddingBagDict",
    "EmbeddingBagList",
    "EmbeddingCollection",
    "JaggedRows",
    "KeyedJagged",
    "TableConfig",
    "ShardedEmbedding",
    "ShardedEmbeddingBag",
    "ShardedLinear",
    "ShardsParametrization",
    "set_state_dict_form",
    "shard_parameter",
    "sharded_parameters",
]
