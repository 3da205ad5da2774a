"""The command line, run as a user runs it."""

from __future__ import annotations

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
