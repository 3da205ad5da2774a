"""The one exception family of shardvar.

Every error raised on bad input derives from :class:`ShardvarError` and from the matching
built-in, so callers may catch either ``shardvar.ShardvarError`` or ``ValueError`` etc.
"""

from __future__ import annotations

__all__ = ["ShardvarError", "ShardvarValueError", "ShardvarIndexError", "ShardvarTypeError", "ShardvarDistributedError"]


class ShardvarError(Exception):
    """Base class of every exception shardvar raises on bad input."""


class ShardvarValueError(ShardvarError, ValueError):
    """An argument has the right type but a bad value (sizes, shapes, strategies...)."""


class ShardvarIndexError(ShardvarError, IndexError):
    """An id or index lies outside the logical variable."""


class ShardvarTypeError(ShardvarError, TypeError):
    """An argument has the wrong type (non-integer ids, a non-tensor shard...)."""


class ShardvarDistributedError(ShardvarError, RuntimeError):
    """A collective failed or timed out (a peer rank died or hung), or ranks disagree."""
