"""Tiered tables in the modules (``storage=shardvar.Tiered(...)``): the same values as in memory, bitwise.

Each table is checked against the same module held in memory, built under the same seed and
trained by the same fused optimizer: after every run every row and its optimizer state are equal,
with caches of a few rows (eviction and write-back on every step), both policies, and read-ahead.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

import shardvar
from shardvar import ShardvarTypeError, ShardvarValueError, optim
from shardvar.tiered import BackingFileError, Prefetcher, cache_bytes_for

ROWS, DIM = 60, 4
OPTIMIZERS = {
    "rowwise_adagrad": lambda m: optim.RowWiseAdagrad(m, lr=0.1),
    "rowwise_adam": lambda m: optim.RowWiseAdam(m, lr=0.05),
    "sgd_momentum": lambda m: optim.SGD(m, lr=0.1, momentum=0.9),
    "adagrad": lambda m: optim.Adagrad(m, lr=0.1, initial_accumulator_value=0.1),
}


def _tiered(tmp_path, cache_rows: int, policy: str = "lru", name: str = "t.rows", state: int = 1, read_ahead=0.0):
    """``cache_rows`` slots, with ``read_ahead`` of the bytes and the staging area besides."""
    cache_bytes = cache_bytes_for(cache_rows, DIM, rows=ROWS, state_width=state, read_ahead=read_ahead)
    return shardvar.Tiered(tmp_path / name, cache_bytes=cache_bytes, policy=policy, read_ahead=read_ahead)


def _pair(cls, tmp_path, cache_rows=12, policy="lru", seed=0, read_ahead=0.0, **kw):
    torch.manual_seed(seed)
    ref = cls(ROWS, DIM, sparse=True, **kw)
    torch.manual_seed(seed)
    storage = _tiered(tmp_path, cache_rows, policy, read_ahead=read_ahead)
    tiered = cls(ROWS, DIM, sparse=True, storage=storage, **kw)
    return ref, tiered


def _batches(n: int, bags: bool, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = (torch.rand(10, generator=g) ** 2 * ROWS).long()  # skewed: hits and misses both
        out.append((ids, torch.tensor([0, 2, 2, 6])) if bags else (ids.view(2, 5), None))
    return out


def _run(module, batches, prefetch: bool):
    def step(batch):
        ids, offsets = batch
        out = module(ids, offsets) if offsets is not None else module(ids)
        (out * torch.linspace(-1, 1, out.shape[-1])).square().sum().backward()

    if prefetch:
        batches = Prefetcher(batches, lambda b: [(module.cache, b[0])])
    for batch in batches:
        step(batch)


def _state_of(opt, slot):
    return opt.tables[0].state[slot][0]


@pytest.mark.parametrize("cls", [shardvar.ShardedEmbedding, shardvar.ShardedEmbeddingBag])
@pytest.mark.parametrize("policy", ["lru", "lfu"])
@pytest.mark.parametrize("prefetch", [False, True])
@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
@pytest.mark.usefixtures("unmapped_files")
def test_training_equals_the_table_in_memory_bitwise(tmp_path, cls, policy, prefetch, opt_name):
    bags = cls is shardvar.ShardedEmbeddingBag
    kw = {"mode": "sum"} if bags else {}
    rows = 14 if opt_name == "rowwise_adagrad" else 24
    ref, tiered = _pair(cls, tmp_path, cache_rows=rows, policy=policy, read_ahead=0.25 if prefetch else 0.0, **kw)
    assert torch.equal(tiered.tier.peek(torch.arange(ROWS))[0], ref.weight.to_tensor())
    opts = [OPTIMIZERS[opt_name](m) for m in (ref, tiered)]
    for o in opts:
        optim.fuse(o)
    batches = _batches(25, bags)
    _run(ref, batches, prefetch=False)
    _run(tiered, batches, prefetch)
    values, state = tiered.tier.peek(torch.arange(ROWS))
    assert torch.equal(values, ref.weight.to_tensor())
    for slot, (first, width) in tiered.tier.slot_columns().items():
        expected = _state_of(opts[0], slot)
        assert torch.equal(state[:, first : first + width].reshape(expected.shape), expected), slot
    stats = tiered.cache_stats()
    assert stats["evictions"] > 0 and stats["written_back"] > 0 and 0 < stats["hit_rate"] < 1
    if prefetch:
        assert stats["prefetched"] > 0


@pytest.mark.parametrize("mode", ["mean", "sum"])
def test_bags_with_weights_and_padding_equal_the_table_in_memory(tmp_path, mode):
    ref, tiered = _pair(shardvar.ShardedEmbeddingBag, tmp_path, mode=mode, padding_idx=3)
    opts = [optim.RowWiseAdagrad(m, lr=0.1) for m in (ref, tiered)]
    for o in opts:
        optim.fuse(o)
    for ids, offsets in _batches(12, bags=True, seed=5):
        ids = torch.where(ids % 4 == 0, 3, ids)
        weights = torch.linspace(0.5, 1.5, ids.numel()) if mode == "sum" else None
        for m in (ref, tiered):
            m(ids, offsets, weights).square().sum().backward()
    values, state = tiered.tier.peek(torch.arange(ROWS))
    assert torch.equal(values, ref.weight.to_tensor()) and torch.equal(state[:, 0], _state_of(opts[0], "sum"))
    assert torch.equal(values[3], torch.zeros(DIM))


def test_lookups_without_grad_and_frozen_tables(tmp_path):
    ref, tiered = _pair(shardvar.ShardedEmbedding, tmp_path)
    ids = torch.tensor([[1, 5], [59, 1]])
    with torch.no_grad():
        assert torch.equal(tiered(ids), ref(ids))
    frozen = shardvar.ShardedEmbedding.from_pretrained(ref.weight.to_tensor(), storage=_tiered(tmp_path, 8, name="f"))
    assert not frozen(ids).requires_grad and torch.equal(frozen(ids), ref(ids).detach())


@pytest.mark.parametrize(
    "make",
    [
        lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
        lambda m: torch.optim.SparseAdam(list(m.parameters()), lr=0.1),
        lambda m: optim.RowWiseAdagrad(m, lr=0.1),  # not fused
    ],
    ids=["torch_sgd", "sparse_adam", "unfused"],
)
def test_training_without_a_fused_shardvar_optimizer_is_refused(tmp_path, make):
    _, tiered = _pair(shardvar.ShardedEmbeddingBag, tmp_path, mode="sum")
    make(tiered)
    before = tiered.tier.peek(torch.arange(ROWS))
    with pytest.raises(ShardvarTypeError, match=r"fused into backward.*RowWiseAdagrad.*fuse"):
        tiered(torch.tensor([1, 2, 3]), torch.tensor([0])).sum().backward()
    assert all(torch.equal(a, b) for a, b in zip(tiered.tier.peek(torch.arange(ROWS)), before, strict=True))


def test_table_sized_views_are_refused(tmp_path):
    ref, tiered = _pair(shardvar.ShardedEmbedding, tmp_path)
    with pytest.raises(ShardvarTypeError, match="tiered table's weight is not materialised"):
        tiered.weight  # noqa: B018
    with pytest.raises(ShardvarTypeError, match=r"does not load a state dict.*shardvar\.load"):
        tiered.load_state_dict(ref.state_dict())
    assert list(tiered.state_dict()) == list(ref.state_dict()) == ["weight"]


@pytest.mark.parametrize("read_ahead", [0.0, 0.125, 0.5])
@pytest.mark.parametrize("distinct", [6, 20])
def test_a_cache_smaller_than_a_batch_says_how_much_is_needed_and_changes_nothing(tmp_path, read_ahead, distinct):
    _, tiered = _pair(shardvar.ShardedEmbedding, tmp_path, cache_rows=4, read_ahead=read_ahead)
    optim.fuse(optim.RowWiseAdagrad(tiered, lr=0.1))
    tiered(torch.tensor([1, 2])).sum().backward()
    before, stats = tiered.tier.peek(torch.arange(ROWS)), tiered.cache_stats()
    batch = torch.arange(distinct).repeat(2)
    with pytest.raises(ShardvarValueError, match=rf"needs {distinct} distinct rows.*at least {distinct} rows") as e:
        tiered(batch)
    assert tiered.cache_stats() == stats
    assert all(torch.equal(a, b) for a, b in zip(tiered.tier.peek(torch.arange(ROWS)), before, strict=True))
    needed = int(re.search(r"cache_bytes=(\d+)", str(e.value)).group(1))  # the figure it gives is enough, and least
    for cache_bytes, fits in ((needed, True), (needed - 1, False)):
        storage = shardvar.Tiered(tmp_path / f"{cache_bytes}.rows", cache_bytes=cache_bytes, read_ahead=read_ahead)
        table = shardvar.ShardedEmbedding(ROWS, DIM, sparse=True, storage=storage)
        optim.fuse(optim.RowWiseAdagrad(table, lr=0.1))
        assert (table.cache_stats()["capacity_rows"] >= distinct) == fits
        if fits:
            table(batch).sum().backward()
        table.close()


def test_rows_of_a_pending_backward_stay_in_the_cache(tmp_path):
    ref, tiered = _pair(shardvar.ShardedEmbedding, tmp_path, cache_rows=6)
    for m in (ref, tiered):
        optim.fuse(optim.RowWiseAdagrad(m, lr=0.1))
    first = tiered(torch.tensor([1, 2, 3]))
    with pytest.raises(ShardvarValueError, match="3 more are held for a batch in flight"):
        tiered(torch.tensor([4, 5, 6, 7]))
    second = tiered(torch.tensor([4, 5, 6]))
    (first.sum() + second.sum()).backward()
    (ref(torch.tensor([1, 2, 3])).sum() + ref(torch.tensor([4, 5, 6])).sum()).backward()
    assert torch.equal(tiered.tier.peek(torch.arange(ROWS))[0], ref.weight.to_tensor())
    del first, second
    tiered(torch.tensor([7, 8, 9, 10, 11, 12]))  # nothing held any more


def test_a_dropped_graph_releases_its_rows_and_a_removed_fuse_refuses_again(tmp_path):
    _, tiered = _pair(shardvar.ShardedEmbedding, tmp_path, cache_rows=6)
    handle = optim.fuse(optim.RowWiseAdagrad(tiered, lr=0.1))
    out = tiered(torch.tensor([1, 2, 3]))
    with pytest.raises(ShardvarValueError, match="held for a batch in flight"):
        tiered(torch.tensor([4, 5, 6, 7]))
    del out  # no backward will come: its rows are free again
    tiered(torch.tensor([4, 5, 6, 7, 8, 9])).sum().backward()
    handle.remove()
    with pytest.raises(ShardvarTypeError, match="no fused optimizer holds this table"):
        tiered(torch.tensor([1])).sum().backward()


@pytest.mark.parametrize(
    "options, error, match",
    [
        ({"cache_bytes": 0}, ShardvarValueError, "cache_bytes"),
        ({"cache_bytes": 100, "policy": "fifo"}, ShardvarValueError, "policy"),
        ({"cache_bytes": 100, "path": 3}, ShardvarTypeError, "path"),
        ({"cache_bytes": 100, "path": "/no/such/folder/t.rows"}, BackingFileError, "does not exist"),
    ],
)
def test_bad_storage_options_are_refused(tmp_path, options, error, match):
    with pytest.raises(error, match=match):
        shardvar.Tiered(**{"path": tmp_path / "t.rows", **options})


def test_a_cache_without_room_for_one_row_is_refused_and_leaves_no_file(tmp_path):
    with pytest.raises(ShardvarValueError, match=r"holds no row: one row and its state take 16 bytes"):
        shardvar.ShardedEmbedding(ROWS, DIM, storage=shardvar.Tiered(tmp_path / "t.rows", cache_bytes=15))
    assert not list(tmp_path.iterdir())


def test_a_folder_not_writable_is_refused(tmp_path, monkeypatch):
    if os.geteuid() == 0:  # root writes anywhere: the folder is made to read as not writable
        real = os.access
        monkeypatch.setattr(os, "access", lambda p, mode: False if str(p) == str(tmp_path) else real(p, mode))
    tmp_path.chmod(0o500)
    try:
        with pytest.raises(BackingFileError, match="not writable"):
            shardvar.Tiered(tmp_path / "t.rows", cache_bytes=100)
    finally:
        tmp_path.chmod(0o700)


def test_two_tables_on_one_file_are_refused(tmp_path):
    storage = _tiered(tmp_path, 8)
    first = shardvar.ShardedEmbedding(ROWS, DIM, storage=storage)
    with pytest.raises(BackingFileError, match="open in another process"):
        shardvar.ShardedEmbedding(ROWS, DIM, storage=storage)
    first.close()
    with pytest.raises(BackingFileError, match="already exists: a backing file is not a checkpoint"):
        shardvar.ShardedEmbedding(ROWS, DIM, storage=storage)


def test_the_file_of_a_killed_process_is_refused(tmp_path):
    path = tmp_path / "t.rows"
    code = f"""
        import os, signal, shardvar
        t = shardvar.ShardedEmbedding(100, 4, storage=shardvar.Tiered({str(path)!r}, cache_bytes=400))
        os.kill(os.getpid(), signal.SIGKILL)
    """
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=os.environ, timeout=120)
    assert proc.returncode == -signal.SIGKILL
    with pytest.raises(BackingFileError, match=r"not closed cleanly.*last checkpoint"):
        shardvar.ShardedEmbedding(100, 4, storage=shardvar.Tiered(path, cache_bytes=400))


def test_a_disk_too_small_fails_cleanly(tmp_path):
    with pytest.raises(BackingFileError, match="cannot reserve"):
        shardvar.ShardedEmbedding(1 << 44, 4, storage=shardvar.Tiered(tmp_path / "t.rows", cache_bytes=400))
    assert not list(tmp_path.iterdir())


def test_cache_stats_count_reads_and_writes(tmp_path):
    _, tiered = _pair(shardvar.ShardedEmbedding, tmp_path, cache_rows=4)
    optim.fuse(optim.RowWiseAdagrad(tiered, lr=0.1))
    record, base = tiered.tier.layout.record_bytes, tiered.cache_stats()
    tiered(torch.tensor([1, 2, 3, 4])).sum().backward()
    tiered(torch.tensor([5, 1])).sum().backward()
    stats = tiered.cache_stats()
    assert (stats["hits"], stats["misses"], stats["evictions"], stats["written_back"]) == (1, 5, 1, 1)
    assert stats["hit_rate"] == pytest.approx(1 / 6)
    assert stats["capacity_rows"] == 4 and stats["cache_bytes"] == 4 * (DIM * 4 + 4) + 2 * record  # one staged, one behind
    assert stats["bytes_read"] - base["bytes_read"] == 5 * record
    assert tiered.tier.layout.spare and stats["relocated"] == 0  # through the log, which had room
    assert stats["bytes_written"] - base["bytes_written"] == record + 8  # the record, and its owner


@pytest.mark.parametrize("pooled", [True, False])
@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_collection_tables_equal_the_collection_in_memory(tmp_path, pooled, policy):
    cls = shardvar.EmbeddingBagCollection if pooled else shardvar.EmbeddingCollection

    def configs(tiered: bool) -> dict:
        storage = _tiered(tmp_path, 14, policy, name="big.rows") if tiered else None
        return {
            "big": shardvar.TableConfig(ROWS, DIM, storage=storage),
            "small": shardvar.TableConfig(20, DIM, 2, "mod"),
        }

    torch.manual_seed(0)
    ref = cls(configs(False), sparse=True)
    torch.manual_seed(0)
    tiered = cls(configs(True), sparse=True)
    tables = "embedding_bags" if pooled else "embeddings"
    big = getattr(tiered, tables)["big"]
    assert isinstance(big.tier, shardvar.tiered.TieredRows)
    opts = [optim.RowWiseAdagrad(m, lr=0.1) for m in (ref, tiered)]
    for o in opts:
        optim.fuse(o)
    for ids, offsets in _batches(15, bags=True, seed=3):
        features = {"big": ids, "small": ids % 20}
        lengths = {"big": offsets, "small": offsets}
        for m in (ref, tiered):
            out = m(features, lengths)
            values = [v if pooled else v.values for v in out.values()]
            sum(v.square().sum() for v in values).backward()
    values, state = big.tier.peek(torch.arange(ROWS))
    assert torch.equal(values, getattr(ref, tables)["big"].weight.to_tensor())
    assert torch.equal(state[:, 0], next(t for t in opts[0].tables if "big" in t.name).state["sum"][0])
    small = [getattr(m, tables)["small"].weight.to_tensor() for m in (ref, tiered)]
    assert torch.equal(*small)


def test_table_config_storage_must_be_a_storage():
    with pytest.raises(ShardvarTypeError, match=r"storage must be shardvar.Tiered"):
        shardvar.TableConfig(10, 4, storage="/tmp/x.rows")


@pytest.mark.parametrize(
    "cls, options",
    [(shardvar.ShardedEmbeddingBag, {"mode": "max"}), (shardvar.ShardedEmbedding, {"scale_grad_by_freq": True})],
    ids=["max_bags", "scale_grad_by_freq"],
)
def test_other_lookup_options_equal_the_table_in_memory(tmp_path, cls, options):
    torch.manual_seed(0)
    ref = cls(ROWS, DIM, sparse=False, **options)  # torch has no sparse gradient for these
    torch.manual_seed(0)
    tiered = cls(ROWS, DIM, storage=_tiered(tmp_path, 14), **options)
    opts = [optim.RowWiseAdagrad(m, lr=0.1) for m in (ref, tiered)]
    for o in opts:
        optim.fuse(o)
    bags = cls is shardvar.ShardedEmbeddingBag
    _run(ref, _batches(10, bags, seed=7), prefetch=False)
    _run(tiered, _batches(10, bags, seed=7), prefetch=False)
    values, state = tiered.tier.peek(torch.arange(ROWS))
    assert torch.equal(values, ref.weight.to_tensor()) and torch.equal(state[:, 0], _state_of(opts[0], "sum"))


@pytest.mark.parametrize("read_ahead", [0.1, 0.25, 0.5])
@pytest.mark.parametrize("limit", [3, 1 << 16])
@pytest.mark.usefixtures("unmapped_files")
def test_slots_and_rows_read_ahead_stay_within_cache_bytes(tmp_path, monkeypatch, read_ahead, limit):
    from shardvar.tiered import RowCache

    held: list[tuple[int, int]] = []  # (bytes of slots + staged records, staged rows) after each read ahead
    stage = RowCache.stage

    def counted(cache, ids, limit):
        n = stage(cache, ids, limit)
        staged = sum(s.records.nbytes for s in cache._staged if s.records is not None)
        held.append((cache.values.nbytes + cache.state.nbytes + staged, cache.staged_rows))
        return n

    monkeypatch.setattr(RowCache, "stage", counted)
    storage = _tiered(tmp_path, 30, read_ahead=read_ahead)
    tiered = shardvar.ShardedEmbeddingBag(ROWS, DIM, mode="sum", sparse=True, storage=storage)
    optim.fuse(optim.RowWiseAdam(tiered, lr=0.05))  # wider records: the reserve is re-sized with them
    batches = _batches(20, bags=True, seed=4)
    for ids, offsets in Prefetcher(batches, lambda b: [(tiered.cache, b[0])], limit=limit):
        tiered(ids, offsets).sum().backward()
    stats = tiered.cache_stats()
    assert held and stats["read_ahead_rows"] >= 1 and stats["prefetched"] > 0
    assert stats["cache_bytes"] <= storage.cache_bytes
    assert max(total for total, _ in held) <= storage.cache_bytes
    assert max(rows for _, rows in held) <= stats["read_ahead_rows"]


def test_without_read_ahead_nothing_is_staged(tmp_path):
    tiered = shardvar.ShardedEmbedding(ROWS, DIM, sparse=True, storage=_tiered(tmp_path, 12))
    optim.fuse(optim.RowWiseAdagrad(tiered, lr=0.1))
    for ids, _ in Prefetcher(_batches(5, bags=False), lambda b: [(tiered.cache, b[0])]):
        tiered(ids).sum().backward()
    assert tiered.cache_stats()["read_ahead_rows"] == 0 and tiered.cache_stats()["prefetched"] == 0
