"""Every value the command line takes, checked where argparse parses it.

Each flag or positional that takes a value has either ``choices`` or a ``type`` that is an
:class:`ArgType`: a converter that refuses a value out of its range with one line naming what was
expected (argparse adds the argument's name and exits with status 2), before any work starts.
Each ``ArgType`` lists values it refuses (``bad``), which the tests feed to every flag of every command.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from .._errors import ShardvarError
from .._validate import check_int, check_number
from ..partitioners import element_size

__all__ = [
    "ArgType",
    "dtype_name",
    "existing_dir",
    "input_file",
    "input_path",
    "integer",
    "output_dir",
    "output_file",
    "real",
    "text",
]


class ArgType:
    """An argparse ``type=``: ``convert(text)`` raises ``ValueError`` (or a ShardvarError) with the reason.

    ``kind`` says what it takes (the tests pick a valid value by it); ``bad`` are values it refuses.
    """

    def __init__(self, convert: Callable[[str], Any], kind: str, bad: Sequence[str]) -> None:
        self.convert, self.kind, self.bad = convert, kind, tuple(bad)
        self.__name__ = kind  # argparse's name for the type in its own messages

    def __call__(self, value: str) -> Any:
        try:
            return self.convert(value)
        except (ValueError, ShardvarError) as e:
            reason = str(e).removeprefix("the value ")  # argparse names the argument itself
            raise argparse.ArgumentTypeError(reason if "; got" in reason else f"{reason}; got {value!r:.200}") from None

    def __repr__(self) -> str:
        return f"ArgType({self.kind})"


def integer(minimum: int | None = None, maximum: int | None = None) -> ArgType:
    """An int in [minimum, maximum]."""

    def convert(value: str) -> int:
        try:
            number = int(value)
        except ValueError:
            raise ValueError("expected an integer") from None
        return check_int(number, "the value", minimum=minimum, maximum=maximum)

    bad = ["x", "1.5"] + ([str(minimum - 1)] if minimum is not None else []) + ([str(maximum + 1)] if maximum else [])
    return ArgType(convert, "integer", bad)


def real(*, positive: bool = False, minimum: float | None = None) -> ArgType:
    """A finite float (> 0 when ``positive``, >= ``minimum``): nan and inf are refused."""

    def convert(value: str) -> float:
        try:
            number = float(value)
        except ValueError:
            raise ValueError("expected a number") from None
        return check_number(number, "the value", positive=positive, minimum=minimum)  # type: ignore[return-value]

    bad = ["x", "nan", "inf"] + (["0"] if positive else []) + ([str(minimum - 1)] if minimum is not None else [])
    return ArgType(convert, "number", bad)


def _nonempty(value: str) -> Path:
    if not value:
        raise ValueError("expected a path")
    return Path(value)


def _writable_dir(directory: Path, what: str) -> None:
    if not directory.exists():
        raise ValueError(f"{what} {str(directory)!r} does not exist")
    if not directory.is_dir():
        raise ValueError(f"{what} {str(directory)!r} is not a directory")
    if not os.access(directory, os.W_OK | os.X_OK):
        raise ValueError(f"{what} {str(directory)!r} is not writable")


def _output_file(value: str) -> str:
    path = _nonempty(value)
    if path.is_dir():
        raise ValueError("expected a file to write, not a directory")
    if path.exists() and not os.access(path, os.W_OK):
        raise ValueError("the file is not writable")
    _writable_dir(path.absolute().parent, "its directory")
    return value


def _output_dir(value: str) -> str:
    path = _nonempty(value).absolute()
    if path.exists() and not path.is_dir():
        raise ValueError("expected a directory, and a file is there")
    existing = next(p for p in (path, *path.parents) if p.exists())  # the root always exists
    _writable_dir(existing, "the directory" if existing == path else "its nearest existing directory")
    return value


def _existing_dir(value: str) -> str:
    _writable_dir(_nonempty(value), "the directory")
    return value


def _input_path(value: str) -> str:
    path = _nonempty(value)
    # A TensorFlow checkpoint is named by its prefix: `model.ckpt-3` stands for `model.ckpt-3.index`.
    if not (path.exists() or Path(f"{value}.index").is_file()):
        raise ValueError("no such file or directory")
    return value


def _input_file(value: str) -> str:
    path = _nonempty(value)
    if not path.is_file():
        raise ValueError("no such file")
    if not os.access(path, os.R_OK):
        raise ValueError("the file is not readable")
    return value


def _dtype(value: str) -> str:
    try:
        element_size(value, 16)
    except ShardvarError:
        raise ValueError("expected a torch dtype name such as float32, bfloat16 or int8, or 'string'") from None
    return value


def _text(value: str) -> str:
    if not value:
        raise ValueError("expected a non-empty value")
    return value


_UNDER_A_FILE = os.path.join(os.devnull, "x")  # a path no one can create: its parent is a device file

output_file = ArgType(_output_file, "output file", ["", _UNDER_A_FILE, "."])
output_dir = ArgType(_output_dir, "output directory", ["", _UNDER_A_FILE, os.devnull])
existing_dir = ArgType(_existing_dir, "directory", ["", _UNDER_A_FILE, "/nonexistent/shardvar-dir"])
input_path = ArgType(_input_path, "input path", ["", "/nonexistent/shardvar-input"])
input_file = ArgType(_input_file, "input file", ["", "/nonexistent/shardvar-input.json", "."])
dtype_name = ArgType(_dtype, "dtype", ["float99", ""])
text = ArgType(_text, "text", [""])
