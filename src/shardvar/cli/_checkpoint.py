"""``shardvar inspect`` (a checkpoint, or a tiered backing file), ``shardvar reshard`` and ``shardvar compact``."""

from __future__ import annotations

import argparse

from .._errors import ShardvarError
from ..checkpoint import Chain, Manifest, VariableEntry, compact, packed_format, reshard
from ..layout import STRATEGIES
from ..tiered import describe, is_backing_file
from ._args import input_path, integer, output_dir
from ._console import byte_progress, format_bytes, format_sizes, print_table

__all__ = ["add_checkpoint_parsers", "printable"]


def printable(text: str) -> str:
    """``text`` with control characters escaped, so a variable name cannot drive the terminal."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def run_inspect(args: argparse.Namespace) -> int:
    if is_backing_file(args.path):  # a tiered table's rows, not a checkpoint: say what it is
        return _run_backing_inspect(args)
    try:
        manifest = Manifest.read(args.path)
    except ShardvarError as e:
        raise SystemExit(f"shardvar inspect: {e}") from None
    rows = []
    for name, v in sorted(manifest.variables.items()):
        layout = (
            "whole (0-d)"
            if v.layout is None
            else f"{v.layout.strategy}: {format_sizes(v.layout.sizes)} @axis{v.layout.axis}"
        )
        rows.append(
            [
                printable(name),
                _dtype(manifest, v),
                "x".join(map(str, v.shape)) or "()",
                layout,
                format_bytes(v.nbytes),
                len(v.pieces),
            ]
        )
    print_table(["variable", "dtype", "shape", "saved layout", "bytes", "pieces"], rows)
    total = sum(v.nbytes for v in manifest.variables.values())
    print(f"\n{len(rows)} variables, {format_bytes(total)} in {len(manifest.files())} file(s)")
    if "delta" in manifest.extra:
        _print_chain(args.path)
    return 0


def _run_backing_inspect(args: argparse.Namespace) -> int:
    """A tiered table's backing file: its layout (rows, dim, dtype, the optimizer state each record
    carries), its size, and whether it was closed cleanly, is in use, or is a partial file a rewrite
    left. It is a working store, not a checkpoint; live cache statistics belong to the running table
    (``table.cache_stats()``, ``benchmarks/bench_tiered.py``)."""
    try:
        info = describe(args.path)
    except ShardvarError as e:
        raise SystemExit(f"shardvar inspect: {e}") from None
    layout = info.layout
    state = (
        f"{layout.state_width} float32 per row, at byte {layout.state_offset} of each record "
        "(the optimizer's slots: row-wise Adagrad 1, Adam 2 x dim)"
        if layout.state_width
        else "none (no optimizer has added its state)"
    )
    rows = [
        ["rows", f"{layout.rows:,}"],
        ["dim", layout.dim],
        ["dtype", layout.dtype],
        ["record", f"{layout.record_bytes} bytes: {layout.row_bytes} of values, then the state"],
        ["state", state],
        ["size", f"{format_bytes(info.size)} ({info.size:,} bytes; header 4 KiB)"],
        ["status", info.status],
    ]
    print_table(["field", "value"], rows, title=f"backing file {printable(str(info.path))} (a tiered table's rows)")
    return 0


def _dtype(manifest: Manifest, v: VariableEntry) -> str:
    """The stored dtype, or a quantized table's format and width (its bytes include scale and bias)."""
    try:
        fmt = packed_format(manifest.extra, v)
    except ShardvarError as e:
        raise SystemExit(f"shardvar inspect: {e}") from None
    stored = str(v.dtype).removeprefix("torch.")
    return stored if fmt is None else f"{fmt.name} (dim {fmt.dim(v.shape[1])}, {stored} rows)"


def _print_chain(path: str) -> None:
    """The chain a delta stands on, oldest first, each link verified as a load would."""
    try:
        with Chain.open(path) as chain:
            rows = []
            for k, link in enumerate(chain.links):
                deltas = (link.manifest.extra.get("delta") or {}).get("rows", {})
                changed = {n: link.manifest.variables[spec["rows"]].shape[0] for n, spec in deltas.items()}
                what = ", ".join(f"{printable(n)}: {c} rows" for n, c in sorted(changed.items())) or "-"
                size = sum(v.nbytes for v in link.manifest.variables.values())
                kind = "base" if k == 0 else f"delta {k}"
                where = printable(str(link.directory))
                rows.append([kind, where, link.manifest.save_id[:12], format_bytes(size), what])
    except ShardvarError as e:
        raise SystemExit(f"shardvar inspect: the chain is broken: {e}") from None
    print()
    title = "chain (oldest first; `shardvar compact` folds it into one checkpoint):"
    print_table(["link", "path", "save", "bytes", "changed rows"], rows, title=title)


def run_reshard(args: argparse.Namespace) -> int:
    try:
        with byte_progress("reshard") as bar:
            reshard(args.src, args.dst, args.shards, args.strategy, progress=bar, overwrite=args.force)
    except ShardvarError as e:
        raise SystemExit(f"shardvar reshard: {e}") from None
    print(f"wrote {args.dst}: {written_shards(args.dst, args.shards, args.strategy)}")
    return 0


def written_shards(path: str, asked: int, strategy: str) -> str:
    """How many shards each variable got: ``asked``, or (as TensorFlow's partitioners do) one per row
    for a variable with fewer rows; read back from the checkpoint written, not assumed."""
    counts = {name: len(v.layout.sizes) for name, v in Manifest.read(path).variables.items() if v.layout is not None}
    fewer = {name: n for name, n in counts.items() if n != asked}
    if not fewer:
        return f"every variable in {asked} {strategy} shard(s)"
    listed = ", ".join(f"{printable(n)}: {k}" for n, k in sorted(fewer.items())[:8])
    listed += ", ..." if len(fewer) > 8 else ""
    rest = len(counts) - len(fewer)
    if not rest:
        return f"every variable has fewer rows than {asked}: one {strategy} shard per row ({listed})"
    return f"{rest} variable(s) in {asked} {strategy} shard(s), those with fewer rows in one per row ({listed})"


def run_compact(args: argparse.Namespace) -> int:
    try:
        with byte_progress("compact") as bar:
            compact(args.src, args.dst, progress=bar, overwrite=args.force)
    except ShardvarError as e:
        raise SystemExit(f"shardvar compact: {e}") from None
    print(f"wrote {args.dst}: the chain ending at {args.src} as one checkpoint")
    return 0


def add_checkpoint_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("inspect", help="list the variables of a checkpoint (or describe a tiered backing file)")
    p.add_argument("path", type=input_path)
    p.set_defaults(func=run_inspect)
    p = sub.add_parser("reshard", help="rewrite a checkpoint into another layout")
    p.add_argument("src", type=input_path)
    p.add_argument("dst", type=output_dir)
    p.add_argument("--shards", type=integer(1), required=True)
    p.add_argument("--strategy", choices=sorted(STRATEGIES), default="div")
    p.add_argument("--force", action="store_true", help="replace a checkpoint already at DST")
    p.set_defaults(func=run_reshard)
    p = sub.add_parser("compact", help="fold a delta checkpoint and its chain into one full checkpoint")
    p.add_argument("src", type=input_path, help="the newest delta of the chain")
    p.add_argument("dst", type=output_dir)
    p.add_argument("--force", action="store_true", help="replace a checkpoint already at DST")
    p.set_defaults(func=run_compact)
