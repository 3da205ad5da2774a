"""A TensorFlow checkpoint as logical variables: a sliced variable is one tensor of its full shape.

Rows are read straight from the data files into the result (no whole-table buffer), and every
entry's crc32c is computed over its bytes as they stream past, in order; bytes a read skipped are
read and checked by :meth:`TFCheckpoint.verify` before anything built from them is committed.
"""

from __future__ import annotations

import difflib
import math
import os
import re
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import google_crc32c
import numpy as np
import torch

from .._errors import CheckpointError
from ._bundle import DTYPES, STRING, Bundle, dtype_name
from ._graph import GRAPH_KEY, VALUE_SUFFIX, ObjectGraph, Slot, saver_slots, short_name
from ._proto import BundleEntryProto
from ._slices import describe, slice_key

__all__ = ["TFCheckpoint", "TFVariable", "Piece", "resolve_prefix"]

CHUNK_BYTES = 8 << 20  # the largest read buffer: what a strided or partial-width read holds at once


@dataclass(frozen=True)
class Piece:
    """One stored slice: where it lies in the variable (per axis), its table entry, how errors name it."""

    key: bytes
    offsets: tuple[int, ...]
    lengths: tuple[int, ...]
    entry: BundleEntryProto
    what: str  # ``tensor 'emb'``, or ``rows 7:10 of 'emb' (slice 7,3:0,4)``: never the encoded key


@dataclass(frozen=True)
class TFVariable:
    name: str
    dtype_code: int
    shape: tuple[int, ...]
    pieces: tuple[Piece, ...]
    sliced: bool

    @property
    def dtype_name(self) -> str:
        return dtype_name(self.dtype_code)


def resolve_prefix(path: str | os.PathLike) -> Path:
    """The checkpoint prefix ``path`` names: a prefix, its ``.index`` file, or a directory's latest checkpoint."""
    p = Path(path)
    if p.is_dir():
        state = p / "checkpoint"
        if not state.is_file():
            raise CheckpointError(f"{p} is a directory without a 'checkpoint' state file; pass a checkpoint prefix")
        found = re.search(r'^model_checkpoint_path:\s*"((?:[^"\\]|\\.)*)"', state.read_text(errors="replace"), re.M)
        if not found:
            raise CheckpointError(f"{state} names no model_checkpoint_path")
        latest = Path(found.group(1).encode().decode("unicode_escape"))
        prefix = latest if latest.is_absolute() else p / latest
        if not Path(f"{prefix}.index").exists() and Path(f"{p / latest.name}.index").exists():
            prefix = p / latest.name  # a checkpoint directory moved since its state file was written
        return prefix
    name = re.sub(r"\.(index|data-\d{5}-of-\d{5})$", "", p.name)
    return p.with_name(name)


class TFCheckpoint:
    """An open TensorFlow checkpoint (``shardvar.tf.list_variables`` and friends read through one)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.prefix = resolve_prefix(path)
        self.bundle = Bundle.open(self.prefix)
        self._progress: dict[bytes, tuple[int, int]] = {}  # entry key -> (bytes checked so far, their crc)
        self._verified: set[bytes] = set()
        self._checked: set[str] = set()
        self.variables: dict[str, TFVariable] = {}
        for key, entry in self.bundle.entries.items():
            if not key.startswith(b"\x00"):
                name = key.decode(errors="replace")
                self.variables[name] = self._variable(name, key, entry)

    def _variable(self, name: str, key: bytes, entry: BundleEntryProto) -> TFVariable:
        shape = tuple(d.size for d in entry.shape.dim)
        if entry.shape.unknown_rank or any(d < 0 for d in shape):
            raise CheckpointError(f"tensor {name!r} of {self.prefix} has an absurd shape {list(shape)}")
        if not entry.slices:
            whole = Piece(key, (0,) * len(shape), shape, entry, f"tensor {name!r}")
            return TFVariable(name, entry.dtype, shape, (whole,), False)
        pieces = []
        for s in entry.slices:
            extents = [(e.start, e.length if e.HasField("length") else -1) for e in s.extent]
            if len(extents) != len(shape):
                raise CheckpointError(f"a slice of {name!r} in {self.prefix} has {len(extents)} axes; shape {shape}")
            offsets = tuple(start if length >= 0 else 0 for start, length in extents)
            lengths = tuple(length if length >= 0 else n for (_, length), n in zip(extents, shape, strict=True))
            k, what = slice_key(name, extents), describe(name, list(zip(offsets, lengths, strict=True)))
            if k not in self.bundle.entries:
                raise CheckpointError(f"{what} is missing from {self.prefix}")
            pieces.append(Piece(k, offsets, lengths, self.bundle.entries[k], what))
        return TFVariable(name, entry.dtype, shape, tuple(pieces), True)

    # -- names ------------------------------------------------------------------------------------
    @cached_property
    def graph(self) -> ObjectGraph | None:
        if GRAPH_KEY not in self.variables:
            return None
        v = self.variables[GRAPH_KEY]
        if v.dtype_code != STRING or v.shape != ():
            raise CheckpointError(f"{GRAPH_KEY} of {self.prefix} is not a string scalar")
        return ObjectGraph.parse(self.bundle.read_strings(GRAPH_KEY, v.pieces[0].entry, 1)[0], str(self.prefix))

    def slots(self) -> list[Slot]:
        """Every optimizer slot variable: from the object graph, or by name in a TF1 Saver checkpoint."""
        return self.graph.slots if self.graph is not None else saver_slots(sorted(self.variables))

    def variable(self, name: str) -> TFVariable:
        """The variable ``name``: a checkpoint key, or an object-based key's short form (``model/emb``)."""
        if name in self.variables:
            return self.variables[name]
        key = self.graph.short_names.get(name) if self.graph is not None else None
        key = key or (name + VALUE_SUFFIX if name + VALUE_SUFFIX in self.variables else None)
        if key is None or key not in self.variables:
            names = {short_name(k) for k in self.variables}
            close = difflib.get_close_matches(name, sorted(names), n=3)
            raise CheckpointError(f"{self.prefix} has no variable {name!r}" + (f"; close: {close}" if close else ""))
        return self.variables[key]

    # -- reading ----------------------------------------------------------------------------------
    def dtype(self, v: TFVariable) -> torch.dtype:
        if v.dtype_code not in DTYPES:
            what = "a string tensor, not numbers" if v.dtype_code == STRING else "a dtype shardvar does not read"
            raise CheckpointError(f"variable {v.name!r} of {self.prefix} is {v.dtype_name}: {what}")
        return DTYPES[v.dtype_code]

    def check(self, v: TFVariable) -> None:
        """Refuse, before allocating, a variable whose slices do not tile it or whose bytes are not there."""
        if v.name in self._checked:
            return
        itemsize = self.dtype(v).itemsize
        for p in v.pieces:
            if p.entry.dtype != v.dtype_code or tuple(d.size for d in p.entry.shape.dim) != p.lengths:
                raise CheckpointError(f"{p.what} has another dtype or shape than the variable")
            if any(o < 0 or o + n > d for o, n, d in zip(p.offsets, p.lengths, v.shape, strict=True)):
                raise CheckpointError(f"{p.what} lies outside {list(v.shape)}")
            self.bundle.check_extent(p.what, p.entry, math.prod(p.lengths) * itemsize)
        if sum(math.prod(p.lengths) for p in v.pieces) != math.prod(v.shape) or _overlap(v.pieces):
            raise CheckpointError(f"the slices of {v.name!r} in {self.prefix} do not cover {list(v.shape)} exactly")
        self._checked.add(v.name)

    def read_rows(
        self, v: TFVariable, start: int, stop: int, step: int = 1, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Rows ``start:stop:step`` (axis 0) of ``v``, into ``out`` if given (of their shape); a 0-d variable whole."""
        self.check(v)
        dtype = self.dtype(v)
        if not v.shape:
            out = torch.empty((), dtype=dtype)
            self._read(v.pieces[0], out.reshape(1), 0, 1, 1, ())
            return out
        shape = (len(range(start, stop, step)), *v.shape[1:])
        if out is None:
            out = torch.empty(shape, dtype=dtype)
        elif tuple(out.shape) != shape or out.dtype != dtype or not out.is_contiguous():
            raise ValueError(
                f"out is {list(out.shape)} {out.dtype}; rows {start}:{stop}:{step} of {v.name!r} need {shape}"
            )
        for p in v.pieces:
            first = max(start, p.offsets[0] + (start - p.offsets[0]) % step) if p.offsets[0] > start else start
            last = min(stop, p.offsets[0] + p.lengths[0])
            if first < last:
                cols = tuple(slice(o, o + n) for o, n in zip(p.offsets[1:], p.lengths[1:], strict=True))
                dst = out[(first - start) // step :]
                self._read(p, dst, first - p.offsets[0], last - p.offsets[0], step, cols)
        return out

    def _read(self, p: Piece, out: torch.Tensor, a: int, b: int, step: int, cols: tuple) -> None:
        """Local rows ``a:b:step`` of piece ``p`` into ``out[0], out[1], ...`` (their columns ``cols``)."""
        row_bytes = math.prod(p.lengths[1:]) * out.dtype.itemsize
        if row_bytes == 0 or a >= b:
            self._feed(p, 0, np.empty(0, dtype=np.uint8))  # an empty entry's crc is checked here
            return
        checked = self._progress.get(p.key, (0, 0))[0]
        begin = a if p.key in self._verified else min(a, checked // row_bytes)  # re-read skipped rows for the crc
        whole = step == 1 and tuple(p.lengths[1:]) == tuple(out.shape[1:])
        per_chunk = max(1, CHUNK_BYTES // row_bytes)
        scratch = None  # one read buffer for the whole piece: a new one per chunk would double the peak
        for r in range(begin, b, per_chunk):
            end = min(b, r + per_chunk)
            direct = whole and r >= a  # straight into the result: no buffer, no copy
            if direct:
                buffer = out[r - a : end - a]
            else:
                if scratch is None:
                    scratch = torch.empty((min(per_chunk, b - begin), *p.lengths[1:]), dtype=out.dtype)
                buffer = scratch[: end - r]
            raw = buffer.reshape(-1).view(torch.uint8).numpy()
            self.bundle.read_into(p.what, p.entry, r * row_bytes, memoryview(raw))
            self._feed(p, r * row_bytes, raw)
            first = a + -(-max(r - a, 0) // step) * step  # the first wanted row at or after r
            if not direct and first < end:
                at = (first - a) // step
                out[at : at + len(range(first, end, step))][(slice(None), *cols)] = buffer[first - r :: step]

    def _feed(self, p: Piece, offset: int, raw: object) -> None:
        if p.key in self._verified:
            return
        checked, crc = self._progress.get(p.key, (0, 0))
        if offset != checked:
            return
        crc = google_crc32c.extend(crc, raw)
        checked += len(raw)
        if checked == p.entry.size:
            self.bundle.verify(p.what, p.entry, crc)
            self._verified.add(p.key)
        self._progress[p.key] = (checked, crc)

    def verify(self, v: TFVariable) -> None:
        """Check the crc32c of every byte of ``v`` that reads so far skipped."""
        self.check(v)
        for p in v.pieces:
            while p.key not in self._verified:
                checked = self._progress.get(p.key, (0, 0))[0]
                raw = torch.empty(min(CHUNK_BYTES, p.entry.size - checked), dtype=torch.uint8).numpy()
                self.bundle.read_into(p.what, p.entry, checked, memoryview(raw))
                self._feed(p, checked, raw)

    def load(self, name: str) -> torch.Tensor:
        v = self.variable(name)
        return self.read_rows(v, 0, v.shape[0] if v.shape else 1)


def _overlap(pieces: tuple[Piece, ...]) -> bool:
    ordered = sorted(pieces, key=lambda p: p.offsets)
    for i, p in enumerate(ordered):
        for q in ordered[i + 1 :]:
            if q.offsets and q.offsets[0] >= p.offsets[0] + p.lengths[0]:
                break
            if all(
                qo < po + pn and po < qo + qn
                for po, pn, qo, qn in zip(p.offsets, p.lengths, q.offsets, q.lengths, strict=True)
            ):
                return True
    return False
