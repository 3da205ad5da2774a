"""Quantized serving tables: int8 / int4 row-wise and float16 packed rows, sharded like their float twins.

``quantize(source, dtype)`` packs a trained ``ShardedEmbedding(Bag)``, ``EmbeddingBagCollection``,
``EmbeddingCollection`` (or their distributed twins, each rank its own shards; ``accepted()`` lists
them) with torch's row-wise CPU kernels; the inference modules look the packed slab up in one
kernel call per table, the collections through their float twins' own lookup. Checkpoint paths are
quantized shard by shard (``shardvar.checkpoint``'s ``quantize_checkpoint``).
"""

from ..variables import FORMATS, RowFormat, row_format
from ._collections import QuantizedEmbeddingBagCollection, QuantizedEmbeddingCollection
from ._modules import PackedVariable, QuantizedEmbedding, QuantizedEmbeddingBag
from ._quantize import accepted, quantize, quantize_table, register

__all__ = [
    "quantize_table",
    "FORMATS",
    "PackedVariable",
    "QuantizedEmbedding",
    "QuantizedEmbeddingBag",
    "QuantizedEmbeddingBagCollection",
    "QuantizedEmbeddingCollection",
    "RowFormat",
    "accepted",
    "quantize",
    "register",
    "row_format",
]
