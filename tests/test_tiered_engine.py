"""The tiered engine: RowFile (records on disk), RowCache (bounded RAM), Prefetcher (read ahead).

Exactness is checked against the same table trained in memory: every row and its state equal,
bitwise, whatever the cache size, policy and read-ahead.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardvar import ShardvarValueError
from shardvar.tiered import BackingFileError, Prefetcher, RecordLayout, RowCache, RowFile

DTYPES = ["float32", "float16", "bfloat16", "float64"]


def _init(layout: RecordLayout, seed: int = 0):
    def init(ids: torch.Tensor):
        g = torch.Generator().manual_seed(seed)
        base = torch.randn((layout.rows, layout.dim), generator=g).to(layout.torch_dtype)
        return base[ids], torch.full((ids.numel(), layout.state_width), 0.1)

    return init


def _file(tmp_path, rows=40, dim=4, dtype="float32", state=1, name="t.rows", **kw) -> RowFile:
    layout = RecordLayout(rows, dim, dtype, state)
    return RowFile.create(tmp_path / name, layout, _init(layout), chunk_rows=7, **kw)


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(DTYPES), st.integers(1, 9), st.integers(0, 3), st.integers(1, 5))
def test_records_split_and_join_round_trip(dtype, dim, state, n):
    layout = RecordLayout(10, dim, dtype, state)
    values = torch.randn(n, dim).to(layout.torch_dtype)
    slots = torch.randn(n, state)
    got_values, got_state = layout.split(layout.join(values, slots))
    assert torch.equal(got_values, values) and torch.equal(got_state, slots)
    assert layout.record_bytes % 8 == 0 and layout.record_bytes >= layout.row_bytes + 4 * state


@pytest.mark.parametrize("dtype", DTYPES)
def test_file_reads_what_was_written_in_any_order(tmp_path, dtype):
    with _file(tmp_path, dtype=dtype, state=2) as f:
        values, state = _init(f.layout)(torch.arange(40))
        ids = torch.tensor([39, 0, 5, 5, 6, 7, 21, 0])
        got_values, got_state = f.layout.split(f.read(ids))
        assert torch.equal(got_values, values[ids]) and torch.equal(got_state, state[ids])
        new = torch.tensor([6, 3, 4])
        f.write(new, f.layout.join(-values[new], torch.ones(3, 2)))
        got_values, _ = f.layout.split(f.read(torch.arange(40)))
        expected = values.clone()
        expected[new] = -values[new]
        assert torch.equal(got_values, expected)
        assert f.bytes_read == (8 + 40) * f.layout.record_bytes


def test_closed_file_reopens_with_its_rows(tmp_path):
    f = _file(tmp_path)
    f.write(torch.tensor([3]), f.layout.join(torch.full((1, 4), 7.0), torch.zeros(1, 1)))
    f.close()
    f.close()  # idempotent
    with RowFile.open(tmp_path / "t.rows") as g:
        assert torch.equal(g.layout.split(g.read(torch.tensor([3])))[0], torch.full((1, 4), 7.0))


def test_second_opener_is_refused(tmp_path):
    with _file(tmp_path), pytest.raises(BackingFileError, match="open in another process"):
        RowFile.open(tmp_path / "t.rows")


def test_file_of_a_killed_process_is_refused(tmp_path):
    path = tmp_path / "t.rows"
    code = f"""
        import os, signal, torch
        from shardvar.tiered import RecordLayout, RowFile
        layout = RecordLayout(100, 4, "float32", 1)
        f = RowFile.create({str(path)!r}, layout, lambda ids: (torch.zeros(ids.numel(), 4), torch.zeros(ids.numel(), 1)))
        os.kill(os.getpid(), signal.SIGKILL)
    """
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=os.environ, timeout=120)
    assert proc.returncode == -signal.SIGKILL
    with pytest.raises(BackingFileError, match=r"not closed cleanly.*last checkpoint"):
        RowFile.open(path)


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda p: p / "missing-dir" / "t.rows", "cannot create"),
        (lambda p: p, "already exists"),
        (lambda p: p / "huge.rows", "cannot reserve"),
    ],
)
def test_bad_paths_and_full_disks_are_refused_and_leave_nothing(tmp_path, make, match):
    path = make(tmp_path)
    rows = 1 << 50 if path.name == "huge.rows" else 10
    before = sorted(tmp_path.iterdir())
    with pytest.raises(BackingFileError, match=match):
        RowFile.create(path, RecordLayout(rows, 4, "float32", 0), _init(RecordLayout(10, 4, "float32", 0)))
    assert sorted(tmp_path.iterdir()) == before


def test_damaged_header_and_truncation_are_refused(tmp_path):
    _file(tmp_path).close()
    path = tmp_path / "t.rows"
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 8)
    with pytest.raises(BackingFileError, match="truncated"):
        RowFile.open(path)
    path.write_bytes(b"not a backing file" * 300)
    with pytest.raises(BackingFileError, match="not a shardvar backing file"):
        RowFile.open(path)


def _adagrad(values: torch.Tensor, state: torch.Tensor, grad: torch.Tensor, lr: float = 0.1):
    """Row-wise Adagrad on rows and their accumulator (both updated in place)."""
    state.add_(grad.pow(2).mean(1, keepdim=True))
    values.addcdiv_(grad, state.sqrt().add_(1e-8), value=-lr)


def _batches(rows: int, steps: int, size: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    zipf = 1.0 / torch.arange(1, rows + 1, dtype=torch.float64) ** 1.05
    return [torch.multinomial(zipf, size, replacement=True, generator=g) for _ in range(steps)]


def _train_in_memory(layout: RecordLayout, batches: list[torch.Tensor]):
    values, state = _init(layout)(torch.arange(layout.rows))
    for step, ids in enumerate(batches):
        distinct = torch.unique(ids)
        grad = torch.sin(values[distinct] * (step + 1))
        v, s = values[distinct], state[distinct]
        _adagrad(v, s, grad)
        values[distinct], state[distinct] = v, s
    return values, state


def _train_cached(cache: RowCache, batches, prefetch: bool):
    loop = Prefetcher(batches, lambda ids: [(cache, ids)], limit=64) if prefetch else batches
    for step, ids in enumerate(loop):
        distinct = torch.unique(ids)
        slots = cache.resolve(distinct)
        grad = torch.sin(cache.values[slots] * (step + 1))
        v, s = cache.values[slots], cache.state[slots]
        _adagrad(v, s, grad)
        cache.values[slots], cache.state[slots] = v, s
        cache.mark_dirty(slots)


@pytest.mark.parametrize("policy", ["lru", "lfu"])
@pytest.mark.parametrize("capacity", [12, 20, 64])
@pytest.mark.parametrize("prefetch", [False, True])
@pytest.mark.parametrize("relocate", [True, False])
@pytest.mark.usefixtures("unmapped_files")
def test_cached_training_equals_training_in_memory(tmp_path, policy, capacity, prefetch, relocate):
    """Whether changed rows go back to their own places or through the file's log (segments of 4 records, 16
    spare ones: the log is cleaned every few steps)."""
    layout = RecordLayout(64, 3, "float32", 1, spare=16)
    batches = _batches(64, 60, 12, seed=capacity)
    expected_values, expected_state = _train_in_memory(layout, batches)
    with RowFile.create(tmp_path / "t.rows", layout, _init(layout)) as f:
        cache = RowCache(f, capacity, policy, relocate=relocate, segment=4)
        _train_cached(cache, batches, prefetch)
        values, state = cache.peek(torch.arange(64))  # before the flush: cache and file together
        assert torch.equal(values, expected_values) and torch.equal(state, expected_state)
        cache.flush()
        places = cache.places_of(torch.arange(64))
        assert places.unique().numel() == 64 and int(places.max()) < 80  # one record per row
        assert cache.moved == (relocate and capacity < 64) == bool((places != torch.arange(64)).any())
        assert (cache.stats.relocated > 0) == (relocate and capacity < 64)  # cleaning ran
        owners = f.read_owners(torch.arange(80))
        assert torch.equal(owners[places], torch.arange(64))  # every row's record says it holds that row
        if cache.log is not None:  # the log's live counts are the records holding a row
            live = torch.bincount(places // 4, minlength=20).to(torch.int32)
            assert torch.equal(cache.log.live, live)
        values, state = layout.split(f.read(places))
        assert torch.equal(values, expected_values) and torch.equal(state, expected_state)
        looked = sum(torch.unique(b).numel() for b in batches)
        assert cache.stats.hits + cache.stats.misses == looked
        if capacity < 64:
            assert cache.stats.evictions > 0 and cache.stats.written_back > 0
        if prefetch:
            assert cache.stats.prefetched > 0


def test_batch_larger_than_the_cache_is_refused_and_changes_nothing(tmp_path):
    with _file(tmp_path) as f:
        cache = RowCache(f, 5)
        cache.resolve(torch.tensor([1, 2, 3]))
        held = lambda: (cache.values, cache.key, cache.used, cache.count, cache.dirty)  # noqa: E731
        before = [t.clone() for t in held()]
        step = cache.step
        with pytest.raises(
            ShardvarValueError, match=r"holds 5 rows; this batch needs 6 distinct rows.*at least 6 rows"
        ):
            cache.resolve(torch.arange(10, 16))
        assert all(torch.equal(a, b) for a, b in zip(before, held(), strict=True))
        assert cache.step == step


def test_rows_of_a_batch_in_flight_are_kept(tmp_path):
    with _file(tmp_path) as f:
        cache = RowCache(f, 6)
        cache.resolve(torch.tensor([1, 2, 3]))
        in_flight = cache.step
        cache.resolve(torch.tensor([4, 5]), protect_since=in_flight)
        with pytest.raises(ShardvarValueError, match="held for a batch in flight"):
            cache.resolve(torch.tensor([7, 8]), protect_since=in_flight)
        assert bool((cache.lookup(torch.tensor([1, 2, 3])) >= 0).all())


@pytest.mark.usefixtures("unmapped_files")
def test_a_staged_row_written_back_meanwhile_is_read_again(tmp_path):
    with _file(tmp_path) as f:
        cache = RowCache(f, 2)
        cache.stage(torch.tensor([9]), limit=4)  # read ahead: row 9 as the file has it now
        slot = cache.resolve(torch.tensor([9]))
        cache.values[slot] = 42.0
        cache.mark_dirty(slot)
        cache.resolve(torch.tensor([10, 11]))  # evicts row 9: written back with 42
        assert torch.equal(cache.values[cache.resolve(torch.tensor([9]))], torch.full((1, 4), 42.0))


def test_prefetch_errors_reach_the_loop(tmp_path):
    with _file(tmp_path) as f:
        cache = RowCache(f, 8)
        loop = Prefetcher([torch.tensor([1]), torch.tensor([99])], lambda ids: [(cache, ids)])
        with pytest.raises(ShardvarValueError, match=r"row ids must be in \[0, 40\); got 99"):
            for _ in loop:
                pass


@pytest.mark.parametrize("reserve", [0, 1, 4, 9])
@pytest.mark.usefixtures("unmapped_files")
def test_staged_records_never_exceed_the_reserve(tmp_path, reserve):
    with _file(tmp_path) as f:
        cache = RowCache(f, 8, reserve=reserve)
        assert cache.nbytes == 8 * (4 * 4 + 4) + (reserve + 2 * cache.staging.shape[0]) * f.layout.record_bytes
        for start in range(0, 40, 10):
            last = cache.stage(torch.arange(start, start + 10), limit=100)
            assert cache.staged_rows <= reserve
            assert sum(s.records.nbytes for s in cache._staged if s.records is not None) <= reserve * 24
        cache.resolve(torch.arange(30, 38))  # the last set's rows: taken from it where staged
        assert cache.stats.prefetched == last and (last > 0) == (reserve > 1)


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("nowait", [True, False])
@pytest.mark.parametrize("cached", [True, False])
def test_reads_are_the_records_whether_the_page_cache_serves_them_or_the_disk(
    tmp_path, monkeypatch, nowait, cached, native
):
    """Reads the page cache holds are served at once (``RWF_NOWAIT``), the others by I/O threads: the
    same records either way, also without ``RWF_NOWAIT``, with the file dropped from the cache, and
    through the native kernel or the Python path."""
    import shardvar.tiered._file as file_module

    f = _file(tmp_path, rows=300, dim=5)
    if not native:
        f._native = None
    ids = torch.randperm(300, generator=torch.Generator().manual_seed(1))[:120]
    want = f.read(ids)
    monkeypatch.setattr(file_module, "_NOWAIT", nowait and file_module._NOWAIT)
    if not cached:  # written out, then dropped: the reads must wait for the disk (or a fake cache miss)
        os.fsync(f.fd)
        os.posix_fadvise(f.fd, 0, 0, os.POSIX_FADV_DONTNEED)
    assert torch.equal(f.read(ids), want)
    assert torch.equal(f.read(ids.sort().values), want[ids.argsort()])
    f.close()
