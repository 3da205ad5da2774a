"""Entry point: ``shardvar <command> ...``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from .. import __version__
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


def main(argv: Sequence[str] | None = None) -> int:
    if argv is None:  # run as the program (console script, python -m shardvar), not called by a library user
        use_huge_pages()  # before torch's first allocation: importing shardvar allocates nothing
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        # A bare `shardvar` asks what it can do: the help with the list of commands, and nothing failed.
        parser.print_help()
        return 0
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
