"""The command line, run as a user runs it."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from shardvar.cli import main


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shardvar", *args], capture_output=True, text=True)


# One test per way in runs the program itself (`python -m shardvar`: --version, inspect in a pipe, the
# demo, bench, and on a terminal); the others call its main, which is what the program runs.


def test_plan_default_table(capsys) -> None:
    assert main(["plan"]) == 0
    out = capsys.readouterr().out
    assert "FixedShards(4)" in out and "1000000x64" in out
    assert "div: 3,3,2,2" in out  # 10 rows over 4 shards: the first two get the extra row


def test_plan_with_options(capsys) -> None:
    assert main(["plan", "--shape", "10,3", "--partitioner", "fixed:4", "--strategy", "mod", "--dtype", "int8"]) == 0
    out = capsys.readouterr().out
    assert "mod: 3,3,2,2" in out and "int8" in out


def test_plan_bad_arguments_exit_with_a_message(capsys) -> None:
    with pytest.raises(SystemExit, match=r"^2$"):
        main(["plan", "--partitioner", "fixed:0"])
    assert "`num_shards` must be positive; got 0" in capsys.readouterr().err
    with pytest.raises(SystemExit, match=r"^2$"):
        main(["plan", "--shape", "10,x"])
    assert "bad shape '10,x'" in capsys.readouterr().err
    with pytest.raises(SystemExit, match=r"^2$"):  # checked against every shape where parsed
        main(["plan", "--shape", "10,3", "--axis", "5"])
    assert "argument --axis: axis 5 is out of range" in capsys.readouterr().err


def test_inspect_and_reshard(tmp_path, capsys) -> None:
    import torch

    import shardvar

    shardvar.save(
        {"emb": shardvar.shard_tensor(torch.randn(100, 4), shardvar.Layout.mod(100, 4)), "step": torch.tensor(3)},
        tmp_path / "a",
    )
    out = run("inspect", str(tmp_path / "a"))
    assert out.returncode == 0, out.stderr
    assert "emb" in out.stdout and "mod: 25,25,25,25 @axis0" in out.stdout and "whole (0-d)" in out.stdout
    lines = out.stdout.splitlines()  # in a pipe: plain text, a header, dashes, a row a line
    assert "\x1b" not in out.stdout and "─" not in out.stdout
    assert lines[0].split() == ["variable", "dtype", "shape", "saved", "layout", "bytes", "pieces"]
    assert set(lines[1]) == {"-", " "} and lines[2].split()[:3] == ["emb", "float32", "100x4"]
    assert main(["reshard", str(tmp_path / "a"), str(tmp_path / "b"), "--shards", "3", "--strategy", "div"]) == 0
    assert capsys.readouterr().err == ""  # no progress bar off a terminal
    assert main(["inspect", str(tmp_path / "b")]) == 0
    assert "div: 34,33,33 @axis0" in capsys.readouterr().out
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit, match=r"manifest\.json is missing"):  # a message: exit status 1
        main(["inspect", str(tmp_path / "empty")])
    with pytest.raises(SystemExit, match=r"^2$"):  # no such path: refused where parsed
        main(["inspect", str(tmp_path / "missing")])
    assert "argument path: no such file or directory" in capsys.readouterr().err
    with pytest.raises(SystemExit, match=r"^2$"):
        main(["reshard", str(tmp_path / "a"), str(tmp_path / "c"), "--shards", "0"])
    assert "argument --shards: must be >= 1; got 0" in capsys.readouterr().err


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


def run_in_terminal(*args: str, **env: str) -> tuple[int, str]:
    """Run ``shardvar`` with stdout and stderr on a pseudo-terminal, as a user at a shell does."""
    import os
    import pty

    environ = {k: v for k, v in os.environ.items() if k not in ("NO_COLOR", "FORCE_COLOR", "TERM", "COLUMNS")}
    master, slave = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "shardvar", *args],
        stdin=slave,
        stdout=slave,
        stderr=slave,
        env={**environ, "TERM": "xterm-256color", "COLUMNS": "160", **env},
    )
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 1 << 16)
        except OSError:  # EIO: the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    return proc.wait(), b"".join(chunks).decode()


def _saved(path) -> None:
    import torch

    import shardvar

    shardvar.save({"emb": shardvar.shard_tensor(torch.randn(100, 4), shardvar.Layout.mod(100, 4))}, path)


def test_tables_are_rich_on_a_terminal(tmp_path) -> None:
    _saved(tmp_path / "a")
    rc, term = run_in_terminal("inspect", str(tmp_path / "a"))
    assert rc == 0, term
    assert "\x1b[1;36m" in term and "─" in term  # bold cyan headers over a rule
    assert "mod: 25,25,25,25 @axis0" in term


def test_progress_bars_on_a_terminal_only_and_off_with_no_progress(tmp_path) -> None:
    _saved(tmp_path / "a")
    rc, term = run_in_terminal("reshard", str(tmp_path / "a"), str(tmp_path / "b"), "--shards", "3")
    assert rc == 0 and "reshard" in term and "100%" in term and "━" in term, term
    demo = ["demo", "--users", "300", "--items", "80", "--dim", "4", "--steps", "28", "--batch", "64"]
    rc, term = run_in_terminal(*demo)
    assert rc == 0 and "training (sharded | unsharded, interleaved)" in term and "28/28" in term, term
    assert "save" in term and "restore" in term  # the checkpoint's bars
    rc, quiet = run_in_terminal(*demo, "--no-progress", NO_COLOR="1")
    assert rc == 0 and "training (sharded" not in quiet and "━" not in quiet, quiet
    assert "\x1b[1m" in quiet and not re.search("\x1b\\[[0-9;]*3[0-9]m", quiet)  # NO_COLOR: bold, no colours


def test_version_and_a_bare_command(capsys) -> None:
    import shardvar

    out = run("--version")
    assert out.returncode == 0 and out.stdout == f"shardvar {shardvar.__version__}\n", out
    with pytest.raises(SystemExit, match="0"):
        main(["--version"])
    assert capsys.readouterr().out == f"shardvar {shardvar.__version__}\n"
    assert main([]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: shardvar")
    for command in ("demo", "bench", "plan", "inspect", "reshard", "compact"):
        assert re.search(rf"^\s+{command}\s+\w", out, re.M), command
    with pytest.raises(SystemExit, match="2"):
        main(["nonsense"])
    assert "invalid choice: 'nonsense'" in capsys.readouterr().err


def test_demo_trains_checkpoints_and_restores(tmp_path) -> None:
    import os

    (tmp_path / "tmp").mkdir()
    env = {**os.environ, "TMPDIR": str(tmp_path / "tmp")}
    args = ["demo", "--users", "3000", "--items", "800", "--dim", "8", "--steps", "30"]
    out = subprocess.run([sys.executable, "-m", "shardvar", *args], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    assert re.search(r"^predictions after restore +match \(max \|diff\| = 0.0e\+00\)", out.stdout, re.M)
    assert "mod: 750,750,750,750" in out.stdout and "div: 1000,1000,1000" in out.stdout
    ratio = re.search(r"^sharded / unsharded, interleaved +([0-9.]+)x \(median of 27 steps each", out.stdout, re.M)
    assert ratio and float(ratio[1]) > 0, out.stdout
    assert "removed (--checkpoint DIR keeps it)" in out.stdout and "shardvar-demo-" not in out.stdout
    assert list((tmp_path / "tmp").glob("shardvar-demo-*")) == []  # the temporary checkpoint is gone
    assert out.stderr == "", out.stderr  # no warnings, no progress bar off a terminal


def test_demo_times_its_twins_interleaved() -> None:
    from torch import nn

    from shardvar.workloads import Clicks, DemoSettings, RecModel, step_summary, train_twins

    order: list[int] = []
    models = []
    for k in range(2):
        model = RecModel(nn.Embedding(50, 4), nn.Embedding(20, 4), 4)
        model.register_forward_pre_hook(lambda module, inputs, k=k: order.append(k))
        models.append(model)
    args = DemoSettings(lr=0.01, seed=0, steps=6, batch=8)
    losses, seconds = train_twins((models[0], models[1]), Clicks(50, 20, 0), args)
    assert order == [0, 1, 1, 0] * 3  # a step of each in turn, the order alternating
    assert len(losses) == 6 and [len(s) for s in seconds] == [6, 6]
    rows = step_summary(([0.010, 0.012, 0.011, 0.030] * 5, [0.020] * 20), warmup=0, block=10)
    assert rows["time per step, sharded"] == "11.5 ms (middle half 10.2-25.5)"
    assert rows["sharded / unsharded, interleaved"] == "0.57x (median of 20 steps each; per 10 steps 0.57-0.57x)"


def test_demo_on_two_processes(tmp_path, capsys) -> None:
    args = ["demo", "--procs", "2", "--users", "2000", "--items", "500", "--dim", "8", "--steps", "30"]
    assert main([*args, "--checkpoint", str(tmp_path / "ck")]) == 0
    out = capsys.readouterr().out
    assert "rank 1" in out and "match (max |diff|" in out
    assert re.search(rf"^checkpoint +{re.escape(str(tmp_path / 'ck'))}$", out, re.M), out
    assert (tmp_path / "ck" / "manifest.json").exists()  # asked for: kept


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
