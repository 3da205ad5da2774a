"""Checkpoints of logical variables: save with one layout, restore into any other."""

from .._errors import CheckpointError, CheckpointIOError
from ._load import STAGING_BYTES, load
from ._manifest import Manifest
from ._reshard import read_shard, read_shards, reshard
from ._save import save
from ._write import Coordinator, Progress

__all__ = [
    "STAGING_BYTES",
    "CheckpointError",
    "CheckpointIOError",
    "Coordinator",
    "Manifest",
    "Progress",
    "load",
    "read_shard",
    "read_shards",
    "reshard",
    "save",
]
