"""A save or a TensorFlow conversion killed mid-write (SIGKILL, no clean-up ran) leaves a partial data file;
the next write into the same directory reclaims it: nothing stale stays behind, and the result is right."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import shardvar
from shardvar.checkpoint import Manifest
from tf_bundle import write_bundle

TABLE = np.arange(600 * 8, dtype=np.float32).reshape(600, 8) / 7

# The child writes with a progress callback that, after the first piece reached the data file,
# tells the parent and then hangs: the parent kills it there.
CHILD = """
import sys, time
from pathlib import Path
import torch, shardvar, shardvar.tf
kind, src, out, marker = sys.argv[1:]

def progress(done, total):
    if 0 < done < total:
        Path(marker).write_text(str(done))
        time.sleep(600)

if kind == "save":
    table = torch.from_numpy(__import__("numpy").load(src))
    v = shardvar.shard_tensor(table, shardvar.Layout.balanced("div", table.shape[0], 3))
    shardvar.save({"v": v}, out, progress=progress)
else:
    shardvar.tf.convert(src, out, {"t": "v"}, partitioner=3, partition_strategy=kind, progress=progress)
"""


def _write(kind: str, src: Path, out: Path) -> None:
    if kind == "save":
        table = torch.from_numpy(np.load(src))
        shardvar.save({"v": shardvar.shard_tensor(table, shardvar.Layout.balanced("div", len(table), 3))}, out)
    else:
        shardvar.tf.convert(src, out, {"t": "v"}, partitioner=3, partition_strategy=kind)


def _kill_mid_write(kind: str, src: Path, out: Path, tmp_path: Path) -> list[str]:
    marker = tmp_path / "written"
    child = subprocess.Popen([sys.executable, "-c", CHILD, kind, str(src), str(out), str(marker)])
    try:
        deadline = time.monotonic() + 120
        while not marker.exists():
            assert child.poll() is None, f"the writer exited ({child.returncode}) before it wrote anything"
            assert time.monotonic() < deadline, "the writer wrote nothing in 120 s"
            time.sleep(0.05)
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
    return sorted(os.listdir(out))


@pytest.mark.parametrize("kind", ["div", "mod", "save"])
def test_a_killed_write_leaves_nothing_stale_after_the_next(tmp_path: Path, kind: str) -> None:
    if kind == "save":
        src = tmp_path / "table.npy"
        np.save(src, TABLE)
    else:
        src = tmp_path / "ck"
        write_bundle(src, {"t": TABLE}, {"t": [250, 350]})
    out = tmp_path / "out"
    left = _kill_mid_write(kind, src, out, tmp_path)
    assert len(left) == 1 and left[0].startswith("data-"), left  # a partial data file, no manifest
    inode = (out / left[0]).stat().st_ino
    _write(kind, src, out)
    manifest = Manifest.read(out)
    assert sorted(os.listdir(out)) == sorted({"manifest.json", *manifest.files()})  # no spare, no orphan
    assert [(out / f).stat().st_ino for f in manifest.files()] == [inode]  # its space reused, not a new file
    assert torch.equal(shardvar.checkpoint.read_shard(out, "v"), torch.from_numpy(TABLE))
