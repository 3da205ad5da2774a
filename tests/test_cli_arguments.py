"""Every argument of every command is checked where it is parsed; the program never prints a traceback.

The flags come from the parsers themselves: a new flag that takes a value without a checked type
(``shardvar.cli._args.ArgType``) or ``choices`` fails here.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import shardvar
from shardvar.cli import main
from shardvar.cli._args import ArgType
from shardvar.cli._main import build_parser, commands

TF = Path(__file__).parent / "data" / "tf" / "saver_v1"


def _value_actions() -> list[tuple[str, argparse.Action]]:
    """(command, action) for every argument of every command that takes a value."""
    found = []
    for name, parser in commands(build_parser()).items():
        for action in parser._actions:
            if action.nargs != 0 and not isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
                found.append((name, action))
    return found


def _label(action: argparse.Action) -> str:
    return action.option_strings[-1] if action.option_strings else action.dest


ACTIONS = _value_actions()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("cli") / "ck"
    shardvar.save({"emb": torch.zeros(10, 2)}, path)
    return path


def _good(action: argparse.Action, checkpoint: Path) -> str:
    """A value the argument takes (what fills the required ones while another is tested)."""
    kind = action.type.kind if isinstance(action.type, ArgType) else None
    if kind == "input path":
        return str(TF) if action.dest == "ckpt" else str(checkpoint)
    if kind == "output directory":
        return str(checkpoint.parent / "out")
    if action.choices:
        return str(next(iter(action.choices)))
    return "1"


def _argv(command: str, tested: argparse.Action, bad: str, checkpoint: Path) -> list[str]:
    argv = [command]
    for _, action in (a for a in ACTIONS if a[0] == command):
        value = bad if action is tested else _good(action, checkpoint)
        if not action.option_strings:
            argv.append(value)
        elif action is tested or action.required:
            argv.append(f"{action.option_strings[-1]}={value}")  # `=`: a value may start with '-'
    return argv


def test_the_parsers_were_walked() -> None:
    commands_seen = {c for c, _ in ACTIONS}
    assert {"demo", "bench", "plan", "inspect", "reshard", "compact", "convert-tf"} <= commands_seen
    assert len(ACTIONS) > 40


@pytest.mark.parametrize(("command", "action"), ACTIONS, ids=[f"{c} {_label(a)}" for c, a in ACTIONS])
def test_every_value_is_checked_where_it_is_parsed(
    command: str, action: argparse.Action, checkpoint: Path, capsys
) -> None:
    if action.choices is not None and not isinstance(action.type, ArgType):
        bad = ["no-such-choice"]
    else:
        assert isinstance(action.type, ArgType), f"{command} {_label(action)} takes any value: give it a checked type"
        bad = list(action.type.bad)
        assert bad
    for value in bad:
        with pytest.raises(SystemExit) as exit_:
            main(_argv(command, action, value, checkpoint))
        err = capsys.readouterr().err
        assert exit_.value.code == 2, (value, err)
        assert "Traceback" not in err
        lines = err.strip().splitlines()
        assert lines[-1].startswith(f"shardvar {command}: error: argument {_label(action)}"), (value, err)
        assert lines[0].startswith(f"usage: shardvar {command}")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["plan", "--var", "users=200000x64"], "--var places variables on devices: give --device"),
        (["plan", "--png", "x.png"], "--png"),
        (["plan", "--device", "a=1GiB", "--device", "a=2GiB"], "--device names 'a' more than once"),
        (["plan", "--device", "a=1GiB", "--var", "u=10x2", "--var", "u=20x2"], "--var names 'u' more than once"),
        (["plan", "--device", "a=1GiB", "--partitioner", "fixed:2"], "--partitioner shows the partitioners alone"),
        (["plan", "--device", "a=1GiB", "--var", "u=10x2", "--shape", "10,2"], "either as --var NAME=SHAPE or"),
        (["plan", "--shape", "10,3", "--axis", "2"], "argument --axis: axis 2 is out of range"),
        (["demo", "--procs", "2", "--quantize"], "--quantize serves the one-process model"),
        (["demo", "--tables", "2", "--procs", "3", "--batch", "64"], "--batch 64 must divide by --procs 3"),
        (["bench", "--procs", "4", "--ids", "2"], "--ids 2 gives no ids to some of --procs 4"),
    ],
)
def test_flags_that_do_not_go_together_are_refused_where_parsed(argv: list[str], message: str, capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and message in err.splitlines()[-1], err


def test_the_program_prints_usage_and_one_line() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "shardvar", "demo", "--steps", "-1"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.strip().splitlines()[-1] == "shardvar demo: error: argument --steps: must be >= 1; got -1"
    assert "Traceback" not in out.stderr


def test_errors_found_while_working_are_one_line_with_status_1(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    out = subprocess.run(
        [sys.executable, "-m", "shardvar", "inspect", str(tmp_path / "empty")], capture_output=True, text=True
    )
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and out.stderr.startswith("shardvar inspect: ")


@pytest.fixture(scope="module")
def wide(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkpoint whose listing is larger than a pipe holds, so the reader leaves while it is written."""
    path = tmp_path_factory.mktemp("cli") / "wide"
    shardvar.save({"v" * 2000 + f"{i:03d}": torch.zeros(2) for i in range(40)}, path)
    return path


@pytest.mark.parametrize("command", ["inspect", "plan"])
def test_a_reader_that_leaves_early_ends_the_program_quietly(command: str, wide: Path) -> None:
    args = [str(wide)] if command == "inspect" else [f"--shape={1000 + i},64" for i in range(200)]
    program = " ".join([sys.executable, "-m", "shardvar", command, *args])
    out = subprocess.run(
        ["bash", "-c", f'{program} | head -1; echo "status ${{PIPESTATUS[0]}}"'], capture_output=True, text=True
    )
    assert out.stderr == ""  # no BrokenPipeError, no "Exception ignored"
    first, status = out.stdout.splitlines()
    assert status == "status 1" and first.split()[0] in ("variable", "How")


@pytest.mark.parametrize("command", ["convert-tf", "reshard"])
def test_more_shards_than_rows_prints_the_shards_written(
    command: str, checkpoint: Path, tmp_path: Path, capsys
) -> None:
    # TensorFlow's partitioners give a variable at most one shard per row; so does shardvar, and says so.
    source, rows = (str(TF), {"big": 13, "emb": 10}) if command == "convert-tf" else (str(checkpoint), {"emb": 10})
    assert main([command, source, str(tmp_path / "out"), "--shards", "100"]) == 0
    out = capsys.readouterr().out
    variables = shardvar.checkpoint.Manifest.read(tmp_path / "out").variables
    for name, count in rows.items():
        assert len(variables[name].layout.sizes) == count
        assert f"{name}: {count}" in out
    assert "one div shard per row" in out and "in 100 div shard(s)" not in out
    assert main([command, source, str(tmp_path / "two"), "--shards", "2"]) == 0
    assert re.search(r"every variable in 2 div shard\(s\)", capsys.readouterr().out)


@pytest.mark.parametrize("where", ["directory without its state file", "data file"])
def test_inspect_of_tensorflow_files_goes_to_the_tensorflow_reader(where: str, tmp_path: Path, capsys) -> None:
    for f in TF.glob("model.ckpt-3.*"):
        (tmp_path / f.name).write_bytes(f.read_bytes())
    if where == "data file":
        assert main(["inspect", str(tmp_path / "model.ckpt-3.data-00000-of-00004")]) == 0
        assert "13 variables in 4 data file(s); TensorFlow checkpoint" in capsys.readouterr().out
        return
    with pytest.raises(SystemExit, match=r"without a 'checkpoint' state file; pass a checkpoint prefix") as e:
        main(["inspect", str(tmp_path)])
    assert "manifest.json" not in str(e.value)
