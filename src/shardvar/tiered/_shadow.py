"""All-or-nothing loads into tiered tables: the rows go into a new file, renamed over the old one.

A load (``shardvar.load``) runs inside :func:`loading`. A tier asked for its rows there
(``TieredRows.sharded``) hands out views of a *shadow* instead of its backing file: a new file
beside it (``<name>.loading``, so the rename stays on one filesystem), its whole size reserved
first (a disk too small refuses the load before anything is written), mapped. Once every check
passed (``prepare``), each shadow gets a copy of the current records (``copy_file_range``:
kernel-side, no buffer in RAM, the file may be larger than it), so the rows and state columns
the checkpoint does not hold stay as they were; the load then writes its windows into it.

``commit``: every shadow is made durable (msync, fsync), then renamed over its backing file (and
the folder fsynced); each tier switches to its new file and forgets its cache. A failure before
that (a window that cannot be read, a full disk, a refused checkpoint) discards the shadows: the
backing files, the caches and what lookups return are exactly as they were. The renames of
several tables are not one atomic step; everything that may fail (the copy, the writes, the
syncs) is done for all of them before the first rename.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import Any

import torch

from .._errors import ShardvarValueError
from ._file import HEADER, BackingFileError, RowFile, _lock, _reserve
from ._views import mapped

__all__ = ["Shadow", "LoadTransaction", "loading", "active_load", "SUFFIX"]

SUFFIX = ".loading"
COPY_BYTES = 64 << 20  # bytes per copy call (and the buffer of the pread/pwrite fallback)
COPY_ROWS = 1 << 14  # records per piece of a copy into row order

_ACTIVE: ContextVar[LoadTransaction | None] = ContextVar("shardvar_tiered_load", default=None)


class Shadow:
    """A new, reserved and mapped file beside ``file``, of its layout, that a load fills."""

    def __init__(self, file: RowFile) -> None:
        self.source = file
        self.path = file.path.with_name(file.path.name + SUFFIX)
        self.path.unlink(missing_ok=True)  # left by a process that died while loading
        size = file.layout.file_bytes  # (spare records and their owners read as zeros: all free)
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        except OSError as e:
            raise BackingFileError(f"cannot create {str(self.path)!r} to load into: {e.strerror}") from None
        try:
            _lock(fd, self.path)
            try:
                _reserve(fd, self.path, size)
            except BackingFileError as e:
                raise BackingFileError(
                    f"a load into the tiered table of {str(file.path)!r} writes its rows into a new file beside it, "
                    f"renamed over it once complete, so it needs room for a second copy: {e}"
                ) from None
            self.file = RowFile(self.path, fd, file.layout, file.queue_depth)
            self.map, self.values, self.state = mapped(self.file)
        except BaseException:
            os.close(fd)
            self.path.unlink(missing_ok=True)
            raise

    def fill(self, places_of: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        """The source's bytes (header and every record) copied in, without a buffer in RAM; ``places_of(ids)``:
        where the source holds each row when its records are out of row order (``RowCache.places_of``): the
        records are then copied into row order, ``COPY_ROWS`` at a time."""
        layout = self.source.layout
        try:
            if places_of is None:
                _copy(self.source.fd, self.file.fd, HEADER + layout.rows * layout.record_bytes)
                return
            _copy(self.source.fd, self.file.fd, HEADER)
            counted = self.source.bytes_read  # a copy, as copy_file_range makes, not reads of the table's rows
            try:
                for first in range(0, layout.rows, COPY_ROWS):
                    ids = torch.arange(first, min(first + COPY_ROWS, layout.rows))
                    self.file.write_from(ids, self.source.read(places_of(ids)))
            finally:
                self.source.bytes_read = counted
        except OSError as e:
            raise BackingFileError(
                f"cannot copy backing file {str(self.source.path)!r} to load into it: {e.strerror or e}"
            ) from None

    def sync(self) -> None:
        """Every byte the load wrote through the map, on disk."""
        try:
            if hasattr(self.map, "flush"):
                self.map.flush()  # msync: the windows were written through the map
            self.file.settle()  # on disk, and out of the page cache's large blocks (RowFile.settle)
        except OSError as e:
            raise BackingFileError(f"cannot write {str(self.path)!r}: {e.strerror or e}") from None

    def discard(self) -> None:
        """Remove the shadow (the load's views of it stay readable until they are dropped)."""
        self.map = self.values = self.state = None  # type: ignore[assignment]
        self.file.discard()
        self.path.unlink(missing_ok=True)


def _copy(src: int, dst: int, size: int) -> None:
    done = 0
    try:
        while done < size:
            n = os.copy_file_range(src, dst, min(COPY_BYTES, size - done), done, done)
            if n == 0:
                raise OSError(errno.EIO, f"short copy: {done} of {size} bytes")
            done += n
        return
    except OSError as e:
        if e.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
            raise
    while done < size:  # a filesystem without copy_file_range: one bounded buffer
        chunk = os.pread(src, min(COPY_BYTES, size - done), done)
        if not chunk or os.pwrite(dst, chunk, done) != len(chunk):
            raise OSError(errno.EIO, f"short copy: {done} of {size} bytes")
        done += len(chunk)


class LoadTransaction:
    """The shadows of one load, by tier (see the module docstring)."""

    def __init__(self) -> None:
        self.shadows: dict[int, tuple[Any, Shadow]] = {}
        self.prepared = False

    def shadow_of(self, tier: Any) -> Shadow:
        """``tier``'s shadow, made on first asking (refused while a backward of its lookups is pending)."""
        held = self.shadows.get(id(tier))
        if held is not None:
            return held[1]
        if tier.pending_backward():
            raise ShardvarValueError("cannot load a tiered table while a backward of its lookups is pending")
        shadow = Shadow(tier.file)
        self.shadows[id(tier)] = (tier, shadow)
        return shadow

    def holds(self, tier: Any) -> bool:
        return id(tier) in self.shadows

    def prepare(self) -> None:
        """Every check passed: each shadow gets the rows as they are now (changed rows written back first)."""
        for tier, shadow in self.shadows.values():
            tier.flush()
            cache = tier.cache
            shadow.fill(cache.places_of if cache.moved else None)
        self.prepared = True

    def commit(self) -> None:
        """Every window written: the shadows, durable, take their backing files' places."""
        if not self.prepared:
            raise ShardvarValueError("a load into a tiered table commits only after prepare()")
        for _, shadow in self.shadows.values():
            shadow.sync()
        folders = set()
        for tier, shadow in list(self.shadows.values()):
            target = shadow.source.path
            os.replace(shadow.path, target)
            shadow.file.path = target
            folders.add(target.parent)
            del self.shadows[id(tier)]
            tier.adopt(shadow.file, (shadow.file, shadow.map, shadow.values, shadow.state))
        for folder in folders:
            _fsync_folder(folder)

    def discard(self) -> None:
        for _, shadow in self.shadows.values():
            shadow.discard()
        self.shadows.clear()


def _fsync_folder(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)  # the rename itself is durable
    finally:
        os.close(fd)


def active_load() -> LoadTransaction | None:
    """The load running now in this context, if any."""
    return _ACTIVE.get()


@contextmanager
def loading() -> Iterator[LoadTransaction]:
    """Run a load: tiers asked for their rows inside write into shadows, kept only on ``commit``."""
    transaction = LoadTransaction()
    token = _ACTIVE.set(transaction)
    try:
        yield transaction
    finally:
        _ACTIVE.reset(token)
        transaction.discard()  # what was committed left it; anything else is dropped
