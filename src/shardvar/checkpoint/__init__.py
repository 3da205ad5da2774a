"""Checkpoints of logical variables: save with one layout, restore into any other."""

from ._io import load, read_shard, read_shards, reshard, save
from ._manifest import CheckpointError, Manifest

__all__ = ["CheckpointError", "Manifest", "load", "read_shard", "read_shards", "reshard", "save"]
