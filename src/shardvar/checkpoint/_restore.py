"""Restoring one target shard of a stored variable, in any layout, reading only what it needs.

A stored piece holds logical indices ``start + step * i`` along the saved axis. For a target
shard we find the piece rows (dim 0 of the stored piece) it needs, read just the row chunks that
hold them (a few MiB at a time, checksums verified), and place the selected elements with one
``index_put_``. Peak memory: the target shard plus a few chunks.
"""

from __future__ import annotations

import contextlib
import mmap
import os
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch

from .._pages import empty
from ..layout import Layout, intersect_progressions
from ._files import open_regular
from ._manifest import CheckpointError, Piece, VariableEntry
from ._safetensors import CHECKSUMS, read_chunks

__all__ = ["Files", "whole_layout", "restore_shard", "restore_shards", "verify_shards", "restore_into"]

_RUN_CHUNKS = 4  # chunks read at once


class Files:
    """Open data files of one checkpoint directory, each opened once, and one reused read buffer."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._open: dict[str, BinaryIO] = {}
        self._maps: dict[str, mmap.mmap | None] = {}
        self.pending: list[Future] = []  # chunks read straight into new tensors, being hashed
        self._scratch = torch.empty(0, dtype=torch.uint8)
        self.pool = ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1))

    def scratch(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        # One buffer for every block read: allocating a fresh one per block fragments the heap
        # and grows the address space far beyond the memory actually in use.
        nbytes = dtype.itemsize
        for d in shape:
            nbytes *= d
        if self._scratch.numel() < nbytes:
            self._scratch = empty(nbytes, dtype=torch.uint8)
        return self._scratch[:nbytes].view(dtype).reshape(shape)

    def get(self, name: str, variable: str) -> BinaryIO:
        if name not in self._open:
            path = self.directory / name
            self._open[name] = open_regular(path, f"file {path} of variable {variable!r}")
        return self._open[name]

    def size(self, name: str, variable: str) -> int:
        return os.fstat(self.get(name, variable).fileno()).st_size

    def mapped(self, name: str, variable: str) -> memoryview:
        """The file mapped read-only: verifying straight from the page cache copies nothing."""
        if name not in self._maps:
            f = self.get(name, variable)
            size = os.fstat(f.fileno()).st_size
            self._maps[name] = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ) if size else None
        mapped = self._maps[name]
        return memoryview(mapped) if mapped is not None else memoryview(b"")

    def close(self) -> None:
        for m in self._maps.values():
            if m is not None:
                with contextlib.suppress(BufferError):  # a view still alive: closed when dropped
                    m.close()
        self._maps.clear()
        for f in self._open.values():
            f.close()
        self._open.clear()
        self.pool.shutdown()

    def __enter__(self) -> Files:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def whole_layout(entry: VariableEntry) -> Layout | None:
    """A one-shard layout covering the whole variable (None for a 0-d variable)."""
    if entry.layout is None:
        return None
    return Layout("div", (entry.shape[entry.layout.axis],), entry.layout.axis)


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


def _read(
    files: Files,
    entry: VariableEntry,
    piece: Piece,
    first: int,
    last: int,
    verify: bool,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    if out is None:
        stop = min(piece.shape[0] if piece.shape else 1, (last + 1) * piece.chunk_rows)
        shape = (stop - first * piece.chunk_rows, *piece.shape[1:]) if piece.shape else ()
        out = files.scratch(shape, entry.dtype)
    try:
        return read_chunks(
            files.get(piece.file, entry.name), piece.stored(entry.dtype), first, last, verify, out, files.pool
        )
    except ValueError as e:
        raise CheckpointError(f"file {files.directory / piece.file}, variable {entry.name!r}: {e}") from None


def _check_block(files: Files, entry: VariableEntry, piece: Piece, first: int, block: torch.Tensor) -> None:
    """Check the chunks ``first..`` that ``block`` (their rows, contiguous) holds."""
    stored = piece.stored(entry.dtype)
    data = memoryview(block.reshape(-1).view(torch.uint8).numpy()) if block.numel() else memoryview(b"")
    step, checksum = stored.chunk_rows * stored.row_bytes, CHECKSUMS[stored.checksum][0]
    for k in range(-(-len(data) // step) if step else 1):
        c = first + k
        if checksum(data[k * step : (k + 1) * step]) != stored.sums[c]:
            raise CheckpointError(
                f"file {files.directory / piece.file}, variable {entry.name!r}: checksum mismatch in tensor "
                f"{stored.key!r}, rows {c * stored.chunk_rows}.. (chunk {c})"
            )


def _read_into(
    files: Files, entry: VariableEntry, piece: Piece, first: int, last: int, out: torch.Tensor, verify: bool
) -> None:
    _read(files, entry, piece, first, last, False, out=out)
    if verify:
        _check_block(files, entry, piece, first, out)


def wait_pending(files: Files) -> None:
    """Wait for every read and check submitted to the pool; raise the first error (after all are done)."""
    pending, files.pending = files.pending, []
    errors = [f.exception() for f in pending]
    first = next((e for e in errors if e is not None), None)
    if first is not None:
        raise first


def restore_into(files: Files, entry: VariableEntry, target: Layout | None, outs: dict, verify: bool) -> None:
    """Fill ``outs`` (shard -> tensor) from the files; returns once every read on the pool is done."""
    try:
        _restore(files, entry, target, outs, verify)
    except BaseException:
        pending, files.pending = files.pending, []
        for f in pending:
            f.exception()  # let the reads finish (they write into ``outs``); this error is the one to report
        raise
    wait_pending(files)  # raises the first truncation or checksum mismatch


def _verify(files: Files, entry: VariableEntry, piece: Piece, first: int, last: int) -> None:
    """Check chunks ``first..last`` of ``piece`` in place in the mapped file, reading nothing into memory."""
    stored = piece.stored(entry.dtype)
    step = stored.chunk_rows * stored.row_bytes
    end = stored.begin + stored.rows * stored.row_bytes
    view = files.mapped(piece.file, entry.name)
    parts = [view[stored.begin + c * step : min(end, stored.begin + (c + 1) * step)] for c in range(first, last + 1)]
    checksum = CHECKSUMS[stored.checksum][0]
    sums = list(files.pool.map(checksum, parts)) if len(parts) > 1 else [checksum(p) for p in parts]
    for c, got in zip(range(first, last + 1), sums, strict=True):
        if got != stored.sums[c]:
            raise CheckpointError(
                f"file {files.directory / piece.file}, variable {entry.name!r}: checksum mismatch in tensor "
                f"{stored.key!r}, rows {c * stored.chunk_rows}.. (chunk {c})"
            )
    for p in parts:
        p.release()
    view.release()


@dataclass(frozen=True)
class _Overlap:
    """Indices a piece and one target shard share: piece rows j0 + dj*m, target rows i0 + di*m."""

    out: torch.Tensor | None
    j0: int
    dj: int
    i0: int
    di: int
    count: int

    def chunks(self, chunk_rows: int) -> Iterable[int]:
        if self.dj <= chunk_rows:  # members at most a chunk apart: every chunk in between holds one
            return range(self.j0 // chunk_rows, (self.j0 + self.dj * (self.count - 1)) // chunk_rows + 1)
        return torch.unique((self.j0 + self.dj * torch.arange(self.count)) // chunk_rows).tolist()

    def members(self, lo: int, hi: int) -> tuple[int, int]:
        """The range of m whose piece row lies in [lo, hi)."""
        return max(0, -(-(lo - self.j0) // self.dj)), min(self.count, -(-(hi - self.j0) // self.dj))


def _overlaps(piece: Piece, target: Layout, outs: dict[int, torch.Tensor | None]) -> list[_Overlap]:
    found = []
    for shard, out in outs.items():
        tstart, tstep, tcount = target.shard_progression(shard)
        x0, dx, count = intersect_progressions((piece.start, piece.step, piece.count), (tstart, tstep, tcount))
        if count:
            found.append(
                _Overlap(
                    out, (x0 - piece.start) // piece.step, dx // piece.step, (x0 - tstart) // tstep, dx // tstep, count
                )
            )
    return found


def _runs(chunks: Iterable[int]) -> Iterator[tuple[int, int]]:
    run: list[int] = []
    for c in chunks:
        if run and (c != run[-1] + 1 or len(run) == _RUN_CHUNKS):
            yield run[0], run[-1]
            run = []
        run.append(c)
    if run:
        yield run[0], run[-1]


def _restore_same_axis(
    files: Files, entry: VariableEntry, piece: Piece, target: Layout, outs: dict, verify: bool
) -> None:
    # A piece and each target shard hold progressions of indices along the same axis; so does
    # their intersection, which makes every copy a strided slice. Each chunk is read once.
    overlaps = _overlaps(piece, target, outs)
    if not overlaps:
        return
    _check_file(files, entry, piece)
    axis, rows = target.axis, piece.chunk_rows
    if axis != 0:
        for first, last in _runs(range(-(-max(piece.shape[0], 1) // rows))):
            block = _read(files, entry, piece, first, last, verify)
            for o in overlaps:
                if o.out is not None:
                    window = o.out.narrow(0, first * rows, block.shape[0])
                    _at(window, axis, o.i0, o.di, o.count).copy_(_at(block, axis, o.j0, o.dj, o.count))
        return
    chunks = sorted(set().union(*(o.chunks(rows) for o in overlaps)))
    if all(o.out is None for o in overlaps):  # a verifying pass: nothing to place
        for first, last in _runs(chunks):
            _verify(files, entry, piece, first, last)
        return
    for first, last in _runs(chunks):
        lo, hi = first * rows, min(piece.count, (last + 1) * rows)
        direct = [
            o for o in overlaps if o.out is not None and o.dj == o.di == 1 and o.j0 <= lo and hi <= o.j0 + o.count
        ]
        if direct:  # one target shard holds all these rows, in order: read straight into it
            o = direct[0]
            out = o.out.narrow(0, o.i0 + lo - o.j0, hi - lo)
            # Read (and hashed) on the pool, several runs at once: from the page cache two threads
            # copy twice as fast as one. ``wait_pending`` (restore_shards calls it) collects them.
            files.pending.append(files.pool.submit(_read_into, files, entry, piece, first, last, out, verify))
            continue
        block = _read(files, entry, piece, first, last, verify)
        for o in overlaps:
            m_lo, m_hi = o.members(lo, hi)
            if o.out is not None and m_hi > m_lo:
                _at(o.out, 0, o.i0 + m_lo * o.di, o.di, m_hi - m_lo).copy_(
                    _at(block, 0, o.j0 + m_lo * o.dj - lo, o.dj, m_hi - m_lo)
                )


def _at(t: torch.Tensor, axis: int, start: int, step: int, count: int) -> torch.Tensor:
    return t[(slice(None),) * axis + (slice(start, start + step * (count - 1) + 1, step),)]


def _restore(
    files: Files, entry: VariableEntry, target: Layout | None, outs: dict[int, torch.Tensor | None], verify: bool
) -> None:
    if entry.layout is None:
        piece = entry.pieces[0]
        _check_file(files, entry, piece)
        block = _read(files, entry, piece, 0, 0, verify)
        for out in outs.values():
            if out is not None:
                out.copy_(block.reshape(out.shape))
        return
    target = target or whole_layout(entry)
    for piece in entry.pieces:
        if target.axis == entry.layout.axis:
            _restore_same_axis(files, entry, piece, target, outs, verify)
            continue
        _check_file(files, entry, piece)
        for first, last in _runs(range(-(-max(piece.shape[0], 1) // piece.chunk_rows))):
            block = _read(files, entry, piece, first, last, verify)
            for shard, out in outs.items():
                if out is not None:
                    _place(out, block, first * piece.chunk_rows, entry, piece, target, shard)


def _new(entry: VariableEntry, target: Layout | None, shard: int) -> torch.Tensor:
    if entry.layout is None:
        return empty(entry.shape, dtype=entry.dtype)
    return empty((target or whole_layout(entry)).shard_shape(entry.shape, shard), dtype=entry.dtype)


def restore_shards(
    files: Files, entry: VariableEntry, target: Layout | None, shards: list[int], verify: bool = True
) -> list[torch.Tensor]:
    """Shards ``shards`` of ``entry`` laid out by ``target`` (None: the whole variable), as new tensors.

    Each stored chunk is read once, whichever shards need it.
    """
    outs = {s: _new(entry, target, s) for s in shards}
    restore_into(files, entry, target, outs, verify)
    return [outs[s] for s in shards]


def restore_shard(
    files: Files, entry: VariableEntry, target: Layout | None, shard: int = 0, verify: bool = True
) -> torch.Tensor:
    """One shard of ``entry`` laid out by ``target`` (None: the whole variable), as a new tensor."""
    return restore_shards(files, entry, target, [shard], verify)[0]


def verify_shards(files: Files, entry: VariableEntry, target: Layout | None, shards: list[int]) -> None:
    """Read and checksum every chunk :func:`restore_shards` would read, keeping nothing."""
    _restore(files, entry, target, dict.fromkeys(shards), True)
