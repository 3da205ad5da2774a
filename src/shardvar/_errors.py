"""The one exception family of shardvar.

Every error raised on bad input derives from :class:`ShardvarError` and from the matching
built-in, so callers may catch either ``shardvar.ShardvarError`` or ``ValueError`` etc.
"""

from __future__ import annotations

__all__ = [
    "ShardvarError",
    "ShardvarValueError",
    "ShardvarIndexError",
    "ShardvarTypeError",
    "ShardvarIntegerError",
    "ShardvarDTypeError",
    "ShardvarDeviceError",
    "ShardvarDistributedError",
    "CheckpointError",
    "CheckpointIOError",
]


class ShardvarError(Exception):
    """Base class of every exception shardvar raises on bad input."""


class ShardvarValueError(ShardvarError, ValueError):
    """An argument has the right type but a bad value (sizes, shapes, strategies...)."""


class ShardvarIndexError(ShardvarError, IndexError):
    """An id or index lies outside the logical variable."""


class ShardvarTypeError(ShardvarError, TypeError):
    """An argument has the wrong type (non-integer ids, a non-tensor shard...)."""


class ShardvarIntegerError(ShardvarTypeError, ShardvarValueError):
    """A non-integer (a float, a bool, a string...) where an integer is expected.

    It is a TypeError, and also a ValueError for callers that validate counts and sizes by
    catching ValueError (as numpy's AxisError is both a ValueError and an IndexError).
    """


class ShardvarDTypeError(ShardvarTypeError, ShardvarValueError):
    """Tensors whose dtypes must agree do not (mixed-dtype shards, weights of another dtype).

    A TypeError, as in the reference, and a ValueError for callers that check values that way.
    """


class ShardvarDeviceError(ShardvarValueError):
    """A device that does not parse (``"nonsense"``) or does not exist here (``"cuda:9"`` without a GPU)."""


class ShardvarDistributedError(ShardvarError, RuntimeError):
    """A collective failed or timed out (a peer rank died or hung), or ranks disagree."""


class CheckpointError(ShardvarError, ValueError):
    """A checkpoint is missing, damaged, or does not match the objects it is loaded into."""


class CheckpointIOError(CheckpointError, OSError):
    """Reading or writing a checkpoint's files failed (disk full, permissions, a lock held too long)."""
