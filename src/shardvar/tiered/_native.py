"""An optional native kernel for a backing file's record reads and writes (``_native_io.c``).

What it buys: a training step moves thousands of records, mostly one-record runs. In Python each
run costs a list entry, a ``memoryview`` and an ``os.preadv`` call, ~2.7 us a page-cached run; the
kernel walks the ids, coalesces runs, reads the page-cached ones at once (``preadv2(RWF_NOWAIT)``)
and the rest on its own threads, all without the interpreter's lock, so a run costs about its
system call, ~0.7 us (4096 page-cached reads of 264 B: 11.2 ms in Python, 2.8 ms here).

It is compiled on first use with the system's C compiler (``$CC``, else Python's ``sysconfig``
compiler, else ``cc``/``gcc``/``clang``) into ``$XDG_CACHE_HOME/shardvar`` (default
``~/.cache/shardvar``), named by a hash of its source and the platform, and compiled under a
temporary name then renamed, so processes compiling at once never load a half-written library.
Nothing is built at install time. Without a compiler, when compiling fails, or with
``SHARDVAR_NATIVE=0``, :func:`kernel` is ``None`` and ``RowFile`` takes its Python path (the same
bytes and the same errors; one debug log line says why).
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import logging
import os
import platform
import secrets
import shlex
import shutil
import subprocess
import sys
import sysconfig
import threading
from pathlib import Path

import numpy as np

__all__ = ["Kernel", "kernel", "short_transfer"]

SOURCE = Path(__file__).with_name("_native_io.c")
_ABI = 1  # sv_abi_version() of the source this module calls
_SHORT = -1  # sv_transfer's code for a read at the end of the file (or a write of nothing)
_log = logging.getLogger(__name__)
_lock = threading.Lock()
_loaded: dict[str, Kernel | None] = {}  # "kernel": this process's answer, once


def short_transfer(write: bool, at: int) -> OSError:
    """The error of a read that met the end of the file at byte ``at`` (or a write that wrote nothing)."""
    what = f"wrote nothing at byte {at}" if write else f"the file ends at byte {at}"
    return OSError(errno.EIO, f"short {'write' if write else 'read'}: {what}")


class Kernel:
    """``sv_transfer`` of a loaded library."""

    def __init__(self, library: ctypes.CDLL) -> None:
        if library.sv_abi_version() != _ABI:
            raise OSError(f"the native library is version {library.sv_abi_version()}, not {_ABI}")
        fn = library.sv_transfer
        c = ctypes
        fn.argtypes = (c.c_int, c.c_void_p, c.c_int64, c.c_int64, c.c_int64, c.c_void_p, c.c_int, c.c_int, c.c_int,
                       c.c_void_p)  # fmt: skip
        fn.restype = c.c_int
        self._fn = fn

    def transfer(
        self,
        fd: int,
        ids: np.ndarray,
        buffer: np.ndarray,
        record_bytes: int,
        header: int,
        write: bool,
        nowait: bool,
        queue_depth: int,
    ) -> int:
        """Move the records of ascending ``ids`` (contiguous int64) between ``buffer`` (contiguous, one record
        per id) and the file; returns how many runs had to wait for the disk. A failure is an ``OSError``."""
        info = (ctypes.c_int64 * 2)()
        code = self._fn(
            fd, ids.ctypes.data, ids.size, record_bytes, header, buffer.ctypes.data, write, nowait, queue_depth, info
        )
        if code == _SHORT:
            raise short_transfer(write, info[0])
        if code:
            raise OSError(code, os.strerror(code))
        return info[1]


def kernel() -> Kernel | None:
    """This process's native kernel (compiled and loaded on the first call), or ``None``: see the module."""
    with _lock:
        if "kernel" not in _loaded:
            _loaded["kernel"] = _load()
        return _loaded["kernel"]


def _load() -> Kernel | None:
    if os.environ.get("SHARDVAR_NATIVE", "1").strip() == "0":
        _log.debug("shardvar: SHARDVAR_NATIVE=0: a backing file's records move through the Python path")
        return None
    try:
        return Kernel(ctypes.CDLL(str(built())))
    except (OSError, RuntimeError, AttributeError, subprocess.SubprocessError) as e:
        _log.debug("shardvar: no native record I/O (%s): a backing file's records move through the Python path", e)
        return None


def built() -> Path:
    """The compiled library, compiled now if this source has none in the cache folder yet."""
    source = SOURCE.read_bytes()
    key = hashlib.sha256(source + f"\0{sys.platform}\0{platform.machine()}\0{_ABI}".encode()).hexdigest()[:20]
    folder = cache_folder()
    target = folder / f"native_io-{key}.so"
    if target.exists():
        return target
    compiler = compiler_command()
    if compiler is None:
        raise OSError("no C compiler found (set CC)")
    folder.mkdir(parents=True, exist_ok=True)
    partial = folder / f".{target.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp"
    try:
        flags = ["-O2", "-shared", "-fPIC", "-pthread", "-x", "c", "-o", str(partial), "-"]
        run = subprocess.run([*compiler, *flags], input=source, capture_output=True, timeout=300)
        if run.returncode:
            first = (run.stderr.decode(errors="replace").strip().splitlines() or ["no message"])[0]
            raise OSError(f"the C compiler {compiler[0]} failed ({run.returncode}): {first}")
        os.replace(partial, target)  # whole or not at all: another process may load it right now
    finally:
        partial.unlink(missing_ok=True)
    return target


def cache_folder() -> Path:
    """``$XDG_CACHE_HOME/shardvar``, else ``~/.cache/shardvar``."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "shardvar"


def compiler_command() -> list[str] | None:
    """The C compiler to call, as its words: ``$CC``, Python's own compiler, or ``cc``/``gcc``/``clang``."""
    for configured in (os.environ.get("CC"), sysconfig.get_config_var("CC")):
        words = shlex.split(configured or "")
        if words and shutil.which(words[0]):
            return words
    found = next((p for p in map(shutil.which, ("cc", "gcc", "clang")) if p), None)
    return [found] if found else None
