"""The roofline's denominators: memory bandwidth (copy and triad, huge pages off and on) and the disk's rate.

torch reads its huge-page switch (``THP_MEM_ALLOC_ENABLE``) once per process, so each setting is
measured in a child process of its own (``python -m shardvar.workloads._roofline_probes``),
the two settings interleaved round by round. A copy of ``N`` bytes moves ``2 N`` (each byte read
and written), a triad ``a = b + s * c`` moves ``3 N``; the arrays are touched before they are
timed, so the figures are the steady bandwidth, not the first touch's page faults.

The disk: a file of the checkpoint's size written and ``fsync``-ed, then read back after
``posix_fadvise(DONTNEED)`` asks the kernel to drop its cached pages (dropping every cache needs
root, so it is not required). Where the advice is ignored (or unsupported), the read comes from the
page cache and the read rate is memory's: the figures say what they measured, not the device.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

__all__ = ["SETTINGS", "bandwidth", "disk_rate", "drop_cache", "memory_bandwidth"]

SETTINGS = {"off": "0", "on": "1"}  # torch's THP_MEM_ALLOC_ENABLE in each child
_SWITCH = "THP_MEM_ALLOC_ENABLE"
_MODULE = "shardvar.workloads._roofline_probes"  # this file, run as a child


def memory_bandwidth(nbytes: int, reps: int, threads: int) -> dict:
    """In this process: GB/s of ``reps`` copies and triads of ``nbytes`` float32 arrays, and the setting torch uses."""
    import torch
    from torch.utils.benchmark import Timer

    from .._pages import torch_advises

    advised = torch_advises()  # before any other allocation: torch reads its switch at the first
    torch.set_num_threads(threads)
    n = max(1, nbytes // 4)
    a, b, c = (torch.ones(n) for _ in range(3))  # ones: every page touched before it is timed
    copy = Timer("a.copy_(b)", globals={"a": a, "b": b}, num_threads=threads)
    triad = Timer("torch.add(b, c, alpha=3.0, out=a)", globals={"a": a, "b": b, "c": c, "torch": torch},
                  num_threads=threads)  # fmt: skip
    out: dict = {"copy": [], "triad": [], "huge_pages": advised, "threads": threads}
    for _ in range(reps):
        out["copy"].append(2 * n * 4 / copy.timeit(3).median / 1e9)
        out["triad"].append(3 * n * 4 / triad.timeit(3).median / 1e9)
    return out


def bandwidth(nbytes: int, rounds: int, reps: int, threads: int) -> dict[str, dict]:
    """Per setting ("off", "on"): every round's copy and triad GB/s, each round a child process per setting."""
    src = str(Path(__file__).resolve().parents[2])  # the children import this shardvar, wherever it is
    path = os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH", "")) if p)
    out: dict[str, dict] = {s: {"copy": [], "triad": []} for s in SETTINGS}
    for _ in range(rounds):
        for setting, value in SETTINGS.items():
            env = {**os.environ, _SWITCH: value, "PYTHONPATH": path}
            cmd = [sys.executable, "-m", _MODULE, str(nbytes), str(reps), str(threads)]
            done = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if done.returncode != 0:
                raise RuntimeError(f"the bandwidth probe (huge pages {setting}) failed:\n{done.stderr}")
            got = json.loads(done.stdout.strip().splitlines()[-1])
            out[setting]["copy"] += got["copy"]
            out[setting]["triad"] += got["triad"]
            out[setting]["huge_pages"] = got["huge_pages"]
    return out


def drop_cache(path: Path) -> None:
    """Ask the kernel to drop the cached pages of ``path`` (a file, or every file under a directory)."""
    if not hasattr(os, "posix_fadvise"):
        return  # not Linux: reads may come from the page cache (the module's docstring says so)
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fdatasync(fd) if hasattr(os, "fdatasync") else os.fsync(fd)  # only clean pages are dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def disk_rate(directory: Path, nbytes: int, rounds: int) -> dict[str, list[float]]:
    """GB/s of ``rounds`` sequential writes (with ``fsync``) and reads (after :func:`drop_cache`) of ``nbytes``."""
    chunk = min(nbytes, 64 << 20)
    data = memoryview(os.urandom(chunk))  # random: no filesystem compresses it away
    buf = bytearray(chunk)
    path = directory / "roofline-disk-probe.bin"
    out: dict[str, list[float]] = {"write": [], "read": []}
    try:
        for _ in range(rounds):
            start = time.perf_counter()
            with open(path, "wb") as f:
                for offset in range(0, nbytes, chunk):
                    f.write(data[: min(chunk, nbytes - offset)])
                f.flush()
                os.fsync(f.fileno())
            out["write"].append(nbytes / (time.perf_counter() - start) / 1e9)
            drop_cache(path)
            start = time.perf_counter()
            with open(path, "rb", buffering=0) as f:
                while f.readinto(buf):
                    pass
            out["read"].append(nbytes / (time.perf_counter() - start) / 1e9)
    finally:
        path.unlink(missing_ok=True)
    return out


if __name__ == "__main__":  # one child: nbytes reps threads; prints one line of JSON
    nbytes, reps, threads = (int(x) for x in sys.argv[1:4])
    print(json.dumps(memory_bandwidth(nbytes, reps, threads)))
