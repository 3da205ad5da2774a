"""Tiered storage: a table's rows in a file on disk, the hot ones in a bounded RAM cache.

Layer: above ``dynamic`` (the cache's id -> slot index is the dynamic tables' hash index),
below ``checkpoint``. ``RowFile`` holds every row with its optimizer state; ``RowCache`` keeps
``capacity`` of them in RAM, writes back what changed and reads ahead for the next batch
(``Prefetcher``).
"""

from ._cache import POLICIES, CacheStats, RowCache
from ._describe import BackingFileInfo, describe, is_backing_file
from ._file import BackingFileError, RecordLayout, RowFile
from ._prefetch import Prefetcher
from ._shadow import loading
from ._shards import ShardRows
from ._storage import Tiered, TieredRows, cache_bytes_for

__all__ = [
    "BackingFileError",
    "BackingFileInfo",
    "CacheStats",
    "POLICIES",
    "Prefetcher",
    "RecordLayout",
    "RowCache",
    "RowFile",
    "ShardRows",
    "Tiered",
    "TieredRows",
    "cache_bytes_for",
    "describe",
    "is_backing_file",
    "loading",
]
