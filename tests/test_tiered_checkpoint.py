"""Checkpoints of tiered tables: streamed from the backing file into a normal checkpoint, and back.

A tiered table's checkpoint loads into an in-memory module of any layout (rows and optimizer
state), and an in-memory module's checkpoint loads into a tiered table (its file written, its
cache forgotten); training then goes on exactly as in memory.
"""

from __future__ import annotations

import functools
import itertools

import pytest
import torch

import shardvar
from helpers import TIERED_DIM, TIERED_ROWS, tiered_bag, train_bags
from shardvar import optim
from shardvar.tiered import _views

ROWS, DIM = TIERED_ROWS, TIERED_DIM


_tiered = tiered_bag
_train = functools.partial(train_bags, steps=8, seed=2)


def _fused(module):
    opt = optim.RowWiseAdagrad(module, lr=0.1)
    optim.fuse(opt)
    return opt


@pytest.mark.parametrize("layout", [(1, "div"), (3, "mod"), (4, "div")])
def test_a_tiered_checkpoint_loads_into_a_table_in_memory(tmp_path, monkeypatch, layout):
    monkeypatch.setattr(_views, "STREAM_ROWS", 7)  # many pieces per shard
    torch.manual_seed(0)
    ref = shardvar.ShardedEmbeddingBag(ROWS, DIM, mode="sum", sparse=True)
    tiered = _tiered(tmp_path)
    opts = [_fused(m) for m in (ref, tiered)]
    for m in (ref, tiered):
        _train(m)
    shardvar.save({"model": tiered, "opt": opts[1]}, tmp_path / "ckpt")
    target = shardvar.ShardedEmbeddingBag(ROWS, DIM, *layout, mode="sum", sparse=True)
    target_opt = optim.RowWiseAdagrad(target, lr=0.1)
    shardvar.load({"model": target, "opt": target_opt}, tmp_path / "ckpt")
    assert torch.equal(target.weight.to_tensor(), ref.weight.to_tensor())
    saved = target_opt.sharded_variables()["weight/sum"]
    assert torch.equal(saved.join(), opts[0].tables[0].state["sum"][0])


def test_a_checkpoint_in_memory_loads_into_a_tiered_table_and_training_goes_on(tmp_path):
    torch.manual_seed(0)
    ref = shardvar.ShardedEmbeddingBag(ROWS, DIM, 2, "mod", mode="sum", sparse=True)
    ref_opt = _fused(ref)
    _train(ref)
    shardvar.save({"model": ref, "opt": ref_opt}, tmp_path / "ckpt")
    tiered = _tiered(tmp_path, seed=5)  # other values, and a warm cache that the load makes stale
    opt = _fused(tiered)
    _train(tiered, steps=3, seed=9)
    shardvar.load({"model": tiered, "opt": opt}, tmp_path / "ckpt")
    values, state = tiered.tier.peek(torch.arange(ROWS))
    assert torch.equal(values, ref.weight.to_tensor())
    assert torch.equal(state[:, 0], ref_opt.sharded_variables()["weight/sum"].join())
    for m in (ref, tiered):
        _train(m, steps=6, seed=4)
    values, state = tiered.tier.peek(torch.arange(ROWS))
    assert torch.equal(values, ref.weight.to_tensor())


def test_saving_writes_back_changed_rows_and_keeps_the_cache(tmp_path):
    tiered = _tiered(tmp_path)
    _fused(tiered)
    _train(tiered, steps=3)
    assert bool(tiered.tier.cache.dirty.any())
    expected = tiered.tier.peek(torch.arange(ROWS))[0]
    shardvar.save({"model": tiered}, tmp_path / "ckpt")
    assert not bool(tiered.tier.cache.dirty.any()) and int((tiered.tier.cache.key >= 0).sum()) > 0
    target = shardvar.ShardedEmbeddingBag(ROWS, DIM, mode="sum")
    shardvar.load({"model": target}, tmp_path / "ckpt")
    assert torch.equal(target.weight.to_tensor(), expected)


def _flip(directory, where: str) -> None:
    """Flip one byte of the data (not the header) of a checkpoint's data file: first or last tensor."""
    path = next(directory.glob("data-*.safetensors"))
    raw = bytearray(path.read_bytes())
    begin = 8 + int.from_bytes(raw[:8], "little")
    raw[begin + 5 if where == "first" else len(raw) - 3] ^= 0x40
    path.write_bytes(raw)


@pytest.mark.parametrize("where", ["first", "last"])
@pytest.mark.parametrize("staging_bytes", [0, 1 << 20])  # verified in place then windows / staged whole
def test_a_corrupted_checkpoint_leaves_the_tiered_table_as_it_was(tmp_path, where, staging_bytes):
    from shardvar import CheckpointError

    tiered = _tiered(tmp_path)
    opt = _fused(tiered)
    _train(tiered, steps=3)
    shardvar.save({"model": tiered, "opt": opt}, tmp_path / "ckpt")
    _train(tiered, steps=3, seed=7)  # the table now differs from the checkpoint; its cache is warm and dirty
    tiered.tier.flush()  # (a load writes the changed rows back first: done here, so the stats can be compared)
    stats, keys = tiered.cache_stats(), tiered.tier.cache.key.clone()
    before = tiered.tier.peek(torch.arange(ROWS))
    peeked = tiered.cache_stats()["bytes_read"] - stats["bytes_read"]  # peek reads the rows the cache does not hold
    _flip(tmp_path / "ckpt", where)
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        shardvar.load({"model": tiered, "opt": opt}, tmp_path / "ckpt", staging_bytes=staging_bytes)
    assert tiered.cache_stats() == {**stats, "bytes_read": stats["bytes_read"] + peeked}
    assert torch.equal(tiered.tier.cache.key, keys)
    after = tiered.tier.peek(torch.arange(ROWS))
    assert torch.equal(after[0], before[0]) and torch.equal(after[1], before[1])
    places = tiered.tier.cache.places_of(torch.arange(ROWS))  # the file itself, where each row is
    values, state = tiered.tier.layout.split(tiered.tier.file.read(places))
    assert torch.equal(values, before[0]) and torch.equal(state, before[1])
    _train(tiered, steps=2, seed=8)  # still usable, and saves
    shardvar.save({"model": tiered, "opt": opt}, tmp_path / "ckpt2")


@pytest.mark.parametrize("partitions", [(), (3, "mod"), (4, "div")])
@pytest.mark.parametrize("window_rows", [1, 7, 64])
def test_a_load_into_a_tiered_table_stages_one_bounded_window_at_a_time(tmp_path, monkeypatch, window_rows, partitions):
    from shardvar.checkpoint import _window

    torch.manual_seed(0)
    ref = shardvar.ShardedEmbeddingBag(ROWS, DIM, 2, "mod", mode="sum", sparse=True)
    ref_opt = _fused(ref)
    _train(ref)
    shardvar.save({"model": ref, "opt": ref_opt}, tmp_path / "ckpt")
    monkeypatch.setattr(_window, "WINDOW_BYTES", window_rows * DIM * 4)
    staged: list[int] = []  # bytes of every piece a load reads before it is copied into the file
    restore_into = _window.restore_into

    def counted(files, entry, target, outs, verify):
        staged.extend(o.nbytes for o in outs.values() if o is not None)
        return restore_into(files, entry, target, outs, verify)

    monkeypatch.setattr(_window, "restore_into", counted)
    tiered = _tiered(tmp_path, seed=5, partitions=partitions)  # its shards: strided views of the file
    opt = _fused(tiered)
    reported: list[tuple[int, int]] = []
    shardvar.load(
        {"model": tiered, "opt": opt}, tmp_path / "ckpt", staging_bytes=0, progress=lambda *a: reported.append(a)
    )
    values, state = tiered.tier.peek(torch.arange(ROWS))
    assert torch.equal(values, ref.weight.to_tensor())
    assert torch.equal(state[:, 0], ref_opt.sharded_variables()["weight/sum"].join())
    assert len(reported) >= len(staged) and reported[-1][0] == reported[-1][1]  # window by window
    assert all(a[0] <= b[0] for a, b in itertools.pairwise(reported))
    assert len(staged) >= -(-ROWS // window_rows) and max(staged) <= window_rows * DIM * 4


@pytest.mark.parametrize("chunk_rows", [7, 50, 64])
def test_progress_reaches_the_tiered_initialisation_widening_and_streamed_save(tmp_path, monkeypatch, chunk_rows):
    from shardvar.tiered import _storage

    monkeypatch.setattr(_storage, "CHUNK_ROWS", chunk_rows)
    monkeypatch.setattr(_views, "STREAM_ROWS", chunk_rows)
    calls: list[tuple[int, int]] = []
    storage = shardvar.Tiered(tmp_path / "t.rows", cache_bytes=10 * (DIM * 4 + 4), progress=lambda *a: calls.append(a))
    tiered = shardvar.ShardedEmbeddingBag(ROWS, DIM, mode="sum", sparse=True, storage=storage)
    chunks = -(-ROWS // chunk_rows)
    expected = [(min(ROWS, (k + 1) * chunk_rows), ROWS) for k in range(chunks)]
    assert calls == expected  # the file filled chunk by chunk
    opt = _fused(tiered)
    assert calls == expected * 2  # and rewritten once, wider, for the optimizer's state
    saved: list[tuple[int, int]] = []
    shardvar.save({"model": tiered, "opt": opt}, tmp_path / "ckpt", progress=lambda d, t: saved.append((d, t)))
    assert len(saved) >= 2 * chunks and saved[-1][0] == saved[-1][1]  # rows and state, piece by piece
    assert all(a[0] <= b[0] for a, b in itertools.pairwise(saved))


def test_a_progress_that_is_not_callable_is_refused(tmp_path):
    from shardvar import ShardvarTypeError

    with pytest.raises(ShardvarTypeError, match="progress must be a callable"):
        shardvar.Tiered(tmp_path / "t.rows", cache_bytes=100, progress=3)
