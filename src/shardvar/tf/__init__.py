"""TensorFlow checkpoints, read without TensorFlow: list, load, and convert into shardvar checkpoints.

A layer above ``shardvar.checkpoint`` (it writes through it) and below the CLI. Reads both kinds
TensorFlow writes in its tensor-bundle format: ``tf.compat.v1.train.Saver`` checkpoints (a
PartitionedVariable is saved as slices of one name) and object-based ``tf.train.Checkpoint``
ones (a ShardedVariable likewise; optimizer slots recorded in the object graph).
"""

from ._api import list_variables, load_variable
from ._convert import Conversion, convert
from ._graph import short_name
from ._reader import TFCheckpoint
from ._slices import spec as slice_spec

__all__ = [
    "short_name","Conversion", "TFCheckpoint", "convert", "list_variables", "load_variable", "slice_spec"]
