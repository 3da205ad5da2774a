"""What a backing file is, read from its header without opening it for training (``shardvar inspect``).

``describe(path)`` reads the 4 KiB header only, through a read-only descriptor: nothing is written,
and the ``flock`` a table holds is only tested (shared, not waited for), so a file in use by a
running process is reported as such and left alone.
"""

from __future__ import annotations

import fcntl
import os
from dataclasses import dataclass
from pathlib import Path

from ._file import open_fd
from ._header import MAGIC, RecordLayout, read_header

__all__ = ["BackingFileInfo", "describe", "is_backing_file"]

# Files a table makes beside its backing file while it rewrites it, and what is left of one if it stopped.
_PARTIAL = {
    ".loading": "the new rows of a load that did not finish (the table kept its file)",
    ".widening": "the wider records of an optimizer's state being added that did not finish",
}


@dataclass(frozen=True)
class BackingFileInfo:
    path: Path
    layout: RecordLayout
    clean: bool  # closed by close(): no write of a training process is missing
    in_use: bool  # a process holds it open now
    size: int  # bytes on disk; ``expected`` if whole
    partial: str | None  # a file left by a rewrite that did not finish (what it was), else None

    @property
    def expected(self) -> int:
        return self.layout.file_bytes

    @property
    def status(self) -> str:
        if self.partial is not None:
            return f"incomplete: {self.partial}; safe to remove once no table uses the file beside it"
        if self.size != self.expected:
            return f"truncated: {self.size} bytes on disk, {self.expected} by its header"
        if self.in_use:
            return "in use: a running table holds it open"
        if self.clean:
            return "closed cleanly: the table's last rows (restore a table from a checkpoint, not from this file)"
        return "not closed cleanly: its process died while training; restart from the last checkpoint"


def is_backing_file(path: str | os.PathLike) -> bool:
    """``path`` is a regular file that starts with a backing file's magic."""
    try:
        with open(path, "rb") as f:
            return Path(path).is_file() and f.read(len(MAGIC)) == MAGIC
    except OSError:
        return False


def describe(path: str | os.PathLike) -> BackingFileInfo:
    """The layout and state of the backing file at ``path`` (see the module docstring); changes nothing."""
    path = Path(path)
    fd = open_fd(path, os.O_RDONLY)
    try:
        layout, clean, _ = read_header(fd, path)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # a table holds LOCK_EX while it is open
            in_use = False
        except BlockingIOError:
            in_use = True
        size = os.fstat(fd).st_size
    finally:
        os.close(fd)  # releases the shared lock, if it was taken
    partial = next((what for suffix, what in _PARTIAL.items() if path.name.endswith(suffix)), None)
    return BackingFileInfo(path, layout, clean, in_use, size, partial)
