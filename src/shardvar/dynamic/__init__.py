"""Dynamic tables: ids from an unbounded space, admitted and evicted as the data changes.

Layer: above ``optim`` (reused rows get fresh optimizer state), below ``checkpoint``.
"""

from ._hash import IdInitializer, as_keys, hash_strings, mix64, shard_of
from ._index import HashIndex
from ._module import DynamicEmbedding, DynamicEmbeddingBag
from ._optim import FRESH, move_rows, reset_rows
from ._policy import LFU, LRU, TTL, CountAdmission, ProbabilityAdmission
from ._slots import SlotTable

__all__ = [
    "DynamicEmbedding",
    "DynamicEmbeddingBag",
    "IdInitializer",
    "CountAdmission",
    "ProbabilityAdmission",
    "LRU",
    "LFU",
    "TTL",
    "SlotTable",
    "HashIndex",
    "FRESH",
    "as_keys",
    "hash_strings",
    "mix64",
    "shard_of",
    "move_rows",
    "reset_rows",
]
