"""Saves that write in the background: a consistent snapshot now, the files later.

The snapshot is a staging copy of every tensor the save writes (bounded by ``staging_bytes``),
taken before ``save`` returns, so training may change the variables at once; a thread then
writes and commits the copy with the same guarantees as a synchronous save (a crash leaves the
previous checkpoint). One save per coordinator runs at a time: the next waits for the last.

The staging buffers are kept for the next asynchronous save of the same saver, as PyTorch's
distributed checkpoint caches its staging state: filling fresh memory costs page faults that
make the copy about 3x slower. :func:`release_staging` frees them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import torch

from .._errors import CheckpointError
from .._validate import check_number
from ._write import Entry

__all__ = ["AsyncSave", "release_staging", "stage", "start", "wait_for_previous"]

_IN_FLIGHT: dict[object, AsyncSave] = {}
_STAGING: dict[object, dict[tuple, torch.Tensor]] = {}  # saver -> its last save's staging buffers
_LOCK = threading.Lock()


class AsyncSave:
    """A save writing in the background. ``done()`` asks; ``wait()`` waits and raises its error."""

    def __init__(self, path: Path, run: Callable[[], None]) -> None:
        self.path = path
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(run,), name=f"shardvar-save {path}")

    def _run(self, run: Callable[[], None]) -> None:
        try:
            run()
        except BaseException as e:  # reported to whoever waits
            self._error = e

    def done(self) -> bool:
        """Whether the save has finished (committed, or failed: ``wait()`` then raises)."""
        return not self._thread.is_alive()

    def wait(self, timeout: float | None = None) -> None:
        """Wait until the save is committed; raise its error if it failed, or TimeoutError."""
        if timeout is not None:
            check_number(timeout, "timeout", minimum=0)
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"the save to {self.path} is still writing after {timeout} s")
        if self._error is not None:
            raise self._error

    def __repr__(self) -> str:
        state = "writing" if not self.done() else ("failed" if self._error else "committed")
        return f"AsyncSave({str(self.path)!r}, {state})"


def stage(entries: list[Entry], budget: int | None, key: object) -> list[Entry]:
    """Copies of everything ``entries`` write, taken now; the entries then read the copies.

    Called once the saver's previous background save has finished, so its buffers are free.
    """
    total = sum(e.nbytes for e in entries)
    if budget is not None and total > budget:
        raise CheckpointError(
            f"an asynchronous save needs {total} bytes of staging copies but staging_bytes={budget}; "
            "raise it, or save synchronously"
        )
    old, buffers = _STAGING.pop(key, {}), {}
    staged = []
    with torch.no_grad():
        for e in entries:
            copies = {}
            for s in e.shard_shapes:
                value = e.produce(s).detach()
                slot = (e.name, s, tuple(value.shape), value.dtype)
                buffer = old.pop(slot, None)
                if buffer is None:
                    buffer = torch.empty(value.shape, dtype=value.dtype, pin_memory=value.is_cuda)
                copies[s] = buffers[slot] = buffer.copy_(value)
            staged.append(
                Entry(e.name, e.dtype, e.shape, e.layout, e.shard_shapes, copies.__getitem__, e.replicated, role=e.role)
            )
    _STAGING[key] = buffers
    return staged


def release_staging() -> None:
    """Free the staging buffers kept for the next asynchronous saves (after waiting for them)."""
    with _LOCK:
        running = list(_IN_FLIGHT.values())
    for handle in running:
        handle._thread.join()
    _STAGING.clear()


def wait_for_previous(key: object) -> None:
    """Let the last background save of this coordinator finish (its error is its waiter's to see)."""
    with _LOCK:
        previous = _IN_FLIGHT.get(key)
    if previous is not None:
        previous._thread.join()


def start(key: object, path: Path, run: Callable[[], None]) -> AsyncSave:
    handle = AsyncSave(path, run)
    with _LOCK:
        _IN_FLIGHT[key] = handle
    handle._thread.start()
    return handle
