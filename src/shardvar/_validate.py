"""The one place where shardvar checks plain arguments: integers, numbers, flags, choices, shapes.

Rules: a value of the wrong type raises :class:`ShardvarTypeError` (a non-integer where an int
is expected raises :class:`ShardvarIntegerError`, which is also a ValueError); a value of the
right type outside its range raises :class:`ShardvarValueError`. Messages name the argument,
the bad value and what was expected.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from ._errors import (
    ShardvarDeviceError,
    ShardvarDTypeError,
    ShardvarIntegerError,
    ShardvarTypeError,
    ShardvarValueError,
)

__all__ = [
    "check_int",
    "check_int_sequence",
    "check_number",
    "check_bool",
    "check_choice",
    "BAG_MODES",
    "check_bag_mode",
    "check_float_dtype",
    "check_shape",
    "normalise_axis",
    "check_device",
    "check_devices",
    "check_has_values",
]


def _index(value: object) -> int | None:
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)  # int, numpy integers, 0-d integer tensors
    except TypeError:
        return None


def check_int(
    value: object,
    name: str,
    *,
    minimum: int | None = None,
    maximum: int | None = None,
    expected: str | None = None,
) -> int:
    """``value`` as an int in [minimum, maximum]; ``expected`` words the range in the message.

    >>> check_int(3, "num_shards", minimum=1)
    3
    """
    as_int = _index(value)
    if as_int is None:
        raise ShardvarIntegerError(f"{name} must be an int; got {value!r:.80}")
    if (minimum is not None and as_int < minimum) or (maximum is not None and as_int > maximum):
        if expected is None:
            low = f">= {minimum}" if minimum is not None else ""
            high = f"<= {maximum}" if maximum is not None else ""
            expected = " and ".join(x for x in (low, high) if x)
        raise ShardvarValueError(f"{name} must be {expected}; got {as_int}")
    return int(as_int)


def check_int_sequence(values: Iterable[object], name: str, minimum: int) -> tuple[int, ...]:
    """A tuple of ints >= ``minimum``, naming the first bad entry and its position."""
    out = []
    for i, v in enumerate(values):
        as_int = _index(v)
        if as_int is None:
            raise ShardvarIntegerError(f"{name} must be integers; got {v!r:.80} at position {i}")
        if as_int < minimum:
            raise ShardvarValueError(f"{name} must be >= {minimum}; got {as_int} at position {i}")
        out.append(int(as_int))
    return tuple(out)


def check_number(
    value: object, name: str, *, positive: bool = False, minimum: float | None = None, allow_none: bool = False
) -> float | None:
    """A finite real number (optionally > 0 or >= minimum); None passes when ``allow_none``."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or (not isinstance(value, (int, float)) and not hasattr(value, "__float__")):
        raise ShardvarTypeError(f"{name} must be a number; got {value!r:.80}")
    try:
        number = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError, RuntimeError):
        raise ShardvarTypeError(f"{name} must be a number; got {value!r:.80}") from None
    if not math.isfinite(number):
        raise ShardvarValueError(f"{name} must be finite; got {number}")
    if positive and number <= 0:
        raise ShardvarValueError(f"{name} must be > 0; got {number}")
    if minimum is not None and number < minimum:
        raise ShardvarValueError(f"{name} must be >= {minimum}; got {number}")
    return number


def check_bool(value: object, name: str) -> bool:
    """A real bool (not 0/1 or a string)."""
    if not isinstance(value, bool):
        raise ShardvarTypeError(f"{name} must be True or False; got {value!r:.80}")
    return value


def check_float_dtype(dtype: object, name: str = "dtype") -> torch.dtype | None:
    """None, or a floating (or complex) ``torch.dtype``: what a trainable table holds."""
    if dtype is not None and not (isinstance(dtype, torch.dtype) and (dtype.is_floating_point or dtype.is_complex)):
        raise ShardvarDTypeError(f"{name} must be a floating torch.dtype; got {dtype!r:.60} (e.g. torch.float32)")
    return dtype


def check_choice(value: Any, name: str, choices: Sequence[Any]) -> Any:
    """``value`` if it is one of ``choices``, else an error listing them."""
    try:
        ok = value in choices
    except TypeError:
        ok = False
    if not ok:
        raise ShardvarValueError(f"{name} must be one of {list(choices)}; got {value!r:.80}")
    return value


# How a bag pools its rows (nn.EmbeddingBag's modes), in the order of torch's kernel codes (sum 0, mean 1, max 2).
BAG_MODES = ("sum", "mean", "max")


def check_bag_mode(mode: Any, name: str = "mode") -> str:
    """``mode`` if it is a bag mode (:data:`BAG_MODES`), else an error listing them."""
    return check_choice(mode, name, BAG_MODES)


def check_shape(shape: object) -> tuple[int, ...]:
    """A fully defined shape (tuple, list or torch.Size of ints >= 0, rank >= 1) as a tuple."""
    if isinstance(shape, (str, bytes)) or not isinstance(shape, Sequence):
        raise ShardvarTypeError(f"shape must be a tuple, list or torch.Size of ints; got {shape!r:.80}")
    dims = []
    for i, d in enumerate(shape):
        if d is None or isinstance(d, bool):
            raise ShardvarValueError(f"shape must be fully defined; got {list(shape)!r} (dimension {i} is {d!r})")
        as_int = _index(d)
        if as_int is None:
            raise ShardvarIntegerError(f"shape dimensions must be ints; got {d!r} at dimension {i} of {shape!r}")
        if as_int < 0:
            raise ShardvarValueError(f"shape dimensions must be >= 0; got {as_int} at dimension {i} of {list(shape)}")
        dims.append(int(as_int))
    if not dims:
        raise ShardvarValueError("cannot partition a 0-d (scalar) variable; shape is []")
    return tuple(dims)


def normalise_axis(axis: object, ndim: int) -> int:
    """Python-style axis (negative counts from the end) checked against ``ndim``."""
    if _index(axis) is None:
        raise ShardvarIntegerError(f"axis must be an int; got {axis!r:.80}")
    axis = int(axis)  # type: ignore[call-overload]
    if not -ndim <= axis < ndim:
        raise ShardvarValueError(
            f"axis {axis} is out of range for a tensor of {ndim} dimension(s); expected [{-ndim}, {ndim})"
        )
    return axis % ndim


def _device_count(kind: str) -> int:
    """How many devices of type ``kind`` this machine has (cpu and meta: always there)."""
    if kind in ("cpu", "meta"):
        return 1 << 30
    backend = getattr(torch, kind, None)  # torch.cuda, torch.xpu, torch.mps, ...
    available = getattr(backend, "is_available", None)
    count = getattr(backend, "device_count", None)
    if not (callable(available) and callable(count)) or not available():
        return 0
    return int(count())


def check_device(device: object, name: str = "device") -> torch.device:
    """A torch.device that exists on this machine (``"cuda:3"`` without a 4th GPU is refused)."""
    if not isinstance(device, (str, torch.device)) and _index(device) is None:
        raise ShardvarTypeError(
            f"{name} must be a torch.device, a string such as 'cpu' or an index; got {device!r:.60}"
        )
    try:
        d = torch.device(device)  # type: ignore[arg-type]
    except (RuntimeError, TypeError, ValueError) as e:
        raise ShardvarDeviceError(
            f"{name} {device!r:.60} is not a device ({e}); expected e.g. 'cpu' or 'cuda:0'"
        ) from None
    count = _device_count(d.type)
    if (d.index or 0) >= count:
        raise ShardvarDeviceError(f"{name} {d} does not exist: this machine has {count} {d.type.upper()} device(s)")
    return d


def check_devices(devices: object, count: int | None = None, name: str = "devices") -> list[torch.device]:
    """A list of existing devices (``count`` of them when given: one per shard or partition)."""
    if isinstance(devices, (str, torch.device)) or not isinstance(devices, Sequence):
        raise ShardvarTypeError(f"{name} must be a list of devices; got {devices!r:.60}")
    checked = [check_device(d, f"{name}[{i}]") for i, d in enumerate(devices)]
    if count is not None and len(checked) != count:
        raise ShardvarValueError(
            f"got {len(checked)} {name} for {count} shards; give one per shard: {list(devices)!r:.80}"
        )
    return checked


def check_has_values(t: torch.Tensor, what: str) -> torch.Tensor:
    """``t``, unless it is on the meta device (a shape without values: nothing to read, check or write)."""
    if t.is_meta:
        raise ShardvarTypeError(
            f"{what} of shape {list(t.shape)} on the meta device hold(s) no values; expected a tensor on a real "
            "device (materialise it first, e.g. module.to_empty(device='cpu'))"
        )
    return t
