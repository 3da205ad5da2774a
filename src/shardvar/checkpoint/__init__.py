"""Checkpoints of logical variables: save with one layout, restore into any other."""

from .._errors import CheckpointError, CheckpointIOError
from ._async import AsyncSave, release_staging
from ._chain import Chain
from ._load import STAGING_BYTES, load
from ._manifest import MANIFEST, Manifest, VariableEntry
from ._optim import OptimizerRecord, slot_name
from ._quantize import packed_format, quantize_checkpoint
from ._reshard import compact, read_shard, read_shards, reshard
from ._save import save
from ._serve import CheckpointReader, ServedTable, open_checkpoint
from ._write import Coordinator, Entry, Progress, check_dtypes, write

__all__ = [
    "Chain",
    "Entry",
    "MANIFEST",
    "OptimizerRecord",
    "VariableEntry",
    "check_dtypes",
    "packed_format",
    "slot_name",
    "write",
    "STAGING_BYTES",
    "CheckpointError",
    "AsyncSave",
    "CheckpointReader",
    "CheckpointIOError",
    "compact",
    "Coordinator",
    "Manifest",
    "Progress",
    "load",
    "read_shard",
    "release_staging",
    "read_shards",
    "reshard",
    "ServedTable",
    "open_checkpoint",
    "quantize_checkpoint",
    "save",
]
