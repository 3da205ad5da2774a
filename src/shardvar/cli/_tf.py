"""``shardvar convert-tf`` and ``shardvar inspect`` of a TensorFlow checkpoint (drawn with rich)."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from .._errors import ShardvarError
from ..layout import STRATEGIES
from ._args import ArgType, input_file, input_path, integer, output_dir
from ._checkpoint import written_shards
from ._console import byte_progress, print_table

__all__ = ["add_tf_parsers", "is_tf_checkpoint"]


_DATA_FILE = re.compile(r"\.data-\d{5}-of-\d{5}$")


def is_tf_checkpoint(path: str) -> bool:
    """A TensorFlow checkpoint prefix, its ``.index`` or one of its ``.data-...`` files, or a directory
    that holds TensorFlow's files (a ``checkpoint`` state file, or bundles without it) and no manifest:
    those go to the TensorFlow reader, whose errors say what to pass instead."""
    p = Path(path)
    if p.is_dir():
        if (p / "manifest.json").exists():
            return False
        return (p / "checkpoint").is_file() or any(p.glob("*.index"))
    return p.name.endswith(".index") or bool(_DATA_FILE.search(p.name)) or Path(f"{p}.index").is_file()


def _shown(text: str) -> str:
    """``text`` for the terminal: control characters (a hostile index's names may hold escape
    sequences) shown as Python escapes, never sent (the console prints cells without markup)."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def _slices(v: object) -> str:
    from ..tf import slice_spec  # TensorFlow's spelling of a slice, as its errors print it

    if not v.sliced:
        return "-"
    specs = [slice_spec(list(zip(p.offsets, p.lengths, strict=True))) for p in v.pieces]
    return f"{len(specs)}: " + " ".join(specs[:4]) + (" ..." if len(specs) > 4 else "")


def run_tf_inspect(args: argparse.Namespace) -> int:
    from ..tf import TFCheckpoint, short_name

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


def _mapping(text: str) -> dict[str, str]:
    """``--map FILE``: read and checked where it is parsed, before anything is converted."""
    try:
        mapping = json.loads(Path(input_file(text)).read_text())
    except OSError as e:
        raise ValueError(f"cannot read it ({e.strerror})") from None
    except ValueError as e:
        raise ValueError(f"not JSON ({e})") from None
    if not isinstance(mapping, dict) or not all(isinstance(v, str) for v in mapping.values()):
        raise ValueError("must hold a JSON object of TF name -> shardvar name")
    return mapping


MAPPING = ArgType(_mapping, "mapping file", ["", "/nonexistent/shardvar-map.json", "."])


def run_convert_tf(args: argparse.Namespace) -> int:
    from ..tf import convert

    mapping = args.map
    try:
        with byte_progress("convert-tf", args.progress) as progress:
            done = convert(
                args.ckpt, args.out, mapping, partitioner=args.shards, partition_strategy=args.strategy,
                optimizer=args.optimizer, step=args.step, overwrite=args.force, progress=progress,
            )  # fmt: skip
    except ShardvarError as e:
        raise SystemExit(f"shardvar convert-tf: {e}") from None
    rows = [[_shown(tf_name), _shown(name)] for tf_name, name in [*done.variables.items(), *done.slots.items()]]
    title = f"wrote {_shown(args.out)}: {written_shards(args.out, args.shards, args.strategy)}"
    print_table(["TensorFlow", "shardvar"], rows, title=title)
    if done.step is not None:
        print(f"optimizer step count: {done.step}")
    for tf_name, why in done.skipped.items():
        print(f"not converted: {_shown(tf_name)} ({_shown(why)})")
    return 0


def add_tf_parsers(sub: argparse._SubParsersAction) -> None:
    """Add ``convert-tf``, and let ``inspect`` (already added) also list TensorFlow checkpoints."""
    p = sub.add_parser("convert-tf", help="convert a TensorFlow checkpoint into a shardvar checkpoint")
    p.add_argument(
        "ckpt", type=input_path, help="a TensorFlow checkpoint prefix, or a directory with a 'checkpoint' file"
    )
    p.add_argument("out", type=output_dir)
    p.add_argument(
        "--shards",
        type=integer(1),
        default=1,
        help="shards per table (default 1; a table with fewer rows: one per row)",
    )
    p.add_argument("--strategy", choices=sorted(STRATEGIES), default="div")
    p.add_argument(
        "--map", type=MAPPING, help="a JSON file of TF name -> shardvar name (default: every variable, short names)"
    )
    p.add_argument("--optimizer", choices=["adam", "adagrad", "momentum"], help="also convert these slots")
    p.add_argument("--step", type=integer(0), help="the optimizer step count, when the checkpoint has none")
    p.add_argument("--force", action="store_true", help="replace a checkpoint already at OUT")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    p.set_defaults(func=run_convert_tf)
    inspect = sub.choices.get("inspect")
    if inspect is not None:
        shardvar_inspect = inspect.get_default("func")
        inspect.set_defaults(
            func=lambda args: run_tf_inspect(args) if is_tf_checkpoint(args.path) else shardvar_inspect(args)
        )
