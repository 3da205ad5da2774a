"""shardvar: partitioned variables for PyTorch.

Layers, each importable without the ones above it: ``shardvar.layout`` (pure layout math) ->
``shardvar.partitioners`` -> ... The public names are re-exported here one by one.
``shardvar.tf`` is imported on first use (it needs protobuf, which ``import shardvar`` never loads).
"""

from . import dynamic, optim
from ._errors import (
    ShardvarDeviceError,
    ShardvarDistributedError,
    ShardvarDTypeError,
    ShardvarError,
    ShardvarIndexError,
    ShardvarIntegerError,
    ShardvarTypeError,
    ShardvarValueError,
)
from .checkpoint import (
    AsyncSave,
    CheckpointError,
    CheckpointIOError,
    compact,
    load,
    read_shard,
    read_shards,
    reshard,
    save,
)
from .checkpoint import open_checkpoint as open  # shardvar.open(path), as zarr.open
from .distributed import DistributedEmbedding, DistributedShardedVariable
from .dynamic import DynamicEmbedding, DynamicEmbeddingBag
from .layout import Layout, SlicePlan, ceil_sizes
from .nn import (
    EmbeddingBagCollection,
    EmbeddingCollection,
    JaggedRows,
    KeyedJagged,
    ShardedEmbedding,
    ShardedEmbeddingBag,
    ShardedLinear,
    TableConfig,
    shard_parameter,
    sharded_parameters,
)
from .optim import RowWiseAdagrad, RowWiseAdam, TableOptimizer
from .partitioners import (
    FixedShardsPartitioner,
    MaxSizePartitioner,
    MinSizePartitioner,
    Partitioner,
    PartitionerConfig,
    fixed_size_partitioner,
    min_max_variable_partitioner,
    variable_axis_size_partitioner,
)
from .quantized import (
    QuantizedEmbedding,
    QuantizedEmbeddingBag,
    QuantizedEmbeddingBagCollection,
    QuantizedEmbeddingCollection,
    quantize,
)
from .tiered import Tiered
from .transform import (
    PartitionSpec,
    Plan,
    StatefulPartitionedCall,
    partition_model,
    partitioned_call,
    plan,
)
from .variables import (
    RowInitializer,
    ShardedVariable,
    create_partitioned_variables,
    embedding_bag,
    embedding_lookup,
    embedding_lookup_sparse,
    safe_embedding_lookup_sparse,
    shard_tensor,
)
from .variables._torch_function import ShardvarMaterializeWarning

__version__ = "0.1.0"

_LAZY = ("tf",)  # subpackages imported on first attribute access: their dependencies load only then


def __getattr__(name: str) -> object:
    if name in _LAZY:
        import importlib

        return importlib.import_module(f"{__name__}.{name}")  # also binds it here: later accesses skip this
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


__all__ = [
    "CheckpointError",
    "CheckpointIOError",
    "DistributedEmbedding",
    "DistributedShardedVariable",
    "DynamicEmbedding",
    "DynamicEmbeddingBag",
    "FixedShardsPartitioner",
    "Layout",
    "MaxSizePartitioner",
    "MinSizePartitioner",
    "Partitioner",
    "PartitionSpec",
    "PartitionerConfig",
    "Plan",
    "RowInitializer",
    "ShardedEmbedding",
    "StatefulPartitionedCall",
    "Tiered",
    "ShardedEmbeddingBag",
    "ShardedLinear",
    "ShardedVariable",
    "ShardvarDeviceError",
    "ShardvarDistributedError",
    "ShardvarDTypeError",
    "ShardvarError",
    "ShardvarIndexError",
    "ShardvarIntegerError",
    "ShardvarMaterializeWarning",
    "ShardvarTypeError",
    "ShardvarValueError",
    "SlicePlan",
    "ceil_sizes",
    "create_partitioned_variables",
    "embedding_bag",
    "embedding_lookup",
    "embedding_lookup_sparse",
    "fixed_size_partitioner",
    "load",
    "open",
    "EmbeddingBagCollection",
    "KeyedJagged",
    "EmbeddingCollection",
    "JaggedRows",
    "TableConfig",
    "dynamic",
    "optim",
    "RowWiseAdagrad",
    "RowWiseAdam",
    "TableOptimizer",
    "min_max_variable_partitioner",
    "partition_model",
    "partitioned_call",
    "plan",
    "read_shard",
    "read_shards",
    "reshard",
    "safe_embedding_lookup_sparse",
    "save",
    "compact",
    "AsyncSave",
    "shard_parameter",
    "shard_tensor",
    "sharded_parameters",
    "variable_axis_size_partitioner",
    "QuantizedEmbedding",
    "QuantizedEmbeddingBag",
    "QuantizedEmbeddingBagCollection",
    "QuantizedEmbeddingCollection",
    "quantize",
]
