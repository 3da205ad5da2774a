"""Packed (quantized) tables in checkpoints: the manifest's record of them, and quantizing a checkpoint.

A packed table is stored as a plain variable of its stored rows (``uint8``, or ``float16``),
``[rows, width]``, split by its layout like any table, so resharding, deltas and serving reads
treat it as rows of bytes. ``extra["packed"][name] = {"dtype": "quint8", "dim": 64}`` says how to
read those rows (docs/checkpoint-format.md); a reader that does not know it sees the bytes.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
from pathlib import Path
from typing import Any

from .._errors import CheckpointError
from .._validate import check_bool
from ..variables import FORMATS, RowFormat, row_format
from ._chain import Chain
from ._manifest import MANIFEST, VariableEntry
from ._optim import split_slot_name
from ._reshard import _rewritten
from ._restore import _check_file
from ._write import Entry, Progress, write

__all__ = ["PACKED", "check_packed", "packed_format", "quantize_checkpoint"]

PACKED = "packed"  # the manifest's extra key: variable name -> {"dtype": format name, "dim": table width}


def packed_format(extra: dict[str, Any], entry: VariableEntry) -> RowFormat | None:
    """The row format of ``entry`` when it holds packed rows (checked against its stored shape), else None."""
    info = (extra.get(PACKED) or {}).get(entry.name)
    if info is None:
        return None
    fmt = FORMATS.get(info.get("dtype")) if isinstance(info, dict) else None
    dim = info.get("dim") if isinstance(info, dict) else None
    if fmt is None or type(dim) is not int or len(entry.shape) != 2 or fmt.width(dim) != entry.shape[1]:
        raise CheckpointError(
            f"variable {entry.name!r}: packed record {info!r:.80} does not match its stored shape {list(entry.shape)}"
        )
    return fmt


def check_packed(extra: dict[str, Any], entry: VariableEntry, target: dict[str, Any] | None) -> None:
    """Refuse to load packed rows into a float table, a float table into packed rows, or another format."""
    saved = (extra.get(PACKED) or {}).get(entry.name)
    if saved != target:
        describe = lambda p: "float rows" if p is None else f"{p['dtype']} rows of dim {p['dim']}"  # noqa: E731
        raise CheckpointError(
            f"variable {entry.name!r} was saved as {describe(saved)}; the target holds {describe(target)}"
        )


def _optimizer_names(chain: Chain) -> set[str]:
    keys = set(chain.extra.get("optimizers") or {})
    return {n for n in chain.names() if (parts := split_slot_name(n)) is not None and parts[0] in keys}


def _candidates(chain: Chain, skip: set[str]) -> list[str]:
    """The variables a quantize may pack: floating-point 2-D tables split by rows, not optimizer state or packed."""
    packed = chain.extra.get(PACKED) or {}
    return [
        n for n in sorted(chain.names()) if n not in skip and n not in packed and _is_table(chain.source(n)[0], True)
    ]


def _matching(chain: Chain, tables: Any, skip: set[str]) -> list[str]:
    """``tables``: a name, a glob pattern (``*?[``, over the candidate tables), a compiled regex (full match
    over them), or a list of those; each must name at least one variable, every one a table."""
    given = [tables] if isinstance(tables, (str, re.Pattern)) else list(tables) if _listlike(tables) else None
    if not given or not all(isinstance(t, (str, re.Pattern)) for t in given):
        raise CheckpointError(
            f"tables must be a variable name, a glob pattern, a compiled regex or a list of them; got {tables!r:.80}"
        )
    candidates, names = _candidates(chain, skip), chain.names()
    chosen: list[str] = []
    for t in given:
        if isinstance(t, re.Pattern):
            found = [n for n in candidates if t.fullmatch(n)]
        elif t in names or not any(c in t for c in "*?["):
            found = [t]
        else:
            found = [n for n in candidates if fnmatch.fnmatchcase(n, t)]
        if not found:
            raise CheckpointError(f"tables {t!r} names no table of the checkpoint; its tables are {candidates[:8]}")
        chosen += [n for n in found if n not in chosen]
    for n in chosen:
        entry = chain.source(n)[0] if n in names else None
        if entry is None or n in skip or n in (chain.extra.get(PACKED) or {}) or not _is_table(entry, floating=False):
            raise CheckpointError(
                f"cannot quantize variable {n!r}: quantize takes the checkpoint's 2-D tables split by rows "
                f"(not optimizer state or packed ones); they are e.g. {candidates[:5]}"
            )
    return chosen


def _listlike(x: Any) -> bool:
    return isinstance(x, (list, tuple, set, frozenset))


def _chosen(chain: Chain, tables: Any, skip: set[str]) -> list[str]:
    """The variables to pack: ``tables`` when given, else those the manifest records as embedding tables."""
    if tables is not None:
        return _matching(chain, tables, skip)
    candidates = _candidates(chain, skip)
    unknown = [n for n in candidates if chain.source(n)[0].role is None]
    if unknown:
        raise CheckpointError(
            f"the checkpoint does not say whether {unknown[:5]}{' ...' if len(unknown) > 5 else ''} are embedding "
            "tables (it was saved before shardvar recorded it, or they were saved without their module): pass "
            "tables=[names] or a pattern, e.g. tables='model/emb*'; dense layers must not be packed"
        )
    chosen = [n for n in candidates if chain.source(n)[0].role == "table"]
    if not chosen and not chain.extra.get(PACKED):
        raise CheckpointError(f"the checkpoint holds no embedding tables to quantize; its variables are "
                              f"{sorted(chain.names())[:8]} (pass tables= to pack others)")  # fmt: skip
    return chosen


def _check_formats(chain: Chain, fmt: RowFormat) -> None:
    """Tables already packed stay as they are: refused when the format asked for is another."""
    other = {n: p.get("dtype") for n, p in (chain.extra.get(PACKED) or {}).items() if p.get("dtype") != fmt.name}
    if other:
        name, stored = next(iter(sorted(other.items())))
        raise CheckpointError(
            f"variable {name!r} is stored as {stored} rows; {fmt.name} was requested, and packed rows are not "
            f"quantized again (that would compound both roundings): quantize the float checkpoint to {fmt.name}"
        )


def _is_table(entry: VariableEntry, floating: bool) -> bool:
    rows_split = entry.layout is not None and entry.layout.axis == 0
    return len(entry.shape) == 2 and rows_split and (entry.dtype.is_floating_point or not floating)


def _packed_entry(chain: Chain, name: str, fmt: RowFormat) -> Entry:
    entry, link, _ = chain.source(name)
    fmt.check(entry.dtype, entry.shape[1], f"variable {name!r}")
    for piece in entry.pieces:
        _check_file(link.files, entry, piece)
    layout = entry.layout
    shape = (entry.shape[0], fmt.width(entry.shape[1]))
    shapes = dict(enumerate(layout.shard_shapes(shape)))
    # One shard read, packed and written at a time: memory is bounded by the largest shard.
    pack = lambda s: fmt.pack(chain.read(name, layout, [s])[0])  # noqa: E731
    return Entry(name, fmt.storage, shape, layout, shapes, pack, role="table")


def quantize_checkpoint(
    src: str | os.PathLike,
    dst: str | os.PathLike | None,
    dtype: Any,
    *,
    tables: Any = None,
    progress: Progress | None = None,
    overwrite: bool = False,
) -> Path:
    """Write checkpoint ``src`` to ``dst`` with its embedding tables packed as ``dtype`` rows, each in its
    saved layout; other variables (dense layers, buffers) are copied as they are.

    The tables are those the manifest records as embedding tables (``shardvar.save`` records them), or
    ``tables``: a name, a glob pattern, a compiled regex, or a list of them. A checkpoint that does not
    say (saved before the record existed) needs ``tables``. Tables already packed in another format
    are refused (requantizing would round twice); in ``dtype`` they are copied.

    Optimizer state is left out (a packed table trains no further). One shard is read, packed and
    written at a time, so memory stays bounded by the largest shard. Returns ``dst``.
    """
    fmt = row_format(dtype)
    if dst is None:
        raise CheckpointError("quantizing a checkpoint writes a new one: pass dst=<directory>")
    src, dst = Path(src), Path(dst)
    if src.resolve() == dst.resolve():
        raise CheckpointError(f"this writes a new checkpoint; src and dst are both {src}")
    if (dst / MANIFEST).exists() and not check_bool(overwrite, "overwrite"):
        raise CheckpointError(f"{dst} already holds a checkpoint; pass overwrite=True to replace it")
    with Chain.open(src) as chain:
        _check_formats(chain, fmt)
        skip = _optimizer_names(chain)
        chosen = _chosen(chain, tables, skip)
        entries = [
            _packed_entry(chain, n, fmt) if n in chosen else _rewritten(chain, n, None, "div")
            for n in sorted(chain.names())
            if n not in skip
        ]
        extra = {k: v for k, v in json.loads(json.dumps(chain.extra)).items() if k not in ("delta", "optimizers")}
        shapes = {n: chain.source(n)[0].shape for n in chosen}
        extra[PACKED] = {**(extra.get(PACKED) or {}), **{n: {"dtype": fmt.name, "dim": shapes[n][1]} for n in chosen}}
        write(dst, entries, {**extra, "optimizers": {}}, progress)
    return dst
