"""The command line, run as a user runs it."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from shardvar.cli import main


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shardvar", *args], capture_output=True, text=True)


def test_plan_default_table() -> None:
    out = run("plan")
    assert out.returncode == 0, out.stderr
    assert "FixedShards(4)" in out.stdout and "1000000x64" in out.stdout
    assert "div: 3,3,2,2" in out.stdout  # 10 rows over 4 shards: the first two get the extra row


def test_plan_with_options(capsys) -> None:
    assert main(["plan", "--shape", "10,3", "--partitioner", "fixed:4", "--strategy", "mod", "--dtype", "int8"]) == 0
    out = capsys.readouterr().out
    assert "mod: 3,3,2,2" in out and "int8" in out


def test_plan_bad_arguments_exit_with_a_message() -> None:
    out = run("plan", "--partitioner", "fixed:0")
    assert out.returncode == 2 and "`num_shards` must be positive; got 0" in out.stderr
    out = run("plan", "--shape", "10,x")
    assert out.returncode == 2 and "bad shape '10,x'" in out.stderr
    with pytest.raises(SystemExit, match="axis 5 is out of range"):
        main(["plan", "--shape", "10,3", "--axis", "5"])


def test_inspect_and_reshard(tmp_path) -> None:
    import torch

    import shardvar

    shardvar.save(
        {"emb": shardvar.shard_tensor(torch.randn(100, 4), shardvar.Layout.mod(100, 4)), "step": torch.tensor(3)},
        tmp_path / "a",
    )
    out = run("inspect", str(tmp_path / "a"))
    assert out.returncode == 0, out.stderr
    assert "emb" in out.stdout and "mod: 25,25,25,25 @axis0" in out.stdout and "whole (0-d)" in out.stdout
    out = run("reshard", str(tmp_path / "a"), str(tmp_path / "b"), "--shards", "3", "--strategy", "div")
    assert out.returncode == 0 and out.stderr == "", out.stderr  # no progress bar off a terminal
    assert "div: 34,33,33 @axis0" in run("inspect", str(tmp_path / "b")).stdout
    out = run("inspect", str(tmp_path / "missing"))
    assert out.returncode == 1 and "manifest.json is missing" in out.stderr
    out = run("reshard", str(tmp_path / "a"), str(tmp_path / "c"), "--shards", "0")
    assert out.returncode == 2 and "expected a positive integer; got 0" in out.stderr


def test_inspect_shows_a_delta_chain_and_compact_folds_it(tmp_path, capsys) -> None:
    import torch

    import shardvar

    t = torch.randn(100, 4)
    shardvar.save({"emb": shardvar.shard_tensor(t, shardvar.Layout.mod(100, 4))}, tmp_path / "base")
    t[[3, 50]] += 1
    shardvar.save(
        {"emb": shardvar.shard_tensor(t, shardvar.Layout.mod(100, 4))}, tmp_path / "d1", delta_of=tmp_path / "base"
    )
    assert main(["inspect", str(tmp_path / "d1")]) == 0
    out = capsys.readouterr().out
    assert "chain (oldest first" in out and "emb: 2 rows" in out and str(tmp_path / "base") in out
    assert main(["compact", str(tmp_path / "d1"), str(tmp_path / "one")]) == 0
    capsys.readouterr()
    assert torch.equal(shardvar.read_shard(tmp_path / "one", "emb"), t)
    assert main(["inspect", str(tmp_path / "one")]) == 0
    assert "chain (oldest first" not in capsys.readouterr().out
    with pytest.raises(SystemExit, match="already holds a checkpoint"):
        main(["compact", str(tmp_path / "d1"), str(tmp_path / "one")])
    shardvar.save({"emb": torch.zeros(100, 4)}, tmp_path / "base")  # the base is replaced: the link breaks
    with pytest.raises(SystemExit, match="the chain is broken"):
        main(["inspect", str(tmp_path / "d1")])


def test_progress_bar_draws_only_on_a_terminal() -> None:
    import io

    from shardvar.cli._progress import ProgressBar

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    term, pipe = Terminal(), io.StringIO()
    with ProgressBar("work", stream=term, delay=0) as bar:
        bar(512, 1024)
    with ProgressBar("work", stream=pipe, delay=0) as bar:
        bar(512, 1024)
    assert "work [###############" in term.getvalue() and " 50%" in term.getvalue() and term.getvalue().endswith("\n")
    assert pipe.getvalue() == ""
    quick = Terminal()
    with ProgressBar("work", stream=quick, delay=60) as bar:
        bar(1, 2)
    assert quick.getvalue() == ""  # work shorter than the delay stays quiet


def test_demo_trains_checkpoints_and_restores(tmp_path) -> None:
    out = run(
        "demo", "--users", "3000", "--items", "800", "--dim", "8", "--steps", "60", "--checkpoint", str(tmp_path / "ck")
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "predictions after restore             match" in out.stdout or "match (max |diff|" in out.stdout
    assert "mod: 750,750,750,750" in out.stdout and "div: 1000,1000,1000" in out.stdout
    assert "sharded step     60/60" in out.stdout  # progress lines off a terminal
    assert "Warning" not in out.stderr, out.stderr


def test_demo_on_two_processes(tmp_path) -> None:
    out = run(
        "demo",
        "--procs",
        "2",
        "--users",
        "2000",
        "--items",
        "500",
        "--dim",
        "8",
        "--steps",
        "30",
        "--checkpoint",
        str(tmp_path / "ck"),
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "rank 1" in out.stdout and "match (max |diff|" in out.stdout


def test_bench_writes_ratios(tmp_path) -> None:
    import json

    path = tmp_path / "bench.json"
    out = run(
        "bench",
        "--rows",
        "4096",
        "--ids",
        "4096",
        "--dim",
        "64",
        "--checkpoint-mib",
        "1",
        "--repeats",
        "2",
        "--huge-pages",
        "on",  # one setting: both (the default) are tested in test_hugepages.py
        "--json",
        str(path),
    )
    assert out.returncode == 0, out.stdout + out.stderr
    results = json.loads(path.read_text())["results"]
    names = " ".join(r["benchmark"] for r in results)
    for expected in (
        "embedding_lookup",
        "scatter_add",
        "training step",
        "checkpoint save",
        "checkpoint restore",
        "distributed lookup",
    ):
        assert expected in names
    assert all(r["ratio"] > 0 for r in results)
    assert results[-1]["bytes_sent_vs_bound"] < 1.1  # rows of 256 bytes; each id adds 8


def test_demo_tables_trains_the_collection_on_two_processes_as_on_one(tmp_path, capsys) -> None:
    args = ["demo", "--tables", "26", "--steps", "6", "--batch", "64", "--scale", "0.002", "--no-progress"]
    assert main([*args, "--procs", "2", "--checkpoint", str(tmp_path / "ck")]) == 0
    out = capsys.readouterr().out
    assert "1 kernel(s) for 26 tables" in out and "placement auto:" in out
    diffs = [float(m) for m in re.findall(r"max \|diff\| = ([0-9.e+-]+)", out)]
    assert len(diffs) == 3 and max(diffs) < 1e-5  # collection vs unsharded, processes vs one, restored
    assert (tmp_path / "ck" / "manifest.json").exists()
