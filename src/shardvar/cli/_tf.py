"""``shardvar convert-tf`` and ``shardvar inspect`` of a TensorFlow checkpoint (drawn with rich)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from .._errors import ShardvarError
from ..layout import STRATEGIES
from ._console import byte_progress, print_table

__all__ = ["add_tf_parsers", "is_tf_checkpoint"]


def is_tf_checkpoint(path: str) -> bool:
    """A TensorFlow checkpoint prefix, its ``.index``, or a directory with a ``checkpoint`` state file."""
    p = Path(path)
    if p.is_dir():
        return (p / "checkpoint").is_file() and not (p / "manifest.json").exists()
    return p.name.endswith(".index") or Path(f"{p}.index").is_file()


def _shown(text: str) -> str:
    """``text`` for the terminal: control characters (a hostile index's names may hold escape
    sequences) shown as Python escapes, never sent (the console prints cells without markup)."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def _slices(v: object) -> str:
    if not v.sliced:
        return "-"
    specs = [":".join(f"{o},{n}" for o, n in zip(p.offsets, p.lengths, strict=True)) for p in v.pieces]
    return f"{len(specs)}: " + " ".join(specs[:4]) + (" ..." if len(specs) > 4 else "")


def run_tf_inspect(args: argparse.Namespace) -> int:
    from ..tf import TFCheckpoint
    from ..tf._graph import short_name

    try:
        reader = TFCheckpoint(args.path)
        slots = {s.key: f"slot {s.name} of {short_name(s.variable)}" for s in reader.slots()}
    except ShardvarError as e:
        raise SystemExit(f"shardvar inspect: {e}") from None
    rows = [
        [
            _shown(short_name(name)),
            "x".join(map(str, v.shape)) or "()",
            v.dtype_name,
            _slices(v),
            _shown(slots.get(name, "")),
        ]
        for name, v in sorted(reader.variables.items())
    ]
    headers = ["variable", "shape", "dtype", "slices (offset,length per axis)", "note"]
    print_table(headers, rows, title=_shown(str(reader.prefix)))
    print(f"{len(reader.variables)} variables in {reader.bundle.num_shards} data file(s); TensorFlow checkpoint")
    return 0


def _mapping(path: str | None) -> dict[str, str] | None:
    if path is None:
        return None
    try:
        mapping = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise SystemExit(f"shardvar convert-tf: --map {path}: {e}") from None
    if not isinstance(mapping, dict) or not all(isinstance(v, str) for v in mapping.values()):
        raise SystemExit(f"shardvar convert-tf: --map {path} must hold a JSON object of TF name -> shardvar name")
    return mapping


def run_convert_tf(args: argparse.Namespace) -> int:
    from ..tf import convert

    mapping = _mapping(args.map)
    try:
        with byte_progress("convert-tf", args.progress) as progress:
            done = convert(
                args.ckpt, args.out, mapping, num_shards=args.shards, strategy=args.strategy,
                optimizer=args.optimizer, step=args.step, overwrite=args.force, progress=progress,
            )  # fmt: skip
    except ShardvarError as e:
        raise SystemExit(f"shardvar convert-tf: {e}") from None
    rows = [[_shown(tf_name), _shown(name)] for tf_name, name in [*done.variables.items(), *done.slots.items()]]
    title = f"wrote {_shown(args.out)}: {args.shards} {args.strategy} shard(s) per table"
    print_table(["TensorFlow", "shardvar"], rows, title=title)
    if done.step is not None:
        print(f"optimizer step count: {done.step}")
    for tf_name, why in done.skipped.items():
        print(f"not converted: {_shown(tf_name)} ({_shown(why)})")
    return 0


def add_tf_parsers(sub: argparse._SubParsersAction) -> None:
    """Add ``convert-tf``, and let ``inspect`` (already added) also list TensorFlow checkpoints."""
    p = sub.add_parser("convert-tf", help="convert a TensorFlow checkpoint into a shardvar checkpoint")
    p.add_argument("ckpt", help="a TensorFlow checkpoint prefix, or a directory with a 'checkpoint' file")
    p.add_argument("out")
    p.add_argument("--shards", type=int, default=1, help="shards per table (default 1)")
    p.add_argument("--strategy", choices=sorted(STRATEGIES), default="div")
    p.add_argument("--map", help="a JSON file of TF name -> shardvar name (default: every variable, short names)")
    p.add_argument("--optimizer", choices=["adam", "adagrad", "momentum"], help="also convert these slots")
    p.add_argument("--step", type=int, help="the optimizer step count, when the checkpoint has none")
    p.add_argument("--force", action="store_true", help="replace a checkpoint already at OUT")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    p.set_defaults(func=run_convert_tf)
    inspect = sub.choices.get("inspect")
    if inspect is not None:
        shardvar_inspect = inspect.get_default("func")
        inspect.set_defaults(
            func=lambda args: run_tf_inspect(args) if is_tf_checkpoint(args.path) else shardvar_inspect(args)
        )
