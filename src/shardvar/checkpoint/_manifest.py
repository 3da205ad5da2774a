"""The checkpoint manifest: what each logical variable is and where its pieces lie.

See docs/checkpoint-format.md. The manifest carries a sha256 of its own canonical JSON, so a
changed byte anywhere refuses to load; reading validates the whole document against the format
(types, ranges, consistency) before anything is allocated, with a message naming the file and
the variable.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .._errors import CheckpointError, ShardvarError
from ..layout import Layout
from ._files import open_regular
from ._safetensors import CHECKSUM, CHECKSUMS, DTYPE_CODES, StoredTensor

__all__ = [
    "CheckpointError", "Piece", "VariableEntry", "Manifest", "MANIFEST", "FORMAT", "VERSION", "READABLE", "ROLES",
]  # fmt: skip

MANIFEST = "manifest.json"
FORMAT = "shardvar-checkpoint"
VERSION = 3  # 3: chunk checksums are xxh3_64; version 2 (crc32) is still read
READABLE = {2: "crc32", 3: "xxh3_64"}  # version -> its chunk checksum
MAX_MANIFEST_BYTES = 256 << 20
_FILE_NAME = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9_.-]*\.safetensors$")
_DTYPES = {str(d).removeprefix("torch."): d for d in DTYPE_CODES}
_BIG = 1 << 62  # no size, offset or count in a real checkpoint comes near this
# A variable's optional "role": what the saver knew it to be. "table": an embedding table (its rows are
# looked up by id; ``shardvar.quantize(path, ...)`` packs these), "other": anything else (dense layers,
# optimizer state, buffers). No field (checkpoints written before it, or a bare tensor or sharded
# variable saved without a module to say): unknown, ``role`` None.
ROLES = ("table", "other")


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
    sums: tuple[int, ...]  # one checksum per chunk of ``chunk_rows`` rows
    begin: int  # byte offset of its data in ``file``
    checksum: str = CHECKSUM  # which function made ``sums`` (a name in CHECKSUMS)

    def stored(self, dtype: torch.dtype) -> StoredTensor:
        return StoredTensor(self.key, self.shape, dtype, self.begin, self.chunk_rows, self.sums, self.checksum)

    def to_json(self) -> dict[str, Any]:
        return {
            "file": self.file,
            "key": self.key,
            "start": self.start,
            "step": self.step,
            "count": self.count,
            "shape": list(self.shape),
            "begin": self.begin,
            "chunk_rows": self.chunk_rows,
            self.checksum: list(self.sums),
        }


@dataclass(frozen=True)
class VariableEntry:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    layout: Layout | None  # None for a 0-d tensor, stored whole
    pieces: tuple[Piece, ...]
    role: str | None = None  # one of ROLES, or None: unknown

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
    checksum: str = ""  # of the manifest as read (set by ``read``; a delta names its base by it)

    def files(self) -> set[str]:
        return {p.file for v in self.variables.values() for p in v.pieces}

    def _body(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": VERSION,
            "save_id": self.save_id,
            "extra": self.extra,
            "variables": {
                name: {
                    "dtype": str(v.dtype).removeprefix("torch."),
                    "shape": list(v.shape),
                    "layout": None if v.layout is None else v.layout.to_json(),
                    "pieces": [p.to_json() for p in v.pieces],
                    **({} if v.role is None else {"role": v.role}),
                }
                for name, v in self.variables.items()
            },
        }

    def to_json(self) -> str:
        body = self._body()
        return json.dumps({"checksum": _checksum(body), **body}, indent=1, allow_nan=False)

    @classmethod
    def read(cls, directory: str | Path) -> Manifest:
        """Read, verify and validate ``directory/manifest.json`` (a path to the file itself works too)."""
        path = Path(directory)
        if path.name == MANIFEST and not path.is_dir():
            path = path.parent
        return parse(_load_json(path / MANIFEST), path / MANIFEST)


def _checksum(body: dict[str, Any]) -> str:
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False, ensure_ascii=True)
    return "sha256:" + hashlib.sha256(canonical.encode()).hexdigest()


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not a number a manifest may hold")


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [k for k, _ in pairs]
    if len(set(keys)) != len(keys):
        raise ValueError(f"duplicate key {next(k for k in keys if keys.count(k) > 1)!r}")
    return dict(pairs)


def _load_json(path: Path) -> Any:
    with open_regular(path, f"no checkpoint at {path.parent}: {MANIFEST}") as f:
        size = os.fstat(f.fileno()).st_size
        if size > MAX_MANIFEST_BYTES:
            raise CheckpointError(f"{path} is {size} bytes; a manifest holds at most {MAX_MANIFEST_BYTES}")
        raw = f.read()
    try:
        return json.loads(raw.decode("utf-8"), parse_constant=_no_constants, object_pairs_hook=_unique_keys)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise CheckpointError(f"{path} does not parse as JSON: {type(e).__name__}: {str(e)[:200]}") from None


def parse(raw: Any, path: Path) -> Manifest:
    """The manifest ``raw`` (parsed JSON) describes, after checking its checksum and every field."""
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        raise CheckpointError(f'{path} is not a shardvar checkpoint manifest (no "format": {FORMAT!r})')
    if type(raw.get("version")) is not int or raw["version"] not in READABLE:
        raise CheckpointError(
            f"{path} has format version {raw.get('version')!r:.40}; this shardvar reads versions {sorted(READABLE)} "
            "(version 1 manifests carry no checksum: re-save them with the shardvar that wrote them)"
        )
    body = {k: v for k, v in raw.items() if k != "checksum"}
    if raw.get("checksum") != _checksum(body):
        raise CheckpointError(f"{path} is damaged: its checksum does not match its contents; refusing to load it")
    _check_keys(raw, {"checksum", "format", "version", "save_id", "extra", "variables"}, str(path))
    save_id, extra, variables = raw["save_id"], raw["extra"], raw["variables"]
    if not isinstance(save_id, str) or not re.fullmatch(r"[0-9a-f]{0,64}", save_id):
        raise CheckpointError(f"{path}: save_id must be a hex string; got {save_id!r:.80}")
    if not isinstance(extra, dict) or not isinstance(variables, dict):
        raise CheckpointError(f"{path}: 'extra' and 'variables' must be objects")
    try:
        checksum = READABLE[raw["version"]]
        entries = {_name(n): _variable(n, v, checksum) for n, v in variables.items()}
    except CheckpointError as e:
        raise CheckpointError(f"{path}: {e}") from None
    return Manifest(entries, extra, save_id, raw["checksum"])


def _check_keys(obj: Any, keys: set[str], where: str) -> dict:
    if not isinstance(obj, dict) or set(obj) != keys:
        got = sorted(obj) if isinstance(obj, dict) else type(obj).__name__
        raise CheckpointError(f"{where} must have exactly the fields {sorted(keys)}; got {got}")
    return obj


def _name(name: Any) -> str:
    if not isinstance(name, str) or not name or len(name) > 4096:
        raise CheckpointError(f"variable names must be non-empty strings; got {name!r:.80}")
    return name


def _int(value: Any, what: str, minimum: int = 0, maximum: int = _BIG) -> int:
    if type(value) is not int or not minimum <= value <= maximum:
        raise CheckpointError(f"{what} must be an integer in [{minimum}, {maximum}]; got {value!r:.60}")
    return value


def _ints(value: Any, what: str, minimum: int = 0, maximum: int = _BIG, limit: int = 64) -> tuple[int, ...]:
    if not isinstance(value, list) or len(value) > limit:
        raise CheckpointError(f"{what} must be a list of at most {limit} integers; got {value!r:.60}")
    return tuple(_int(v, what, minimum, maximum) for v in value)


def _variable(name: str, v: Any, checksum: str) -> VariableEntry:
    where = f"variable {name!r}"
    fields = {"dtype", "shape", "layout", "pieces"}
    _check_keys(v, fields | ({"role"} & set(v)) if isinstance(v, dict) else fields, where)
    role = v.get("role")
    if "role" in v and role not in ROLES:
        raise CheckpointError(f"{where} has role {role!r:.40}; a role is one of {list(ROLES)} (or absent: unknown)")
    dtype = _DTYPES.get(v["dtype"]) if isinstance(v["dtype"], str) else None
    if dtype is None:
        raise CheckpointError(f"{where} has unknown dtype {v['dtype']!r:.40}; known: {sorted(_DTYPES)}")
    shape = _ints(v["shape"], f"{where} shape")
    layout = None
    if v["layout"] is not None:
        try:
            layout = Layout.from_json(v["layout"])
            layout.check_shape(shape)
        except ShardvarError as e:
            raise CheckpointError(f"{where} has an invalid layout {v['layout']!r:.200}: {e}") from None
    if not isinstance(v["pieces"], list) or len(v["pieces"]) > (layout.num_shards if layout else 1):
        raise CheckpointError(f"{where}: pieces must be a list with one piece per saved shard")
    pieces = [_piece(where, p, checksum) for p in v["pieces"]]
    _check_cover(name, shape, layout, pieces)
    return VariableEntry(name, dtype, shape, layout, tuple(pieces), role)


_PIECE_KEYS = {"file", "key", "start", "step", "count", "shape", "begin", "chunk_rows"}


def _piece(where: str, p: Any, checksum: str) -> Piece:
    _check_keys(p, _PIECE_KEYS | {checksum}, f"{where}: a piece")
    if not isinstance(p["file"], str) or not _FILE_NAME.match(p["file"]):
        raise CheckpointError(
            f"{where} names file {p['file']!r:.80}, which is not a plain file name inside the checkpoint"
        )
    if not isinstance(p["key"], str) or len(p["key"]) > 4096:
        raise CheckpointError(f"{where}: a piece's key must be a string; got {p['key']!r:.80}")
    return Piece(
        p["file"],
        p["key"],
        _int(p["start"], f"{where} start"),
        _int(p["step"], f"{where} step", 1),
        _int(p["count"], f"{where} count"),
        _ints(p["shape"], f"{where} piece shape"),
        _int(p["chunk_rows"], f"{where} chunk_rows", 1),
        _ints(p[checksum], f"{where} {checksum}", 0, CHECKSUMS[checksum][1], limit=1 << 24),
        _int(p["begin"], f"{where} begin"),
        checksum,
    )


def _check_cover(name: str, shape: tuple[int, ...], layout: Layout | None, pieces: list[Piece]) -> None:
    # One piece per shard of the saved layout, in shard order, each holding that shard's indices.
    if layout is None:
        if len(shape) != 0 or len(pieces) != 1 or pieces[0].shape != shape:
            raise CheckpointError(f"variable {name!r}: a 0-d variable needs one piece of shape {list(shape)}")
        if len(pieces[0].sums) != 1:
            raise CheckpointError(f"variable {name!r}: a 0-d piece has one checksum")
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
        if len(p.sums) != max(1, -(-rows // p.chunk_rows)):
            raise CheckpointError(f"variable {name!r}, piece {p.key!r}: {len(p.sums)} checksums for {rows} rows")
