"""Checkpoints under real concurrency and real full disks: savers racing, loads overlapping saves.

Real processes and real files throughout; the full disk is a small tmpfs where this machine lets
us mount one (root in the sandbox), else a file-size limit in a child process.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

import shardvar
from shardvar import CheckpointIOError, Layout

SAVER = textwrap.dedent(
    """
    import sys, time, torch, shardvar
    from shardvar import Layout
    path, me, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    end, n = time.monotonic() + seconds, 0
    while time.monotonic() < end:
        value = float(me * 1000 + n)
        try:
            shardvar.save({"t": shardvar.shard_tensor(torch.full((512, 64), value), Layout.mod(512, 4)),
                           "s": torch.tensor(value)}, path)
            n += 1
        except shardvar.CheckpointIOError:
            pass  # the lock was held too long: a clear error for the loser, nothing written
    print(n, flush=True)
    """
)

LOADER = textwrap.dedent(
    """
    import sys, time, torch, shardvar
    from shardvar import Layout
    path, seconds = sys.argv[1], float(sys.argv[2])
    end, loads, mixed = time.monotonic() + seconds, 0, 0
    while time.monotonic() < end:
        t, s = shardvar.shard_tensor(torch.zeros(512, 64), Layout.div(512, 3)), torch.tensor(0.0)
        try:
            shardvar.load({"t": t, "s": s}, path)
        except shardvar.CheckpointError as e:
            print("error", type(e).__name__, str(e)[:100], flush=True)
            continue
        values = set(t.to_tensor().unique().tolist()) | {float(s)}
        loads += 1
        mixed += len(values) != 1
    print("done", loads, mixed, flush=True)
    """
)


def _load_values(path: Path) -> set[float]:
    t, s = shardvar.shard_tensor(torch.zeros(512, 64), Layout.div(512, 3)), torch.tensor(0.0)
    shardvar.load({"t": t, "s": s}, path)
    return {*t.to_tensor().unique().tolist(), float(s)}


def test_concurrent_savers_and_loaders_see_one_complete_version(tmp_path) -> None:
    path = tmp_path / "ckpt"
    shardvar.save({"t": shardvar.shard_tensor(torch.zeros(512, 64), Layout.mod(512, 4)), "s": torch.tensor(0.0)}, path)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    savers = [
        subprocess.Popen(
            [sys.executable, "-c", SAVER, str(path), str(me), "4"], stdout=subprocess.PIPE, text=True, env=env
        )
        for me in (1, 2)
    ]
    loader = subprocess.Popen(
        [sys.executable, "-c", LOADER, str(path), "4"], stdout=subprocess.PIPE, text=True, env=env
    )
    counts = [int(p.communicate(timeout=120)[0].split()[-1]) for p in savers]
    report = loader.communicate(timeout=120)[0].split("\n")
    done = next(line for line in report if line.startswith("done")).split()
    assert sum(counts) >= 2, counts  # both savers made progress
    assert int(done[1]) >= 1 and int(done[2]) == 0, report  # no load ever returned a mix of versions
    assert not [line for line in report if line.startswith("error") and "IOError" not in line], report
    assert len(_load_values(path)) == 1  # the last save to commit is complete and loadable


def test_a_save_waits_for_a_load_and_the_loser_gets_a_clear_error(tmp_path, monkeypatch) -> None:
    from shardvar.checkpoint import _files

    path = tmp_path / "ckpt"
    shardvar.save({"x": torch.ones(4)}, path)
    with _files.DirectoryLock(path, exclusive=True):  # another process saving, as far as flock goes
        monkeypatch.setattr(_files.DirectoryLock, "__init__", _short_timeout(_files.DirectoryLock.__init__))
        with pytest.raises(CheckpointIOError, match="another process has been saving or loading it"):
            shardvar.save({"x": torch.zeros(4)}, path)
        with pytest.raises(CheckpointIOError, match="cannot load from"):
            shardvar.load({"x": torch.zeros(4)}, path)
    x = torch.zeros(4)
    shardvar.load({"x": x}, path)
    assert x.tolist() == [1.0] * 4


def _short_timeout(init):
    def patched(self, directory, exclusive, timeout=60.0):
        init(self, directory, exclusive, timeout=0.3)

    return patched


@contextlib.contextmanager
def small_disk(tmp_path: Path, size: str = "3m"):
    mount = tmp_path / "disk"
    mount.mkdir()
    out = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)], capture_output=True)
    if out.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here ({out.stderr.decode().strip()[:80]}); the RLIMIT test covers it")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)


def test_a_full_disk_leaves_the_previous_checkpoint_and_room_for_the_next(tmp_path) -> None:
    with small_disk(tmp_path) as disk:
        path = disk / "ckpt"
        shardvar.save({"x": torch.ones(200_000)}, path)  # 0.8 MB
        before = sorted(p.name for p in path.iterdir())
        with pytest.raises(CheckpointIOError, match="previous checkpoint is intact"):
            shardvar.save({"x": torch.ones(200_000), "big": torch.zeros(1_000_000)}, path)  # 4.8 MB: does not fit
        assert sorted(p.name for p in path.iterdir()) == before  # everything the failed save wrote is gone
        x = torch.zeros(200_000)
        shardvar.load({"x": x}, path)
        assert bool((x == 1).all())
        shardvar.save({"x": torch.full((200_000,), 2.0)}, path)  # a save that fits succeeds
        shardvar.load({"x": x}, path)
        assert bool((x == 2).all())


def test_a_file_size_limit_fails_the_save_cleanly(tmp_path) -> None:
    script = textwrap.dedent(
        """
        import resource, signal, sys, torch, shardvar
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        path = sys.argv[1]
        shardvar.save({"x": torch.ones(1000)}, path)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 16, 1 << 16))
        try:
            shardvar.save({"x": torch.ones(1000), "big": torch.zeros(100_000)}, path)
        except shardvar.CheckpointIOError as e:
            print("refused", e)
        """
    )
    out = subprocess.run([sys.executable, "-c", script, str(tmp_path / "c")], capture_output=True, text=True)
    assert "refused" in out.stdout and "intact" in out.stdout, out.stderr
    assert len(list((tmp_path / "c").glob("data-*"))) == 1  # only the committed save's file
    x = torch.zeros(1000)
    shardvar.load({"x": x}, tmp_path / "c")
    assert bool((x == 1).all())


def test_the_failed_rank_of_a_distributed_save_does_not_leave_the_others_waiting(tmp_path) -> None:
    from distributed import run_ranks

    start = time.monotonic()
    results = run_ranks(2, "dist_module_workers:save_with_a_bad_dtype", tmp_path, path=str(tmp_path / "d"))
    assert time.monotonic() - start < 40
    assert "complex128" in results[1]["error"] and "rank 1 failed" in results[0]["error"], results
    assert not (tmp_path / "d" / "manifest.json").exists()
