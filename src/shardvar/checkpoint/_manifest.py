"""The checkpoint manifest: what each logical variable is and where its pieces lie.

See docs/checkpoint-format.md. Reading validates everything a restore relies on, so a damaged
or hostile manifest fails here with a message naming the file and the variable.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .._errors import ShardvarError
from ..layout import Layout
from ._safetensors import DTYPE_CODES, StoredTensor

__all__ = ["CheckpointError", "Piece", "VariableEntry", "Manifest", "MANIFEST", "FORMAT", "VERSION"]

MANIFEST = "manifest.json"
FORMAT = "shardvar-checkpoint"
VERSION = 1
_FILE_NAME = re.compile(r"^[A-Za-z0-9_.-]+\.safetensors$")
_DTYPES = {str(d).removeprefix("torch."): d for d in DTYPE_CODES}


class CheckpointError(ShardvarError, ValueError):
    """A checkpoint is missing, damaged, or does not match the objects it is loaded into."""


@dataclass(frozen=True)
class Piece:
    """A stored block of a logical variable: logical indices ``start + step * i`` along ``axis``."""

    file: str
    key: str
    start: int
    step: int
    count: int
    shape: tuple[int, ...]
    chunk_rows: int
    crc32: tuple[int, ...]
    begin: int  # byte offset of its data in ``file``

    def stored(self, dtype: torch.dtype) -> StoredTensor:
        return StoredTensor(self.key, self.shape, dtype, self.begin, self.chunk_rows, self.crc32)


@dataclass(frozen=True)
class VariableEntry:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    layout: Layout | None  # None for a 0-d tensor, stored whole
    pieces: tuple[Piece, ...]

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for d in self.shape:
            n *= d
        return n


@dataclass
class Manifest:
    variables: dict[str, VariableEntry]
    extra: dict[str, Any] = field(default_factory=dict)
    save_id: str = ""

    def files(self) -> set[str]:
        return {p.file for v in self.variables.values() for p in v.pieces}

    def to_json(self) -> str:
        out = {
            "format": FORMAT,
            "version": VERSION,
            "save_id": self.save_id,
            "extra": self.extra,
            "variables": {
                name: {
                    "dtype": str(v.dtype).removeprefix("torch."),
                    "shape": list(v.shape),
                    "layout": None
                    if v.layout is None
                    else {"strategy": v.layout.strategy, "sizes": list(v.layout.sizes), "axis": v.layout.axis},
                    "pieces": [
                        {
                            "file": p.file,
                            "key": p.key,
                            "start": p.start,
                            "step": p.step,
                            "count": p.count,
                            "shape": list(p.shape),
                            "begin": p.begin,
                            "chunk_rows": p.chunk_rows,
                            "crc32": list(p.crc32),
                        }
                        for p in v.pieces
                    ],
                }
                for name, v in self.variables.items()
            },
        }
        return json.dumps(out, indent=1)

    @classmethod
    def read(cls, directory: str | os.PathLike) -> Manifest:
        """Read and validate ``directory/manifest.json``."""
        path = Path(directory) / MANIFEST
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raise CheckpointError(f"no checkpoint at {directory}: {MANIFEST} is missing") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{path} does not parse as JSON: {e}") from None
        if not isinstance(raw, dict) or raw.get("format") != FORMAT:
            raise CheckpointError(f'{path} is not a shardvar checkpoint manifest (no "format": {FORMAT!r})')
        if raw.get("version") != VERSION:
            raise CheckpointError(f"{path} has format version {raw.get('version')!r}; this shardvar reads {VERSION}")
        try:
            variables = {name: _variable(name, v) for name, v in raw["variables"].items()}
        except CheckpointError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise CheckpointError(f"{path} is malformed: {type(e).__name__}: {e}") from None
        return cls(variables, raw.get("extra") or {}, str(raw.get("save_id", "")))


def _variable(name: str, v: dict) -> VariableEntry:
    dtype = _DTYPES.get(v["dtype"])
    if dtype is None:
        raise CheckpointError(f"variable {name!r} has unknown dtype {v['dtype']!r}; known: {sorted(_DTYPES)}")
    shape = tuple(int(d) for d in v["shape"])
    layout = None
    if v["layout"] is not None:
        try:
            spec = v["layout"]
            layout = Layout(spec["strategy"], tuple(spec["sizes"]), int(spec["axis"]))
            layout.check_shape(shape)
        except (ShardvarError, KeyError, TypeError) as e:
            raise CheckpointError(f"variable {name!r} has an invalid layout {v['layout']!r}: {e}") from None
    pieces = []
    for p in v["pieces"]:
        if not isinstance(p["file"], str) or not _FILE_NAME.match(p["file"]) or p["file"].startswith("."):
            raise CheckpointError(
                f"variable {name!r} names file {p['file']!r}, which is not a plain file name inside the checkpoint"
            )
        pieces.append(
            Piece(
                p["file"],
                str(p["key"]),
                int(p["start"]),
                int(p["step"]),
                int(p["count"]),
                tuple(int(d) for d in p["shape"]),
                int(p["chunk_rows"]),
                tuple(int(c) for c in p["crc32"]),
                int(p["begin"]),
            )
        )
    _check_cover(name, shape, layout, pieces)
    return VariableEntry(name, dtype, shape, layout, tuple(pieces))


def _check_cover(name: str, shape: tuple[int, ...], layout: Layout | None, pieces: list[Piece]) -> None:
    # One piece per shard of the saved layout, in shard order, each holding that shard's indices.
    if layout is None:
        if len(pieces) != 1 or pieces[0].shape != shape:
            raise CheckpointError(f"variable {name!r}: a 0-d variable needs one piece of shape {list(shape)}")
        return
    if len(pieces) != layout.num_shards:
        raise CheckpointError(
            f"variable {name!r}: layout {layout} has {layout.num_shards} shards but {len(pieces)} pieces"
        )
    for s, p in enumerate(pieces):
        expected_shape = layout.shard_shape(shape, s)
        if (p.start, p.step, p.count) != layout.shard_progression(s) or p.shape != expected_shape:
            raise CheckpointError(
                f"variable {name!r}, piece {p.key!r}: stores indices ({p.start}, {p.step}, {p.count}) with shape "
                f"{list(p.shape)}; layout {layout} expects {layout.shard_progression(s)} "
                f"with shape {list(expected_shape)}"
            )
        rows = p.shape[0] if p.shape else 1
        if p.chunk_rows < 1 or len(p.crc32) != max(1, -(-rows // p.chunk_rows)):
            raise CheckpointError(f"variable {name!r}, piece {p.key!r}: {len(p.crc32)} checksums for {rows} rows")
