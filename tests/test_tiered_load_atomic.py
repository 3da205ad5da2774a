"""A load into a tiered table is all or nothing, whatever fails while it writes.

The rows go into a new file beside the backing file, renamed over it only once every window is
written and synced. Each case makes a real ``OSError`` happen at one point of the load (a window
of the checkpoint that cannot be read, the copy of the current rows, the reservation of the new
file, the sync before the rename) and checks that the backing file's bytes, the cache (ids, rows,
state, stats) and the lookups are exactly as before, no new file is left, and the table still
trains, saves, and loads.
"""

from __future__ import annotations

import errno
import functools
import gc
import os
import shutil
import subprocess

import pytest
import torch

import shardvar
from helpers import TIERED_DIM, TIERED_ROWS, tiered_bag, train_bags
from shardvar import optim
from shardvar.tiered import BackingFileError, _shadow

ROWS, DIM = TIERED_ROWS, TIERED_DIM


_tiered = functools.partial(tiered_bag, seed=5)
_train = functools.partial(train_bags, steps=3, seed=2)


def _snapshot(tiered):
    """The backing file's bytes and the cache's ids, rows, state and stats (reads nothing through the cache)."""
    tier = tiered.tier
    cache = tier.cache
    return {
        "file": tier.file.path.read_bytes(),
        "keys": cache.key.clone(),
        "values": cache.values.clone(),
        "state": cache.state.clone(),
        "stats": tier.cache_stats(),
    }


def _same(after, before):
    assert after["file"] == before["file"]
    for key in ("keys", "values", "state"):
        assert torch.equal(after[key], before[key]), key
    assert after["stats"] == before["stats"]


def _lookups(tiered):
    """Every row looked up, a bag of 5 at a time (within the cache)."""
    with torch.no_grad():
        return torch.cat([tiered(torch.arange(a, a + 5), torch.tensor([0])) for a in range(0, ROWS, 5)])


def _failing_after(monkeypatch, module, name, calls, error):
    """``module.name`` raising ``error`` from its ``calls``-th call on (the calls before it run as they would)."""
    real, seen = getattr(module, name), [0]

    def fail(*args, **kwargs):
        seen[0] += 1
        if seen[0] >= calls:
            raise error
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, fail)
    return seen


def _inject(where, monkeypatch):
    from shardvar.checkpoint import _window

    if where == "third window":  # the checkpoint's disk fails after two windows went into the table
        monkeypatch.setattr(_window, "WINDOW_BYTES", 7 * DIM * 4)
        return _failing_after(monkeypatch, _window, "restore_into", 3, OSError(errno.EIO, "Input/output error"))
    if where == "copy":  # the copy of the current rows runs out of room half way
        monkeypatch.setattr(_shadow, "COPY_BYTES", 1000)
        return _failing_after(monkeypatch, os, "copy_file_range", 2, OSError(errno.ENOSPC, "No space left on device"))
    if where == "reserve":
        return _failing_after(monkeypatch, os, "posix_fallocate", 1, OSError(errno.ENOSPC, "No space left on device"))
    assert where == "sync"  # every window written; the disk fails the sync before the rename
    return _failing_after(monkeypatch, os, "fsync", 1, OSError(errno.EIO, "Input/output error"))


@pytest.mark.parametrize("partitions", [(), (3, "mod")])
@pytest.mark.parametrize("where", ["third window", "copy", "reserve", "sync"])
def test_a_load_failing_part_way_leaves_the_tiered_table_exactly_as_it_was(tmp_path, monkeypatch, where, partitions):
    torch.manual_seed(0)
    ref = shardvar.ShardedEmbeddingBag(ROWS, DIM, 2, "mod", mode="sum", sparse=True)
    ref_opt = optim.RowWiseAdagrad(ref, lr=0.1)
    optim.fuse(ref_opt)
    _train(ref, steps=8)
    shardvar.save({"model": ref, "opt": ref_opt}, tmp_path / "ckpt")
    (tmp_path / "rows").mkdir()
    tiered = _tiered(tmp_path / "rows", partitions=partitions)
    opt = optim.RowWiseAdagrad(tiered, lr=0.1)
    optim.fuse(opt)
    _train(tiered, seed=7)  # other rows than the checkpoint's; a warm cache
    tiered.tier.flush()  # (a load writes changed rows back first: done here, so the file's bytes can be compared)
    looked = _lookups(tiered)
    before = _snapshot(tiered)
    gc.collect()  # earlier tests' tables left in garbage cycles close now, not inside the injected failure
    with monkeypatch.context() as patched:
        calls = _inject(where, patched)
        with pytest.raises(OSError, match=r"Input/output error|No space left"):
            shardvar.load({"model": tiered, "opt": opt}, tmp_path / "ckpt", staging_bytes=0)
    assert calls[0] >= (3 if where == "third window" else 1)  # the failure was reached
    _same(_snapshot(tiered), before)
    assert torch.equal(_lookups(tiered), looked)
    assert sorted(p.name for p in (tmp_path / "rows").iterdir()) == ["t.rows"]  # no new file left behind
    _train(tiered, seed=8)  # still trains, saves, and loads
    shardvar.save({"model": tiered, "opt": opt}, tmp_path / "after")
    shardvar.load({"model": tiered, "opt": opt}, tmp_path / "ckpt")
    values, state = tiered.tier.peek(torch.arange(ROWS))
    assert torch.equal(values, ref.weight.to_tensor())
    assert torch.equal(state[:, 0], ref_opt.sharded_variables()["weight/sum"].join())
    assert sorted(p.name for p in (tmp_path / "rows").iterdir()) == ["t.rows"]


def test_a_load_keeps_the_rows_and_state_the_checkpoint_does_not_hold(tmp_path):
    """Loading only the rows keeps the optimizer's state in the records (the new file starts as a copy)."""
    torch.manual_seed(0)
    ref = shardvar.ShardedEmbeddingBag(ROWS, DIM, mode="sum", sparse=True)
    shardvar.save({"model": ref}, tmp_path / "ckpt")
    tiered = _tiered(tmp_path)
    optim.fuse(optim.RowWiseAdagrad(tiered, lr=0.1))
    _train(tiered)
    state = tiered.tier.peek(torch.arange(ROWS))[1]
    shardvar.load({"model": tiered}, tmp_path / "ckpt")
    values, after = tiered.tier.peek(torch.arange(ROWS))
    assert torch.equal(values, ref.weight.to_tensor()) and torch.equal(after, state)


def _mount_tmpfs(folder, size):
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("a tiny tmpfs needs root and mount")
    run = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)], capture_output=True)
    if run.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {run.stderr.decode().strip()}")


def test_a_disk_too_full_for_the_new_file_refuses_the_load_and_changes_nothing(tmp_path):
    """A real ENOSPC: the backing file fits its small filesystem once, not twice."""
    torch.manual_seed(0)
    ref = shardvar.ShardedEmbeddingBag(ROWS, DIM, mode="sum", sparse=True)
    shardvar.save({"model": ref}, tmp_path / "ckpt")
    disk = tmp_path / "disk"
    disk.mkdir()
    _mount_tmpfs(disk, "12k")  # 3 pages: the file (4 KiB header + 800 bytes of rows) takes 2
    tiered = None
    try:
        tiered = _tiered(disk)
        looked = _lookups(tiered)
        before = _snapshot(tiered)
        with pytest.raises(
            BackingFileError,
            match=r"needs room for a second copy: cannot reserve \d+ bytes .*t\.rows\.loading.*No space left",
        ):
            shardvar.load({"model": tiered}, tmp_path / "ckpt")
        _same(_snapshot(tiered), before)
        assert torch.equal(_lookups(tiered), looked)
        assert sorted(p.name for p in disk.iterdir()) == ["t.rows"]
        subprocess.run(["mount", "-o", "remount,size=64k", str(disk)], check=True)  # room made: it loads
        shardvar.load({"model": tiered}, tmp_path / "ckpt")
        assert torch.equal(tiered.tier.peek(torch.arange(ROWS))[0], ref.weight.to_tensor())
    finally:
        if tiered is not None:
            tiered.close()
        subprocess.run(["umount", "--lazy", str(disk)], check=False)
