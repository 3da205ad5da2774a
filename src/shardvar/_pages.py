"""Huge pages for large CPU tensors: the kernel faults them in 2 MiB at a time, not 4 KiB.

On the CPU most of the time of a large lookup is the first touch of its fresh output, page by
page. Two ways past it:

* :func:`use_huge_pages`, for programs (the CLI, the examples): torch's own switch,
  ``THP_MEM_ALLOC_ENABLE=1``, which torch reads once, at its first CPU allocation of any size,
  and then applies to every allocation of 2 MiB or more. A user's explicit setting wins.
* :func:`empty` and :func:`zeros`, for shardvar's own large buffers, whatever the switch says: a
  plain torch allocation whose whole 2 MiB pages are advised ``MADV_HUGEPAGE`` before anything
  touches them. The tensor and its storage are torch's own (offset 0, freed by torch), so
  nothing about it differs but the page size; where the platform has no transparent huge pages
  (not Linux, or THP ``never``) or the tensor is small, it is exactly ``torch.empty``.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

__all__ = [
    "HUGE_PAGE",
    "advisable",
    "advise",
    "empty",
    "empty_like",
    "huge_pages_mode",
    "torch_advises",
    "use_huge_pages",
    "zeros",
    "zeros_like",
]

HUGE_PAGE = 2 << 20  # x86-64 and arm64 (4 KiB base pages) transparent huge page size
SWITCH = "THP_MEM_ALLOC_ENABLE"
_MODE_FILE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def use_huge_pages() -> bool:
    """Turn torch's huge-page switch on for this process unless the user set it; True when it is on.

    Only effective before torch's first CPU allocation (torch reads the switch once, then).
    """
    os.environ.setdefault(SWITCH, "1")
    value = os.environ[SWITCH].strip()
    return value.lstrip("+-").isdigit() and int(value) != 0  # torch reads it with atoi


def torch_advises() -> bool:
    """Whether torch applies its switch in this process (it page-aligns allocations of 2 MiB or more then).

    The first call is torch's first allocation if nothing allocated before: it fixes the setting.
    """
    probes = [torch.empty(HUGE_PAGE, dtype=torch.uint8) for _ in range(3)]  # never touched: no memory used
    return all(p.data_ptr() % mmap.PAGESIZE == 0 for p in probes)


@functools.cache
def huge_pages_mode() -> str:
    """The kernel's transparent huge page mode ("always", "madvise" or "never"); "never" off Linux."""
    if not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_HUGEPAGE"):
        return "never"
    try:
        text = _MODE_FILE.read_text()
    except OSError:
        return "never"
    chosen = [w[1:-1] for w in text.split() if w.startswith("[")]
    return chosen[0] if chosen else "never"


@functools.cache
def _madvise() -> Callable[..., int] | None:
    if huge_pages_mode() != "madvise":
        return None  # "always" needs no advice; "never" ignores it
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int), ctypes.c_int
    return fn


def advisable(nbytes: int, device: torch.device) -> bool:
    """Whether a fresh buffer of ``nbytes`` on ``device`` would be advised for huge pages here."""
    return device.type == "cpu" and nbytes >= HUGE_PAGE and _madvise() is not None


def advise(t: torch.Tensor) -> torch.Tensor:
    """Advise the whole 2 MiB pages inside ``t``'s memory for huge pages; ``t`` unchanged.

    Only pages wholly inside the tensor are advised, so memory next to it (another allocation on
    the heap) is never backed by a page it shares with ``t``. Must run before ``t`` is written.
    """
    nbytes = t.numel() * t.element_size()
    fn = _madvise() if t.device.type == "cpu" and nbytes >= HUGE_PAGE else None
    if fn is not None:
        start = -(-t.data_ptr() // HUGE_PAGE) * HUGE_PAGE
        end = (t.data_ptr() + nbytes) // HUGE_PAGE * HUGE_PAGE
        if end > start:
            fn(start, end - start, mmap.MADV_HUGEPAGE)  # refused (old kernel): normal pages, nothing to do
    return t


def empty(
    shape: Sequence[int] | int, *, dtype: torch.dtype | None = None, device: torch.device | str | None = None
) -> torch.Tensor:
    """``torch.empty(shape, dtype=dtype, device=device)``, backed by huge pages when large and on the CPU."""
    return advise(torch.empty(shape, dtype=dtype, device=device))


def zeros(
    shape: Sequence[int] | int, *, dtype: torch.dtype | None = None, device: torch.device | str | None = None
) -> torch.Tensor:
    """``torch.zeros(shape, dtype=dtype, device=device)``, backed by huge pages when large and on the CPU."""
    return empty(shape, dtype=dtype, device=device).zero_()


def empty_like(t: torch.Tensor) -> torch.Tensor:
    """``torch.empty_like(t)`` (same strides where torch keeps them), huge-page backed like :func:`empty`."""
    return advise(torch.empty_like(t))


def zeros_like(t: torch.Tensor) -> torch.Tensor:
    """``torch.zeros_like(t)``, huge-page backed like :func:`empty`."""
    return empty_like(t).zero_()
