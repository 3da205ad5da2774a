"""Entry point: ``shardvar <command> ...``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from ._bench import add_bench_parser
from ._checkpoint import add_checkpoint_parsers
from ._demo import add_demo_parser
from ._plan import add_plan_parser
from ._tf import add_tf_parsers


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shardvar", description="Partitioned variables for PyTorch.")
    sub = parser.add_subparsers(dest="command", required=True)
    add_demo_parser(sub)
    add_bench_parser(sub)
    add_plan_parser(sub)
    add_checkpoint_parsers(sub)
    add_tf_parsers(sub)  # after inspect, which it extends to TensorFlow checkpoints
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
