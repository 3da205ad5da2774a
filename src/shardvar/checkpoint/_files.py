"""The only ways shardvar opens, creates and locks files in a checkpoint directory.

Every open refuses symbolic links (``O_NOFOLLOW``) and anything but a regular file (a FIFO named
like a data file is refused at once, never waited on: ``O_NONBLOCK``), so a checkpoint never
reads or writes outside its directory. A lock on the directory (``flock``) serialises saves and
keeps a save from changing files while a load reads them; waiting for it is bounded.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
import time
from pathlib import Path
from typing import BinaryIO

from .._errors import CheckpointError, CheckpointIOError

__all__ = ["open_regular", "create_new", "reopen_spare", "fsync_dir", "DirectoryLock", "is_regular"]

_NOFOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC


def _refuse_link(path: Path, e: OSError) -> CheckpointError:
    if e.errno == errno.ELOOP:
        return CheckpointError(f"{path} is a symbolic link; a checkpoint's files must be regular files inside it")
    return CheckpointIOError(f"cannot open {path}: {e.strerror or e}")


def _checked(fd: int, path: Path) -> int:
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise CheckpointError(f"{path} is not a regular file (a FIFO, device or directory); refusing to use it")
    return fd


def open_regular(path: Path, what: str) -> BinaryIO:
    """Open an existing regular file for reading; a link, FIFO or device is refused.

    ``what`` names the file in the error when it is missing (``"<what> is missing"``).
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | _NOFOLLOW)
    except FileNotFoundError:
        raise CheckpointError(f"{what} is missing") from None
    except OSError as e:
        raise _refuse_link(path, e) from None
    fd = _checked(fd, path)
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")


def create_new(path: Path) -> BinaryIO:
    """Create a file that must not exist yet (never through a link), for writing."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o644)
    except OSError as e:
        raise _refuse_link(path, e) from None
    return os.fdopen(fd, "r+b")


def reopen_spare(path: Path) -> BinaryIO | None:
    """Open a spare file for overwriting in place; None unless it is a regular file."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_NONBLOCK | _NOFOLLOW)
    except OSError:
        return None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        return None
    os.set_blocking(fd, True)
    return os.fdopen(fd, "r+b")


def is_regular(path: Path) -> bool:
    """Whether ``path`` is a regular file itself (not through a link)."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class DirectoryLock:
    """``flock`` on the checkpoint directory itself: exclusive for a save, shared for a load.

    No lock file is left behind (a directory's descriptor takes the lock). Waits at most
    ``timeout`` seconds, then raises CheckpointIOError naming the directory. A directory that
    does not exist yet takes no lock (a save creates it first; a load then finds no checkpoint).
    """

    def __init__(self, directory: Path, exclusive: bool, timeout: float = 60.0) -> None:
        self.directory, self.exclusive, self.timeout = directory, exclusive, timeout
        self._fd: int | None = None

    def _open(self) -> int | None:
        try:
            return os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as e:
            raise CheckpointIOError(f"cannot open {self.directory}: {e.strerror or e}") from None

    def __enter__(self) -> DirectoryLock:
        fd = self._open()
        if fd is None:
            return self
        deadline = time.monotonic() + self.timeout
        mode = (fcntl.LOCK_EX if self.exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB
        while True:
            try:
                fcntl.flock(fd, mode)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    os.close(fd)
                    action = "save to" if self.exclusive else "load from"
                    raise CheckpointIOError(
                        f"cannot {action} {self.directory}: another process has been saving or loading it for "
                        f"{self.timeout:g} s; try again when it is done"
                    ) from None
                time.sleep(0.02)
        self._fd = fd
        return self

    def __exit__(self, *exc: object) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None
