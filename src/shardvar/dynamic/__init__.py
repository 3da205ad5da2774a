"""Dynamic tables: ids from an unbounded space, admitted and evicted as the data changes.

Layer: above ``optim`` (reused rows get fresh optimizer state), below ``checkpoint``.
"""

from ._hash import IdInitializer, as_keys, hash_strings, mix64, shard_of
from ._index import HashIndex
from ._module import DynamicEmbedding, DynamicEmbeddingBag, one_of
from ._optim import FRESH, move_rows, reset_rows, state_views
from ._policy import KEY, LFU, LRU, TTL, USED, CountAdmission, ProbabilityAdmission, stable_order
from ._slots import SlotTable

__all__ = [
    "KEY",
    "USED",
    "one_of",
    "stable_order",
    "state_views",
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
