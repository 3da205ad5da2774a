"""Optional native kernels: C sources compiled on first use, cached, loaded with ctypes.

Used where torch has no kernel for a hot path (a backing file's record transfers, a fused row-wise
update). Nothing is built at install time (pip's build isolation would pull another torch). A
source is compiled with the system's C compiler (``$CC``, else Python's ``sysconfig`` compiler,
else ``cc``/``gcc``/``clang``) into ``$XDG_CACHE_HOME/shardvar`` (default ``~/.cache/shardvar``),
named by a hash of its source and the platform, under a temporary name then renamed, so processes
compiling at once never load a half-written library. Without a compiler, when compiling fails, or
with ``SHARDVAR_NATIVE=0``, :func:`load` gives ``None`` and the caller takes its torch or Python
path (one debug log line says why); every kernel has such a tested fallback.
"""

from __future__ import annotations

import ctypes
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
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch
from torch._C._functorch import is_functorch_wrapped_tensor

__all__ = ["build", "cache_folder", "check_version", "compiler_command", "enabled", "load", "on_cpu_memory"]

_log = logging.getLogger(__name__)
T = TypeVar("T")


def enabled() -> bool:
    """False where ``SHARDVAR_NATIVE=0`` asks for the fallbacks."""
    return os.environ.get("SHARDVAR_NATIVE", "1").strip() != "0"


def check_version(version: Callable[[], int], abi: int) -> None:
    """Refuse a library whose ``version()`` is not the ``abi`` its module calls (a stale build: ``load`` falls back)."""
    if version() != abi:
        raise OSError(f"the native library is version {version()}, not {abi}")


def on_cpu_memory(*tensors: torch.Tensor) -> bool:
    """Whether a kernel can take each of ``tensors`` by its data pointer: plain CPU tensors with storage
    (not a subclass, not a torch.func transform's wrapper, not a meta or fake tensor)."""
    for t in tensors:
        if type(t) not in (torch.Tensor, torch.nn.Parameter) or t.device.type != "cpu":
            return False
        if is_functorch_wrapped_tensor(t):
            return False
    return True


def load(
    source: Path, stem: str, abi: int, wrap: Callable[[ctypes.CDLL], T], what: str, flags: tuple[str, ...] = ("-O2",)
) -> T | None:
    """``wrap(library)`` of ``source`` compiled (see the module), or None with a debug line saying why ``what``
    takes its fallback. ``wrap`` raises ``OSError``/``AttributeError`` for a library it cannot use."""
    if not enabled():
        _log.debug("shardvar: SHARDVAR_NATIVE=0: %s takes its fallback path", what)
        return None
    try:
        return wrap(ctypes.CDLL(str(build(source, stem, abi, flags))))
    except (OSError, RuntimeError, AttributeError, subprocess.SubprocessError) as e:
        _log.debug("shardvar: no native kernel (%s): %s takes its fallback path", e, what)
        return None


def build(source: Path, stem: str, abi: int, flags: tuple[str, ...] = ("-O2",)) -> Path:
    """The compiled library of ``source``, compiled now if this source has none in the cache folder yet."""
    text = source.read_bytes()
    key = hashlib.sha256(text + f"\0{sys.platform}\0{platform.machine()}\0{abi}\0{flags}".encode()).hexdigest()[:20]
    folder = cache_folder()
    target = folder / f"{stem}-{key}.so"
    if target.exists():
        return target
    compiler = compiler_command()
    if compiler is None:
        raise OSError("no C compiler found (set CC)")
    folder.mkdir(parents=True, exist_ok=True)
    partial = folder / f".{target.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp"
    try:
        words = [*flags, "-shared", "-fPIC", "-pthread", "-x", "c", "-o", str(partial), "-", "-lm"]
        run = subprocess.run([*compiler, *words], input=text, capture_output=True, timeout=300)
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
