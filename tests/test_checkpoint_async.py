"""Asynchronous saves: a snapshot now, the files in the background, the old checkpoint safe meanwhile."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

import shardvar
from shardvar import ShardedEmbedding


class Gate:
    """A progress callback that holds the background writer at its first block until opened."""

    def __init__(self) -> None:
        self.reached, self.opened = threading.Event(), threading.Event()

    def __call__(self, done: int, total: int) -> None:
        self.reached.set()
        assert self.opened.wait(60), "the test never opened the gate"


def data_files(path: Path) -> set[str]:
    return {p.name for p in Path(path).iterdir() if p.name.startswith(("data-", "manifest.json."))}


def model(rows: int = 1000, shards: int = 4, strategy: str = "mod") -> tuple[ShardedEmbedding, torch.optim.Optimizer]:
    torch.manual_seed(0)
    emb = ShardedEmbedding(rows, 8, shards, strategy)
    return emb, torch.optim.Adam(emb.parameters(), lr=0.1)


def train(emb: ShardedEmbedding, opt: torch.optim.Optimizer, steps: int) -> None:
    for _ in range(steps):
        emb(torch.randint(0, emb.num_embeddings, (64,))).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()


def test_training_goes_on_while_the_writer_is_blocked_and_the_snapshot_is_saved(tmp_path) -> None:
    emb, opt = model()
    train(emb, opt, 2)
    snapshot = emb.weight.to_tensor().clone()
    moments = [s["exp_avg"].clone() for s in opt.state.values()]
    gate = Gate()
    handle = shardvar.save({"m": emb, "o": opt}, tmp_path / "c", asynchronous=True, progress=gate)
    assert isinstance(handle, shardvar.AsyncSave)
    assert gate.reached.wait(60)
    train(emb, opt, 5)  # the writer is stuck at its first block: these steps change every tensor it saves
    assert not handle.done() and "writing" in repr(handle)
    assert not torch.equal(emb.weight.to_tensor(), snapshot)
    gate.opened.set()
    handle.wait(60)
    assert handle.done() and "committed" in repr(handle)
    other, other_opt = model(shards=3, strategy="div")
    train(other, other_opt, 1)  # creates optimizer state to be replaced
    shardvar.load({"m": other, "o": other_opt}, tmp_path / "c")
    assert torch.equal(other.weight.to_tensor(), snapshot)
    got = shardvar.read_shard(tmp_path / "c", "o/m/weight/exp_avg")
    want = shardvar.ShardedVariable(moments, partition_strategy="mod").to_tensor()
    assert torch.equal(got, want)


def test_a_failing_background_write_raises_from_wait_and_keeps_the_previous_checkpoint(tmp_path) -> None:
    emb, opt = model()
    shardvar.save({"m": emb}, tmp_path / "c")
    before = emb.weight.to_tensor().clone()
    train(emb, opt, 1)

    def explode(done: int, total: int) -> None:
        raise OSError(28, "No space left on device")

    handle = shardvar.save({"m": emb}, tmp_path / "c", asynchronous=True, progress=explode)
    with pytest.raises(shardvar.CheckpointIOError, match="No space left on device"):
        handle.wait(60)
    assert "failed" in repr(handle)
    assert torch.equal(shardvar.read_shard(tmp_path / "c", "m/weight"), before)
    assert data_files(tmp_path / "c") == shardvar.checkpoint.Manifest.read(tmp_path / "c").files()


def test_saves_run_one_at_a_time_and_both_commit(tmp_path) -> None:
    emb, opt = model()
    gate = Gate()
    first = shardvar.save({"m": emb}, tmp_path / "a", asynchronous=True, progress=gate)
    assert gate.reached.wait(60)
    values = emb.weight.to_tensor().clone()
    train(emb, opt, 1)
    threading.Timer(0.5, gate.opened.set).start()
    second = shardvar.save({"m": emb}, tmp_path / "b", asynchronous=True)  # waits for the first
    assert first.done()
    second.wait(60)
    assert torch.equal(shardvar.read_shard(tmp_path / "a", "m/weight"), values)
    assert torch.equal(shardvar.read_shard(tmp_path / "b", "m/weight"), emb.weight.to_tensor())


def test_wait_with_a_timeout_raises_timeout_error(tmp_path) -> None:
    emb, _ = model()
    gate = Gate()
    handle = shardvar.save({"m": emb}, tmp_path / "c", asynchronous=True, progress=gate)
    with pytest.raises(TimeoutError, match=r"still writing after 0\.1 s"):
        handle.wait(0.1)
    gate.opened.set()
    handle.wait(60)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"asynchronous": "yes"}, TypeError, "asynchronous"),
        ({"asynchronous": True, "staging_bytes": -1}, ValueError, "staging_bytes"),
        ({"asynchronous": True, "staging_bytes": 100}, shardvar.CheckpointError, "staging_bytes=100"),
    ],
)
def test_bad_arguments_are_refused_before_anything_is_written(tmp_path, kwargs, error, match) -> None:
    emb, _ = model()
    with pytest.raises(error, match=match):
        shardvar.save({"m": emb}, tmp_path / "c", **kwargs)
    assert not (tmp_path / "c" / "manifest.json").exists()


CRASH = textwrap.dedent(
    """
    import sys, time, torch, shardvar
    path, flag = sys.argv[1], sys.argv[2]
    v = shardvar.ShardedVariable([torch.full((500, 64), 1.0) for _ in range(4)])
    shardvar.save({"v": v}, path)
    def hang(done, total):
        open(flag, "w").close()
        time.sleep(600)
    handle = shardvar.save({"v": v}, path, asynchronous=True, progress=hang)
    with torch.no_grad():
        v.variables[0].fill_(2.0)  # training goes on
    handle.wait()
    """
)


def test_a_process_killed_during_the_background_write_leaves_the_previous_checkpoint(tmp_path) -> None:
    script, flag, path = tmp_path / "crash.py", tmp_path / "writing", tmp_path / "c"
    script.write_text(CRASH)
    proc = subprocess.Popen([sys.executable, str(script), str(path), str(flag)])
    deadline = time.monotonic() + 120
    while not flag.exists():
        assert proc.poll() is None and time.monotonic() < deadline, "the background write never started"
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(30)
    assert torch.equal(shardvar.read_shard(path, "v"), torch.ones(2000, 64))
    v = shardvar.ShardedVariable([torch.zeros(1000, 64) for _ in range(2)], partition_strategy="mod")
    shardvar.save({"v": v}, path)  # and the directory takes new saves
    assert torch.equal(shardvar.read_shard(path, "v"), torch.zeros(2000, 64))
    assert data_files(path) == shardvar.checkpoint.Manifest.read(path).files()  # the killed save's files went


def test_wait_refuses_a_negative_timeout(tmp_path) -> None:
    emb, _ = model()
    handle = shardvar.save({"m": emb}, tmp_path / "c", asynchronous=True)
    with pytest.raises(ValueError, match="timeout"):
        handle.wait(-1)
    handle.wait(60)
