"""Packed (quantized) tables in checkpoints: the manifest's record of them, and quantizing a checkpoint.

A packed table is stored as a plain variable of its stored rows (``uint8``, or ``float16``),
``[rows, width]``, split by its layout like any table, so resharding, deltas and serving reads
treat it as rows of bytes. ``extra["packed"][name] = {"dtype": "quint8", "dim": 64}`` says how to
read those rows (docs/checkpoint-format.md); a reader that does not know it sees the bytes.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from .._errors import CheckpointError
from .._validate import check_bool
from ..variables._packed import FORMATS, RowFormat, row_format
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


def _chosen(chain: Chain, tables: Any, skip: set[str]) -> list[str]:
    packed = chain.extra.get(PACKED) or {}
    if tables is None:  # every floating-point table split by rows
        return [
            n
            for n in sorted(chain.names())
            if n not in skip and n not in packed and _is_table(chain.source(n)[0], floating=True)
        ]
    names = [tables] if isinstance(tables, str) else list(tables)
    for n in names:
        entry = chain.source(n)[0] if n in chain.names() else None
        if entry is None or n in skip or n in packed or not _is_table(entry, floating=False):
            raise CheckpointError(
                f"cannot quantize variable {n!r}: quantize takes the checkpoint's 2-D tables split by rows "
                f"(not optimizer state or packed ones); they are e.g. {_chosen(chain, None, skip)[:5]}"
            )
    return names


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
    return Entry(name, fmt.storage, shape, layout, shapes, lambda s: fmt.pack(chain.read(name, layout, [s])[0]))


def quantize_checkpoint(
    src: str | os.PathLike,
    dst: str | os.PathLike | None,
    dtype: Any,
    *,
    tables: Any = None,
    progress: Progress | None = None,
    overwrite: bool = False,
) -> Path:
    """Write checkpoint ``src`` to ``dst`` with ``tables`` (default: every floating-point table split by
    rows) packed as ``dtype`` rows, each in its saved layout; other variables are copied as they are.

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
