"""Entry point: ``shardvar <command> ...``."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from .. import __version__
from .._errors import ShardvarError
from .._pages import use_huge_pages
from ._bench import add_bench_parser
from ._checkpoint import add_checkpoint_parsers
from ._demo import add_demo_parser
from ._plan import add_plan_parser
from ._tf import add_tf_parsers


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shardvar", description="Partitioned variables for PyTorch.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", title="commands", metavar="COMMAND")
    add_demo_parser(sub)
    add_bench_parser(sub)
    add_plan_parser(sub)
    add_checkpoint_parsers(sub)
    add_tf_parsers(sub)  # after inspect, which it extends to TensorFlow checkpoints
    return parser


def commands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """Each command's own parser, by name."""
    (sub,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def _parse(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """The arguments, each checked by its type and then together (``args.check``), before any work:
    a bad one ends here with the command's usage and one line (status 2)."""
    args = parser.parse_args(argv)
    check = getattr(args, "check", None)
    problem = check(args) if check is not None else None
    if problem:
        commands(parser)[args.command].error(problem)
    return args


def _stdout_gone() -> int:
    # https://docs.python.org/3/library/signal.html#note-on-sigpipe: the reader left (`| head -1`);
    # point stdout at devnull so the interpreter's final flush does not fail again, and exit 1.
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # not a real file (a caller's capture): nothing left to flush
        pass
    return 1


def main(argv: Sequence[str] | None = None) -> int:
    if argv is None:  # run as the program (console script, python -m shardvar), not called by a library user
        use_huge_pages()  # before torch's first allocation: importing shardvar allocates nothing
    parser = build_parser()
    args = _parse(parser, argv)
    if args.command is None:
        # A bare `shardvar` asks what it can do: the help with the list of commands, and nothing failed.
        parser.print_help()
        return 0
    try:
        code = int(args.func(args) or 0)
        sys.stdout.flush()
        return code
    except BrokenPipeError:
        return _stdout_gone()
    except (ShardvarError, OSError) as e:
        # Found while working (a checkpoint's contents, a full disk): one line and status 1, no traceback.
        raise SystemExit(f"shardvar {args.command}: {e}") from None


if __name__ == "__main__":
    sys.exit(main())
