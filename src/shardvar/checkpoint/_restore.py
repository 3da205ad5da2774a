"""Restoring one target shard of a stored variable, in any layout, reading only what it needs.

A stored piece holds logical indices ``start + step * i`` along the saved axis. For a target
shard we find the piece rows (dim 0 of the stored piece) it needs, read just the row chunks that
hold them (a few MiB at a time, checksums verified), and place the selected elements with one
``index_put_``. Peak memory: the target shard plus a few chunks.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

import torch

from ..layout import Layout
from ._manifest import CheckpointError, Piece, VariableEntry
from ._safetensors import read_chunks

__all__ = ["Files", "whole_layout", "restore_shard", "verify_shard"]

_RUN_CHUNKS = 4  # chunks read at once


class Files:
    """Open data files of one checkpoint directory, each opened once."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._open: dict[str, BinaryIO] = {}

    def get(self, name: str, variable: str) -> BinaryIO:
        if name not in self._open:
            path = self.directory / name
            try:
                self._open[name] = open(path, "rb")  # noqa: SIM115 (closed in close())
            except FileNotFoundError:
                raise CheckpointError(f"file {path} of variable {variable!r} is missing") from None
        return self._open[name]

    def size(self, name: str, variable: str) -> int:
        return os.fstat(self.get(name, variable).fileno()).st_size

    def close(self) -> None:
        for f in self._open.values():
            f.close()
        self._open.clear()

    def __enter__(self) -> Files:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def whole_layout(entry: VariableEntry) -> Layout | None:
    """A one-shard layout covering the whole variable (None for a 0-d variable)."""
    if entry.layout is None:
        return None
    return Layout("div", (entry.shape[entry.layout.axis],), entry.layout.axis)


def _needed_rows(entry: VariableEntry, piece: Piece, target: Layout, shard: int) -> torch.Tensor | None:
    """Piece rows (dim 0) the target shard needs, sorted; None for all of them."""
    if target.axis != 0:
        return None  # the target shard spans all of dim 0
    wanted = target.shard_ids(shard)
    if entry.layout.axis != 0:
        return wanted
    offset = wanted - piece.start
    keep = (offset % piece.step == 0) & (offset >= 0) & (offset < piece.step * piece.count)
    return (offset[keep] // piece.step).sort().values


def _runs(piece: Piece, rows: torch.Tensor | None) -> Iterator[tuple[int, int]]:
    """(first, last) chunk runs holding ``rows``, at most _RUN_CHUNKS chunks each."""
    total = max(1, -(-(piece.shape[0] if piece.shape else 1) // piece.chunk_rows))
    chunks = range(total) if rows is None else torch.unique(rows // piece.chunk_rows).tolist()
    run: list[int] = []
    for c in chunks:
        if run and (c != run[-1] + 1 or len(run) == _RUN_CHUNKS):
            yield run[0], run[-1]
            run = []
        run.append(c)
    if run:
        yield run[0], run[-1]


def _place(
    out: torch.Tensor, block: torch.Tensor, b0: int, entry: VariableEntry, piece: Piece, target: Layout, shard: int
) -> None:
    src_axis, tgt_axis = entry.layout.axis, target.axis
    dims = sorted({0, src_axis, tgt_axis})
    target_positions = []
    for d in dims:
        if d == 0:
            local = torch.arange(b0, b0 + block.shape[0])
            logical = piece.start + piece.step * local if src_axis == 0 else local
        elif d == src_axis:
            logical = piece.start + piece.step * torch.arange(piece.count)
        else:
            logical = torch.arange(block.shape[d])
        if d == tgt_axis:
            owner, row = target.locate(logical, check=False)
            mine = torch.nonzero(owner == shard).squeeze(1)
            if mine.numel() != logical.numel():
                block = block.index_select(d, mine)
            target_positions.append(row.index_select(0, mine))
        else:
            target_positions.append(logical)
    if block.numel() == 0:
        return
    k = len(dims)
    index = tuple(p.reshape([-1 if i == j else 1 for j in range(k)]) for i, p in enumerate(target_positions))
    out.movedim(dims, list(range(k))).index_put_(index, block.movedim(dims, list(range(k))))


def _check_file(files: Files, entry: VariableEntry, piece: Piece) -> None:
    end = piece.begin + _nbytes(entry, piece)
    size = files.size(piece.file, entry.name)
    if size < end:
        raise CheckpointError(
            f"file {files.directory / piece.file} of variable {entry.name!r} is truncated: {size} bytes, "
            f"piece {piece.key!r} ends at byte {end}"
        )


def _nbytes(entry: VariableEntry, piece: Piece) -> int:
    n = entry.dtype.itemsize
    for d in piece.shape:
        n *= d
    return n


def _read(files: Files, entry: VariableEntry, piece: Piece, first: int, last: int, verify: bool) -> torch.Tensor:
    try:
        return read_chunks(files.get(piece.file, entry.name), piece.stored(entry.dtype), first, last, verify)
    except ValueError as e:
        raise CheckpointError(f"file {files.directory / piece.file}, variable {entry.name!r}: {e}") from None


def restore_shard(
    files: Files, entry: VariableEntry, target: Layout | None, shard: int = 0, verify: bool = True
) -> torch.Tensor:
    """Shard ``shard`` of ``entry`` laid out by ``target`` (None: the whole variable), as a new tensor."""
    if entry.layout is None:
        piece = entry.pieces[0]
        _check_file(files, entry, piece)
        return _read(files, entry, piece, 0, 0, verify).clone()
    target = target or whole_layout(entry)
    out = torch.empty(target.shard_shape(entry.shape, shard), dtype=entry.dtype)
    for piece in entry.pieces:
        rows = _needed_rows(entry, piece, target, shard)
        if rows is not None and rows.numel() == 0:
            continue
        _check_file(files, entry, piece)
        for first, last in _runs(piece, rows):
            block = _read(files, entry, piece, first, last, verify)
            _place(out, block, first * piece.chunk_rows, entry, piece, target, shard)
    return out


def verify_shard(files: Files, entry: VariableEntry, target: Layout | None, shard: int = 0) -> None:
    """Read and checksum every chunk :func:`restore_shard` would read, keeping nothing."""
    if entry.layout is None:
        _check_file(files, entry, entry.pieces[0])
        _read(files, entry, entry.pieces[0], 0, 0, True)
        return
    target = target or whole_layout(entry)
    for piece in entry.pieces:
        rows = _needed_rows(entry, piece, target, shard)
        if rows is not None and rows.numel() == 0:
            continue
        _check_file(files, entry, piece)
        for first, last in _runs(piece, rows):
            _read(files, entry, piece, first, last, True)
