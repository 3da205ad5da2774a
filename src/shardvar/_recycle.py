"""Buffers used again once nothing holds them: a step that allocates the same large buffers each
time faults nothing in after the first.

torch's CPU allocator hands freed memory straight back to the C allocator, which unmaps large
blocks (and trims its heap), so a buffer allocated anew every step is faulted in afresh every
step, page by page: on the CPU the larger part of a big lookup's time. torch's CUDA allocator
caches; for the CPU a :class:`Recycler` keeps the last buffer of each kind and hands out a view of
it again once no tensor made from it is alive (its memory's reference count says so, which
counts every view and every ``.grad`` made of it); else a new, huge-page backed one. It costs
one buffer of each kind between steps, which each step holds anyway.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable, Sequence
from typing import Any

import torch

from ._pages import HUGE_PAGE, empty

__all__ = ["Recycler"]


def _unshared(t: torch.Tensor) -> bool:
    # Its memory's references: ``t`` itself and the storage object this asks for, nothing else.
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata) == 2


class Recycler:
    """Large CPU buffers by kind (any hashable ``key``), each used again when nothing holds it.

    Thread-safe; a copy or a pickle of whatever holds one starts with none kept.
    """

    def __init__(self) -> None:
        self._kept: dict[Hashable, torch.Tensor] = {}
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        return {}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__()

    def take(
        self, key: Hashable, shape: Sequence[int], dtype: torch.dtype, device: torch.device, *, zero: bool = False
    ) -> torch.Tensor:
        """A contiguous tensor of ``shape`` (zeroed if ``zero``): the memory kept for ``key`` when it is
        large enough and free, else new memory, kept for next time if large."""
        shape, device = torch.Size(shape), torch.device(device)
        n = shape.numel()
        with self._lock:  # until the view exists: it marks the memory taken for every other caller
            kept = self._kept.get(key)
            fits = kept is not None and kept.numel() >= n and kept.dtype == dtype and kept.device == device
            if not (fits and _unshared(kept)):
                kept = empty(n, dtype=dtype, device=device)
                if device.type != "cpu" or n * kept.element_size() < HUGE_PAGE:
                    return kept.view(shape).zero_() if zero else kept.view(shape)
                self._kept[key] = kept
            # A tensor of its own over the kept memory goes out, never the kept tensor itself: the
            # memory's count then tells if it lives. Not a view either: autograd lets a Function's
            # output be modified in place only if it is not one.
            out = torch.empty(0, dtype=dtype, device=device).set_(kept.untyped_storage(), 0, shape)
            return out.zero_() if zero else out
