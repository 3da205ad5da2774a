"""Quantized serving tables: int8 / int4 row-wise and float16 packed rows, sharded like their float twins.

``quantize(source, dtype)`` packs a trained ``ShardedEmbedding(Bag)``, ``EmbeddingBagCollection``
(or their distributed twins, each rank its own shards) with torch's row-wise CPU kernels; the
inference modules look the packed slab up in one kernel call per table. Checkpoint paths are
quantized shard by shard (``shardvar.checkpoint``'s ``quantize_checkpoint``).
"""

from ..variables._packed import FORMATS, RowFormat, row_format
from ._modules import PackedVariable, QuantizedEmbedding, QuantizedEmbeddingBag, QuantizedEmbeddingBagCollection
from ._quantize import quantize

__all__ = [
    "FORMATS",
    "PackedVariable",
    "QuantizedEmbedding",
    "QuantizedEmbeddingBag",
    "QuantizedEmbeddingBagCollection",
    "RowFormat",
    "quantize",
    "row_format",
]
