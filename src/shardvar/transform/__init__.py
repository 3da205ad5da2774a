"""Partition an existing model by a strategy, plan a strategy for devices, run partitioned calls."""

from .._deprecation import deprecated_names
from ._call import PartitionError, StatefulPartitionedCall, partitioned_call
from ._partition_model import ModelPartition, PartitionedParameter, partition_model
from ._planner import Plan, PlanError, plan
from ._spec import PartitionSpec, as_spec, strategy_from_json, strategy_to_json

__all__ = [
    "ModelPartition",
    "PartitionError",
    "PartitionSpec",
    "Plan",
    "PlanError",
    "StatefulPartitionedCall",
    "PartitionedParameter",
    "as_spec",
    "partition_model",
    "partitioned_call",
    "plan",
    "strategy_from_json",
    "strategy_to_json",
]

# Exported once, from shardvar.nn; the old second home warns for one release.
__getattr__ = deprecated_names(__name__, {"ShardsParametrization": ("shardvar.nn", "ShardsParametrization")})
