"""``shardvar plan``: how the partitioners split some shapes, as a table."""

from __future__ import annotations

import argparse
import math

from .._errors import ShardvarError
from ..partitioners import (
    FixedShardsPartitioner,
    MaxSizePartitioner,
    MinSizePartitioner,
    Partitioner,
    PartitionerConfig,
    element_size,
)
from ._table import format_bytes, format_sizes, render_table

__all__ = ["add_plan_parser"]

DEFAULT_SHAPES = ["1000000,64", "10,3", "4096,1024", "50000,128"]
DEFAULT_PARTITIONERS = ["fixed:4", "min:262144:8", "max:67108863", "max:1048576:16"]


def parse_partitioner(spec: str) -> Partitioner:
    """'fixed:N', 'min:BYTES[:MAX_SHARDS]' or 'max:BYTES[:MAX_SHARDS]'."""
    kind, _, rest = spec.partition(":")
    try:
        args = [int(a) for a in rest.split(":")] if rest else []
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad partitioner {spec!r}: arguments must be integers") from None
    try:
        if kind == "fixed" and len(args) == 1:
            return FixedShardsPartitioner(args[0])
        if kind == "min" and 1 <= len(args) <= 2:
            return MinSizePartitioner(*args)
        if kind == "max" and 1 <= len(args) <= 2:
            return MaxSizePartitioner(*args)
    except ShardvarError as e:
        raise argparse.ArgumentTypeError(f"bad partitioner {spec!r}: {e}") from None
    raise argparse.ArgumentTypeError(
        f"bad partitioner {spec!r}; expected fixed:N, min:BYTES[:MAX_SHARDS] or max:BYTES[:MAX_SHARDS]"
    )


def parse_shape(text: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(d) for d in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"bad shape {text!r}; expected comma-separated ints such as 1000000,64"
        ) from None
    if any(d < 0 for d in shape):
        raise argparse.ArgumentTypeError(f"bad shape {text!r}; dimensions must be >= 0")
    return shape


def _describe(p: Partitioner) -> str:
    if isinstance(p, FixedShardsPartitioner):
        return f"FixedShards({p.num_shards})"
    if isinstance(p, MinSizePartitioner):
        return f"MinSize({format_bytes(p.min_shard_bytes)}, max_shards={p.max_shards})"
    assert isinstance(p, MaxSizePartitioner)
    return f"MaxSize({format_bytes(p.max_shard_bytes)}, max_shards={p.max_shards})"


def run_plan(args: argparse.Namespace) -> int:
    rows = []
    for shape in args.shape or [parse_shape(s) for s in DEFAULT_SHAPES]:
        for p in args.partitioner or [parse_partitioner(s) for s in DEFAULT_PARTITIONERS]:
            try:
                partitions = p(shape, args.dtype, args.axis)
                layout = PartitionerConfig(partitions).layout(shape, args.strategy)
            except ShardvarError as e:
                raise SystemExit(f"shardvar plan: {e}") from None
            slice_bytes = math.prod(shape) // max(shape[layout.axis], 1) * element_size(args.dtype, 16)
            rows.append(
                [
                    "x".join(map(str, shape)),
                    _describe(p),
                    PartitionerConfig(partitions).partition_str,
                    f"{layout.strategy}: {format_sizes(layout.sizes)}",
                    format_bytes(max(layout.sizes) * slice_bytes),
                ]
            )
    print(f"How the partitioners split {args.dtype} variables along axis {args.axis}:\n")
    print(render_table(["shape", "partitioner", "partitions", "rows per shard", "largest shard"], rows))
    return 0


def add_plan_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="show how partitioners split some shapes")
    p.add_argument("--shape", action="append", type=parse_shape, help="e.g. 1000000,64 (repeatable)")
    p.add_argument(
        "--partitioner", action="append", type=parse_partitioner, help="fixed:N, min:BYTES[:MAX], max:BYTES[:MAX]"
    )
    p.add_argument("--dtype", default="float32", help="torch dtype name, or 'string'")
    p.add_argument("--axis", type=int, default=0)
    p.add_argument("--strategy", choices=["div", "mod"], default="div")
    p.set_defaults(func=run_plan)
