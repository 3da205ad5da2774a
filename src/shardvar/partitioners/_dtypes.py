"""Bytes per element of a dtype given as a torch.dtype or a name, including the reference's "string"."""

from __future__ import annotations

import torch

from .._errors import ShardvarTypeError, ShardvarValueError

__all__ = ["STRING", "element_size", "resolve_dtype"]

STRING = "string"  # torch has no string dtype; the reference sizes strings by a bytes-per-string argument

_ALIASES = {"bool": torch.bool, "float": torch.float32, "double": torch.float64, "half": torch.float16}


def resolve_dtype(dtype: object) -> torch.dtype | str:
    """A torch.dtype for ``dtype`` (a torch.dtype or its name), or ``"string"``."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str):
        name = dtype.removeprefix("torch.")
        if name in (STRING, "str", "tf.string"):
            return STRING
        resolved = _ALIASES.get(name, getattr(torch, name, None))
        if isinstance(resolved, torch.dtype):
            return resolved
        raise ShardvarValueError(
            f"unknown dtype name {dtype!r}; expected a torch dtype name such as 'float32' or 'string'"
        )
    raise ShardvarTypeError(f"dtype must be a torch.dtype or a dtype name; got {dtype!r}")


def element_size(dtype: object, bytes_per_string: int) -> int:
    """Bytes one element of ``dtype`` takes; strings count ``bytes_per_string`` each."""
    resolved = resolve_dtype(dtype)
    if resolved == STRING:
        return bytes_per_string
    return resolved.itemsize
