"""Serving reads: rows looked up straight from a checkpoint's files, verified, without loading the table."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch

import shardvar
from shardvar import Layout, shard_tensor
from shardvar.checkpoint import Manifest


def table(rows: int = 1000, dim: int = 6, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.arange(rows * dim, dtype=torch.float64).reshape(rows, dim).to(dtype)


@pytest.mark.parametrize("layout", [Layout.balanced("div", 1000, 4), Layout.balanced("mod", 1000, 3), None])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_lookups_equal_the_loaded_rows_for_any_layout_dtype_and_id_shape(tmp_path, layout, dtype) -> None:
    t = table(dtype=dtype)
    shardvar.save({"t": shard_tensor(t, layout) if layout else t}, tmp_path)
    ids = torch.tensor([[999, 0, 5], [5, 5, 17]])
    with shardvar.open(tmp_path) as served:
        assert torch.equal(served["t"].read(), t)
        got = served["t"].lookup(ids)
        assert got.dtype == dtype and got.shape == (2, 3, 6)
        assert torch.equal(got, t[ids])
        assert torch.equal(served["t"].lookup(torch.tensor(7)), t[7])
        assert served.names() == ["t"] and "t" in served and served["t"].shape == t.shape


def test_bad_ids_and_names_are_refused_with_clear_errors(tmp_path) -> None:
    shardvar.save({"t": shard_tensor(table(), Layout.balanced("div", 1000, 2))}, tmp_path)
    with shardvar.open(tmp_path) as served:
        with pytest.raises(IndexError, match="1000"):
            served["t"].lookup(torch.tensor([1000]))
        with pytest.raises(IndexError):
            served["t"].lookup(torch.tensor([-1]))
        with pytest.raises(TypeError):
            served["t"].lookup(torch.tensor([1.5]))
        with pytest.raises(shardvar.CheckpointError, match="'nope' is not in the checkpoint"):
            served["nope"]


def test_a_damaged_chunk_is_refused_when_read_and_other_chunks_still_serve(tmp_path) -> None:
    t = torch.randn(40_000, 64)  # several checksum chunks per piece
    shardvar.save({"t": shard_tensor(t, Layout.balanced("div", 40_000, 1))}, tmp_path)
    piece = Manifest.read(tmp_path).variables["t"].pieces[0]
    assert len(piece.sums) > 1
    last = piece.begin + (piece.shape[0] - 1) * 64 * 4  # the last row
    with open(tmp_path / piece.file, "r+b") as f:
        f.seek(last)
        f.write(b"\xff\xff\xff\xff")
    with shardvar.open(tmp_path) as served:
        assert torch.equal(served["t"].lookup(torch.tensor([0, 1])), t[:2])
        with pytest.raises(shardvar.CheckpointError, match=r"checksum mismatch in .*variable 't'"):
            served["t"].lookup(torch.tensor([39_999]))


def test_a_reader_follows_a_save_that_replaces_the_checkpoint(tmp_path) -> None:
    shardvar.save({"t": shard_tensor(table(), Layout.balanced("mod", 1000, 2))}, tmp_path)
    with shardvar.open(tmp_path) as served:
        first = served["t"].lookup(torch.tensor([3]))
        shardvar.save({"t": shard_tensor(-table(), Layout.balanced("div", 1000, 3))}, tmp_path)
        assert torch.equal(served["t"].lookup(torch.tensor([3])), -first)


def test_a_delta_chain_is_served_with_its_newest_rows(tmp_path) -> None:
    t = table()
    shardvar.save({"t": shard_tensor(t, Layout.balanced("div", 1000, 4))}, tmp_path / "base")
    previous = tmp_path / "base"
    for k in range(3):
        t = t.clone()
        t[k * 10 : k * 10 + 15] += 1000 * (k + 1)  # overlapping changes: the newest wins
        v = shard_tensor(t, Layout.balanced("mod", 1000, 3))
        shardvar.save({"t": v}, tmp_path / f"d{k}", delta_of=previous)
        previous = tmp_path / f"d{k}"
    with shardvar.open(previous) as served:
        ids = torch.arange(1000).flip(0)
        assert torch.equal(served["t"].lookup(ids), t[ids])
        assert torch.equal(served["t"].read(), t)


SERVE = textwrap.dedent(
    """
    import json, sys, torch, shardvar
    def rss():  # private memory: mapped file pages are the page cache, shared by every server
        return int(next(l for l in open("/proc/self/status") if l.startswith("RssAnon")).split()[1]) * 1024
    torch.manual_seed(int(sys.argv[2]))
    served = shardvar.open(sys.argv[1])["t"]
    before = rss()
    ids = torch.randint(0, served.shape[0], (2000,))  # rows all over a 128 MiB table
    rows = served.lookup(ids)
    print(json.dumps({"grew": rss() - before, "sum": float(rows.double().sum()), "ids": ids.tolist()}))
    """
)


def test_many_processes_serve_at_once_and_memory_grows_with_rows_read_not_table_size(tmp_path) -> None:
    rows, dim = 1 << 18, 128  # a 128 MiB table
    t = torch.randn(rows, dim)
    shardvar.save({"t": shard_tensor(t, Layout.balanced("div", rows, 4))}, tmp_path / "c")
    del t
    script = tmp_path / "serve.py"
    script.write_text(SERVE)
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(tmp_path / "c"), str(seed)], stdout=subprocess.PIPE, text=True
        )
        for seed in (1, 2)
    ]
    results = [json.loads(p.communicate(timeout=120)[0]) for p in procs]
    assert all(p.returncode == 0 for p in procs)
    full = shardvar.read_shard(tmp_path / "c", "t")
    for r in results:
        assert r["grew"] < 24 << 20, r["grew"]  # the rows read, not the table (every chunk is verified)
        assert r["sum"] == pytest.approx(float(full[torch.tensor(r["ids"])].double().sum()), rel=1e-9)


def test_a_closed_reader_and_paths_that_are_not_checkpoints_raise_clear_errors(tmp_path) -> None:
    shardvar.save({"t": shard_tensor(table(), Layout.balanced("div", 1000, 2))}, tmp_path / "c")
    with shardvar.open(tmp_path / "c" / "manifest.json") as served:  # the manifest's path names its directory
        table_ = served["t"]
    with pytest.raises(shardvar.CheckpointError, match="is closed"):
        table_.lookup(torch.tensor([1]))
    with pytest.raises(shardvar.CheckpointError, match="is closed"):
        served["t"]
    (tmp_path / "file").write_text("x")
    with pytest.raises(shardvar.CheckpointError, match="is not a checkpoint directory"):
        shardvar.open(tmp_path / "file")
    with pytest.raises(shardvar.CheckpointError, match=r"manifest\.json is missing"):
        shardvar.open(tmp_path / "missing")
