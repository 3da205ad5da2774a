"""``shardvar plan``: how the partitioners split some shapes, as a table."""

from __future__ import annotations

import argparse
import importlib.util
import math

from .._errors import ShardvarError
from .._validate import normalise_axis
from ..layout import STRATEGIES
from ..partitioners import (
    FixedShardsPartitioner,
    MaxSizePartitioner,
    MinSizePartitioner,
    Partitioner,
    PartitionerConfig,
    element_size,
)
from ._args import ArgType, dtype_name, integer, output_file
from ._console import format_bytes, format_sizes, print_table

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


SHAPE = ArgType(parse_shape, "shape", ["10,x", "10,-1", ""])
PARTITIONER = ArgType(parse_partitioner, "partitioner", ["fixed:0", "min:x", "max:-1", "nope:1"])


def _describe(p: Partitioner) -> str:
    if isinstance(p, FixedShardsPartitioner):
        return f"FixedShards({p.num_shards})"
    if isinstance(p, MinSizePartitioner):
        return f"MinSize({format_bytes(p.min_shard_bytes)}, max_shards={p.max_shards})"
    assert isinstance(p, MaxSizePartitioner)
    return f"MaxSize({format_bytes(p.max_shard_bytes)}, max_shards={p.max_shards})"


def parse_size(text: str) -> int:
    units = {
        "": 1,
        "B": 1,
        "KB": 10**3,
        "MB": 10**6,
        "GB": 10**9,
        "KIB": 2**10,
        "MIB": 2**20,
        "GIB": 2**30,
        "TIB": 2**40,
    }
    number = text.rstrip("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
    unit = text[len(number) :].upper()
    try:
        value = float(number) * units[unit]
    except (ValueError, KeyError):
        raise argparse.ArgumentTypeError(f"bad size {text!r}; expected e.g. 512MiB, 2GB or 1000000") from None
    if not math.isfinite(value) or value < 1:
        raise argparse.ArgumentTypeError(f"bad size {text!r}; expected at least one byte, e.g. 512MiB")
    return int(value)


def parse_named(kind: str) -> ArgType:
    def parse(text: str) -> tuple[str, object]:
        name, sep, value = text.partition("=")
        if not sep or not name:
            raise argparse.ArgumentTypeError(f"bad {kind} {text!r}; expected NAME=VALUE")
        return name, parse_size(value) if kind == "device" else parse_shape(value.replace("x", ","))

    bad = ["=1", "x"] + (["a=0", "a=nan", "a=-1GiB", "a=5XB"] if kind == "device" else ["a=10x-1", "a=ten"])
    return ArgType(parse, kind, bad)


def _duplicates(named: list[tuple[str, object]] | None) -> list[str]:
    names = [n for n, _ in named or []]
    return sorted({n for n in names if names.count(n) > 1})


def check_plan(args: argparse.Namespace) -> str | None:
    """Flags that only mean something together, names given twice, and the axis against every shape."""
    if args.png and importlib.util.find_spec("matplotlib") is None:
        return "--png needs matplotlib: pip install 'shardvar[plot]'"
    if not args.device:
        for flag, value in (("--var", args.var), ("--png", args.png)):
            if value:
                return f"{flag} places variables on devices: give --device NAME=BUDGET too"
    elif args.partitioner:
        return "--partitioner shows the partitioners alone: leave out --device (the planner picks them)"
    elif args.var and args.shape:
        return "give the variables either as --var NAME=SHAPE or as --shape, not both"
    for flag, named in (("--device", args.device), ("--var", args.var)):
        if _duplicates(named):
            return f"{flag} names {', '.join(map(repr, _duplicates(named)))} more than once; give each once"
    for shape in args.shape or [parse_shape(s) for s in DEFAULT_SHAPES]:
        try:
            normalise_axis(args.axis, len(shape))
        except ShardvarError as e:
            return f"argument --axis: {e} (shape {'x'.join(map(str, shape))})"
    return None


def run_planner(args: argparse.Namespace) -> int:
    from ..transform import plan

    shapes = dict(
        args.var or [(f"var{i}", s) for i, s in enumerate(args.shape or [parse_shape(s) for s in DEFAULT_SHAPES])]
    )
    try:
        result = plan(shapes, dict(args.device), dtype=args.dtype)
        if args.png:
            result.draw(args.png)
    except ShardvarError as e:
        raise SystemExit(f"shardvar plan: {e}") from None
    print(f"Plan for {len(shapes)} {args.dtype} variables over {len(args.device)} devices:\n")
    print_table(result.HEADERS, result.rows())
    print()
    rows = [
        [n, "x".join(map(str, shapes[n])), format_sizes(result.strategy[n].partitioner.sizes), ", ".join(d)]
        for n, d in result.placement.items()
    ]
    print_table(["variable", "shape", "rows per shard", "devices"], rows)
    if args.png:
        print(f"\nshard map written to {args.png}")
    return 0


def run_plan(args: argparse.Namespace) -> int:
    if args.device:
        return run_planner(args)
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
    print_table(["shape", "partitioner", "partitions", "rows per shard", "largest shard"], rows)
    return 0


def add_plan_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="show how partitioners split some shapes")
    p.add_argument("--shape", action="append", type=SHAPE, help="e.g. 1000000,64 (repeatable)")
    p.add_argument("--partitioner", action="append", type=PARTITIONER, help="fixed:N, min:BYTES[:MAX], max:BYTES[:MAX]")
    p.add_argument("--dtype", type=dtype_name, default="float32", help="torch dtype name, or 'string'")
    p.add_argument("--axis", type=integer(), default=0)
    p.add_argument("--strategy", choices=sorted(STRATEGIES), default="div")
    p.add_argument(
        "--device",
        action="append",
        type=parse_named("device"),
        help="NAME=BUDGET (e.g. cuda:0=20GiB): plan a placement",
    )
    p.add_argument(
        "--var", action="append", type=parse_named("var"), help="NAME=SHAPE (e.g. users=1000000x64), with --device"
    )
    p.add_argument("--png", type=output_file, help="with --device: draw the shard map to this PNG (needs matplotlib)")
    p.set_defaults(func=run_plan, check=check_plan)
