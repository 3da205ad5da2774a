"""Stable 64-bit hashing of ids, and rows that depend on the id alone.

Every rule that decides where an id lives or what its first row holds is a pure function of
the id: splitmix64's output function (``mix64``) on int64 tensors, and BLAKE2b (first 8 bytes,
little-endian, signed) for strings. So a row, its shard and its admission are the same for any
shard count, world size, device or order of arrival.
"""

from __future__ import annotations

import hashlib
import math
from typing import Any

import torch

from .._errors import ShardvarTypeError, ShardvarValueError
from .._validate import check_choice, check_int, check_number
from ..layout import as_ids

__all__ = ["mix64", "hash_strings", "as_keys", "shard_of", "uniform01", "IdInitializer"]


def _signed(c: int) -> int:
    return c - (1 << 64) if c >= 1 << 63 else c


GOLDEN = _signed(0x9E3779B97F4A7C15)
_M1, _M2 = _signed(0xBF58476D1CE4E5B9), _signed(0x94D049BB133111EB)


def _shr(z: torch.Tensor, k: int) -> torch.Tensor:
    """Logical shift right (torch's ``>>`` on int64 is arithmetic)."""
    return (z >> k) & ((1 << (64 - k)) - 1)


def mix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's first output for state ``x`` (int64 arithmetic wraps, as the C reference's uint64)."""
    z = x.to(torch.int64) + GOLDEN
    z = (z ^ _shr(z, 30)) * _M1
    z = (z ^ _shr(z, 27)) * _M2
    return z ^ _shr(z, 31)


def hash_strings(strings: list[str]) -> torch.Tensor:
    """BLAKE2b-64 of each UTF-8 string as a signed int64 (hashlib has no batched form: one call per string)."""
    out = [int.from_bytes(hashlib.blake2b(s.encode(), digest_size=8).digest(), "little", signed=True) for s in strings]
    return torch.tensor(out, dtype=torch.int64)


def _flatten_strings(ids: Any) -> tuple[list[str], list[int]] | None:
    """Strings nested in lists, flattened, with the nested shape; None if ``ids`` holds no strings."""
    if isinstance(ids, str):
        return [ids], []
    if not isinstance(ids, (list, tuple)) or not ids or not any(isinstance(i, (str, list, tuple)) for i in ids):
        return None
    parts = [_flatten_strings(i) for i in ids]
    if any(p is None for p in parts):
        raise ShardvarTypeError(f"ids mix strings and other values; got {ids!r:.80}")
    shapes = {tuple(p[1]) for p in parts}
    if len(shapes) != 1:
        raise ShardvarValueError(f"nested string ids must form a rectangular shape; got {ids!r:.80}")
    return [s for p in parts for s in p[0]], [len(parts), *parts[0][1]]


def as_keys(ids: Any, device: torch.device | str | None = None) -> torch.Tensor:
    """Ids as int64 keys: integer tensors and lists as they are, strings (nested in lists) hashed."""
    strings = _flatten_strings(ids)
    if strings is None:
        return as_ids(ids, device).to(torch.int64)
    flat, shape = strings
    if not all(isinstance(s, str) for s in flat):
        raise ShardvarTypeError(f"ids mix strings and other values; got {ids!r:.80}")
    return hash_strings(flat).reshape(shape).to(device)


def shard_of(keys: torch.Tensor, num_shards: int, hashes: torch.Tensor | None = None) -> torch.Tensor:
    """The shard (or rank) that owns each key: the high 31 bits of ``mix64(key)`` modulo the count.

    The hash index uses the low bits of the same hash for the bucket, so the two are independent.
    """
    return _shr(mix64(keys) if hashes is None else hashes, 33) % num_shards


def uniform01(h: torch.Tensor) -> torch.Tensor:
    """A float64 in (0, 1] from the top 53 bits of a 64-bit hash."""
    return (_shr(h, 11) + 1).to(torch.float64) * 2.0**-53


class IdInitializer:
    """A row made from the id alone: ``normal`` (mean 0, ``std``) or ``uniform`` (in ``[-bound, bound]``).

    Columns ``2p`` and ``2p + 1`` come from the two 32-bit halves of the p-th output of a splitmix64
    stream seeded by the id and ``seed`` (Box-Muller for normal). The default, normal with std 1,
    is nn.Embedding's.
    """

    def __init__(self, kind: str = "normal", *, std: float = 1.0, bound: float = 0.05, seed: int = 0) -> None:
        self.kind = check_choice(kind, "kind", ("normal", "uniform"))
        self.std = check_number(std, "std", positive=True)
        self.bound = check_number(bound, "bound", positive=True)
        self.seed = check_int(seed, "seed")

    def __call__(self, keys: torch.Tensor, dim: int, dtype: torch.dtype) -> torch.Tensor:
        base = mix64(keys.reshape(-1, 1) ^ mix64(torch.tensor(self.seed, device=keys.device)))
        pairs = (dim + 1) // 2
        h = mix64(base + torch.arange(pairs, device=keys.device, dtype=torch.int64) * GOLDEN)
        high = (_shr(h, 32) + 1).to(torch.float64) * 2.0**-32  # in (0, 1]: the log below stays finite
        low = (h & 0xFFFFFFFF).to(torch.float64) * 2.0**-32  # in [0, 1)
        if self.kind == "uniform":
            out = torch.stack((high, low), -1).reshape(-1, 2 * pairs) * (2 * self.bound) - self.bound
        else:
            radius = torch.sqrt(-2.0 * torch.log(high)) * self.std
            angle = 2 * math.pi * low
            out = torch.stack((radius * torch.cos(angle), radius * torch.sin(angle)), -1).reshape(-1, 2 * pairs)
        return out[:, :dim].to(dtype)

    def __repr__(self) -> str:
        size = f"std={self.std}" if self.kind == "normal" else f"bound={self.bound}"
        return f"IdInitializer({self.kind!r}, {size}, seed={self.seed})"
