"""The native record kernel (``tiered/_native.py``) against RowFile's Python path.

Both move the same bytes (writes, reads in any order, page-cached or dropped from the page cache,
with or without threads), fail with the same errors (made real: a truncated file, a descriptor
that cannot read or write, a full device), and the Python path is taken, unchanged, whenever the
kernel cannot be had (no compiler, a failing one, ``SHARDVAR_NATIVE=0``).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import shardvar._native as native
import shardvar.tiered._file as file_module
from shardvar import ShardvarValueError
from shardvar.tiered import BackingFileError, RecordLayout, RowFile, _native

ROWS = 64
LAYOUT = RecordLayout(ROWS, 2, "float32", 2)  # 16-byte records
assert LAYOUT.record_bytes == 16
PATHS = ["native", "python"]


@pytest.fixture(scope="module")
def kernel():
    found = _native.kernel()
    if found is None:
        if native.compiler_command() is None or os.environ.get("SHARDVAR_NATIVE", "").strip() == "0":
            pytest.skip("no native kernel here (no C compiler, or SHARDVAR_NATIVE=0)")
        _native.built()  # a compiler is here, so the kernel must be: this raises why it is not
        raise AssertionError("the kernel builds, yet did not load")
    return found


def _initial() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return LAYOUT.join(torch.randn((ROWS, LAYOUT.dim), generator=g), torch.full((ROWS, 2), 0.5))


def _create(folder: Path, path: str, queue_depth: int = 32) -> RowFile:
    f = RowFile.create(folder / f"{path}.rows", LAYOUT, lambda ids: LAYOUT.split(_initial()[ids]), chunk_rows=9,
                       queue_depth=queue_depth)  # fmt: skip
    if path == "python":
        f._native = None
    return f


def _drop(f: RowFile) -> None:
    """Out of the page cache: the next reads wait for the disk."""
    os.fsync(f.fd)
    os.posix_fadvise(f.fd, 0, 0, os.POSIX_FADV_DONTNEED)


_run = st.tuples(st.integers(0, ROWS - 1), st.integers(1, 20)).map(lambda t: list(range(t[0], min(ROWS, sum(t)))))
ID_SETS = st.one_of(
    st.just([]),
    st.just(list(range(ROWS))),
    st.integers(0, ROWS - 1).map(lambda i: [i]),
    _run,
    st.lists(_run, max_size=4).map(lambda runs: sorted({i for r in runs for i in r})),
    st.sets(st.integers(0, ROWS - 1), max_size=40).map(sorted),
)


@settings(max_examples=60, deadline=None)
@given(
    writes=st.lists(st.tuples(ID_SETS, st.randoms(use_true_random=False)), max_size=4),
    reads=st.lists(st.integers(0, ROWS - 1), max_size=80),
    depth=st.sampled_from([1, 3, 32]),
    inline=st.booleans(),
    drop=st.booleans(),
)
def test_the_native_and_python_paths_move_the_same_bytes(kernel, writes, reads, depth, inline, drop):
    with tempfile.TemporaryDirectory() as folder:
        files = [_create(Path(folder), path, depth) for path in PATHS]
        assert files[0]._native is kernel and files[1]._native is None
        model = _initial()
        for k, (ids, rng) in enumerate(writes):
            shuffled = rng.sample(ids, len(ids))
            records = torch.randint(0, 256, (len(ids), LAYOUT.record_bytes), dtype=torch.uint8)
            model[shuffled] = records
            for f in files:
                f.inline = inline
                if k % 2:  # in any order, or through the cache's in-place call (ascending)
                    f.write(torch.tensor(shuffled, dtype=torch.int64), records)
                else:
                    order = torch.tensor(shuffled, dtype=torch.int64).argsort()
                    f.write_from(torch.tensor(ids, dtype=torch.int64), records[order].contiguous())
        wanted = torch.tensor(reads, dtype=torch.int64)
        distinct = torch.unique(wanted)
        for f in files:
            if drop:
                _drop(f)
            assert torch.equal(f.read(wanted), model[wanted])
            out = torch.full((distinct.numel(), LAYOUT.record_bytes), 7, dtype=torch.uint8)
            f.read_into(distinct, out)
            assert torch.equal(out, model[distinct])
            assert torch.equal(f.read(torch.arange(ROWS)), model)
            assert f.bytes_read == (wanted.numel() + distinct.numel() + ROWS) * LAYOUT.record_bytes
        assert files[0].bytes_written == files[1].bytes_written
        for f in files:
            f.close()
        assert (Path(folder) / "native.rows").read_bytes() == (Path(folder) / "python.rows").read_bytes()


def test_reads_the_page_cache_lacks_wait_on_threads_and_the_others_do_not(tmp_path, kernel):
    """After a drop every run goes to the blocking path (on threads); once read again, none does."""
    f = _create(tmp_path, "native")
    probe = memoryview(bytearray(16))
    try:
        os.preadv(f.fd, [probe], 0, os.RWF_NOWAIT)
    except BlockingIOError:
        pass  # supported: the page is not in the page cache (the file is dropped once created)
    except OSError:
        pytest.skip("no RWF_NOWAIT reads on this file system")
    ids = np.array([1, 2, 3, 9, 40, 41, 63], dtype=np.int64)  # 4 runs
    for queue_depth, waited in ((32, 4), (1, 4), (32, 0)):
        if waited:
            _drop(f)
        out = np.zeros((ids.size, LAYOUT.record_bytes), dtype=np.uint8)
        got = kernel.transfer(f.fd, ids, out, LAYOUT.record_bytes, file_module.HEADER, False, True, queue_depth)
        assert got == waited and torch.equal(torch.from_numpy(out), _initial()[torch.from_numpy(ids)])
    f.close()


def _swap_fd(f: RowFile, path: str, flags: int):
    if not os.path.exists(path):
        pytest.skip(f"no {path} here")
    own, f.fd = f.fd, os.open(path, flags)
    return own


FAILURES = {  # how: (what fails, the error's message)
    "read past a truncated end": ("read", r"cannot read from backing file .*: short read: the file ends at byte 4256$"),
    "read a write-only descriptor": ("read", r"cannot read from backing file .*: Bad file descriptor$"),
    "write a read-only descriptor": ("write", r"cannot write to backing file .*: Bad file descriptor$"),
    "write a full device": ("write", r"cannot write to backing file .*: No space left on device$"),
}


@pytest.mark.parametrize("inline", [False, True])
@pytest.mark.parametrize("how", list(FAILURES))
def test_both_paths_fail_with_the_same_error(tmp_path, kernel, how, inline):
    """Real failures, not patched calls: the same exception and message from either path, the lowest
    failing record named whatever the threads' timing, and the counters unchanged."""
    f = _create(tmp_path, "native")
    f.inline = inline
    own = f.fd
    if how == "read past a truncated end":
        os.ftruncate(f.fd, file_module.HEADER + 10 * LAYOUT.record_bytes)  # record 10 is the first gone
    elif how == "read a write-only descriptor":
        own = _swap_fd(f, str(f.path), os.O_WRONLY)
    elif how == "write a read-only descriptor":
        own = _swap_fd(f, str(f.path), os.O_RDONLY)
    else:
        own = _swap_fd(f, "/dev/full", os.O_RDWR)
    what, match = FAILURES[how]
    ids = torch.tensor([0, 1, 2, 5, 9, 10, 11, 20, 30, 31, 33, 40, 50, 63])  # runs before, across and past the end
    counted = (f.bytes_read, f.bytes_written)
    messages = []
    for kernel_or_none in (kernel, None):
        f._native = kernel_or_none
        with pytest.raises(BackingFileError, match=match) as caught:
            if what == "read":
                f.read(ids)
            else:
                f.write(ids, _initial()[ids])
        messages.append(str(caught.value))
    assert messages[0] == messages[1]
    assert (f.bytes_read, f.bytes_written) == counted
    if own != f.fd:
        os.close(f.fd)
        f.fd = own
    f.close()


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(
    "call, make, match",
    [
        (
            "read_into",
            lambda n, b: torch.zeros(n + 1, b, dtype=torch.uint8),
            r"out must be a CPU uint8 tensor \[3, 16\]; got torch.uint8 \[4, 16\]",
        ),
        ("read_into", lambda n, b: torch.zeros(n, b, dtype=torch.int16), r"out must be .* got torch.int16"),
        (
            "read_into",
            lambda n, b: torch.zeros(b, n, dtype=torch.uint8).t(),
            r"out must be contiguous; got strides \(1, 3\)",
        ),
        (
            "write_from",
            lambda n, b: torch.zeros(n, b - 1, dtype=torch.uint8),
            r"records must be a CPU uint8 tensor \[3, 16\]; got torch.uint8 \[3, 15\]",
        ),
        ("write_from", lambda n, b: torch.zeros(n, 2 * b, dtype=torch.uint8)[:, ::2], r"records must be contiguous"),
    ],
)
def test_an_in_place_buffer_of_the_wrong_size_or_layout_is_refused_before_any_io(tmp_path, path, call, make, match):
    """The kernel reads and writes the buffer's memory in place: a buffer it could overrun is refused."""
    f = _create(tmp_path, path)
    before = f.path.read_bytes()
    buffer = make(3, LAYOUT.record_bytes)
    seen = buffer.clone()
    with pytest.raises(ShardvarValueError, match=match):
        getattr(f, call)(torch.tensor([4, 5, 9]), buffer)
    assert torch.equal(buffer, seen) and f.path.read_bytes() == before
    assert f.bytes_read == 0 and f.bytes_written == LAYOUT.rows * LAYOUT.record_bytes
    f.close()


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """An empty library cache and no answer yet in this process."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(_native, "_loaded", {})
    monkeypatch.delenv("SHARDVAR_NATIVE", raising=False)
    return tmp_path / "cache" / "shardvar"


@pytest.mark.parametrize("why", ["no compiler", "the compiler fails", "SHARDVAR_NATIVE=0"])
def test_without_the_kernel_the_python_path_is_taken(fresh, monkeypatch, caplog, why, kernel):
    _native.built()  # a library in the cache: SHARDVAR_NATIVE=0 must still leave it unused
    if why == "SHARDVAR_NATIVE=0":
        monkeypatch.setenv("SHARDVAR_NATIVE", "0")
    else:  # nothing in the cache, and no compiler to make it
        for p in fresh.glob("native_io-*.so"):
            p.unlink()
        if why == "no compiler":
            monkeypatch.setattr(native, "compiler_command", lambda: None)
        else:
            monkeypatch.setenv("CC", "false")
    with caplog.at_level(logging.DEBUG, logger=native.__name__):
        f = _create(fresh.parent.parent, "native")
    assert f._native is None
    assert [r.levelno for r in caplog.records] == [logging.DEBUG]  # one line, and nothing louder
    assert ("compiler" in caplog.text) == (why != "SHARDVAR_NATIVE=0")
    ids = torch.tensor([7, 3, 4, 60])
    assert torch.equal(f.read(ids), _initial()[ids])
    f.close()


def test_processes_compiling_at_once_all_load_a_whole_library(fresh, kernel):
    """Each compiles under a name of its own and renames it into place: none loads a half-written file."""
    flags = fresh.parent.parent
    code = textwrap.dedent(f"""
        import os, sys, time
        from shardvar.tiered import _native
        open(os.path.join({str(flags)!r}, "ready-" + sys.argv[1]), "w").close()
        while not os.path.exists(os.path.join({str(flags)!r}, "go")):  # all start compiling together
            time.sleep(0.001)
        print(_native.kernel() is not None)
    """)
    env = {**os.environ, "XDG_CACHE_HOME": str(fresh.parent)}
    env.pop("SHARDVAR_NATIVE", None)
    procs = [
        subprocess.Popen([sys.executable, "-c", code, str(i)], env=env, stdout=subprocess.PIPE, text=True)
        for i in range(4)
    ]
    while len(list(flags.glob("ready-*"))) < 4 and all(p.poll() is None for p in procs):
        time.sleep(0.01)
    (flags / "go").touch()
    outs = [p.communicate(timeout=120)[0].strip() for p in procs]
    assert [p.returncode for p in procs] == [0] * 4 and outs == ["True"] * 4
    assert [p.name for p in fresh.iterdir()] == [_native.built().name]  # one library, no partial file left


@pytest.mark.parametrize("spread", [False, True])
def test_writes_spread_over_threads_when_reads_wait_for_the_disk_write_the_same_bytes(tmp_path, kernel, spread):
    """Once a large read mostly waited for the disk, writes go out on many threads (each would read its
    page first); a read the page cache served turns that off again. Either way: the same file."""
    layout = RecordLayout(2048, 1024, "float32", 2)  # a record spans a page: each read its own
    zeros = lambda ids: (torch.zeros(ids.numel(), 1024), torch.zeros(ids.numel(), 2))  # noqa: E731
    with RowFile.create(tmp_path / "w.rows", layout, zeros) as f:
        assert f._native is kernel and not f.disk_bound
        ids = torch.arange(0, 2048, 4)  # 512 records, no two in one page: none read by another's read
        if _nowait_works(f):  # else every read counts as waiting: nothing to tell apart
            f.read(ids)  # created files are dropped from the page cache (settle): this read waited
            assert f.disk_bound
            f.read(ids)  # the same pages, cached now
            assert not f.disk_bound
        f.disk_bound = spread
        records = torch.randint(0, 256, (ids.numel(), layout.record_bytes), dtype=torch.uint8)
        f.write_from(ids, records)
        assert torch.equal(f.read(ids), records)
        untouched = torch.ones(2048, dtype=torch.bool).index_fill_(0, ids, False).nonzero().squeeze(1)
        assert bool((f.read(untouched) == 0).all())


def _nowait_works(f: RowFile) -> bool:
    try:
        os.preadv(f.fd, [bytearray(16)], 4096, os.RWF_NOWAIT)
    except BlockingIOError:
        return True
    except (OSError, AttributeError):
        return False
    return True
