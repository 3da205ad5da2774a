"""Serving reads: look rows up straight from a checkpoint's files, without loading the table.

``shardvar.open(path)`` maps the data files (``mmap``, private, never written) and answers
``lookup(ids)`` by reading only the rows asked; each chunk a lookup touches is checksummed the
first time it is read. Many processes can serve one checkpoint (the page cache is shared). A save
that replaces the checkpoint while it is served is noticed (the manifest changed) and the reader
re-opens it, so a lookup returns rows of one verified version. A delta checkpoint is served
through its chain: rows from the link holding the table whole, overridden by the later deltas'
changed rows (kept in memory, deduplicated, newest wins).
"""

from __future__ import annotations

import contextlib
import math
import mmap
import os
from pathlib import Path
from typing import Any

import torch

from .._errors import CheckpointError
from .._pages import empty
from .._validate import check_bool
from ..layout import as_ids, check_ids
from ._chain import Chain, RowChanges, checkpoint_directory
from ._files import open_regular
from ._manifest import MANIFEST, Piece, VariableEntry
from ._quantize import packed_format
from ._reshard import read_shard
from ._safetensors import CHECKSUMS

__all__ = ["open_checkpoint", "CheckpointReader", "ServedTable"]


class ServedTable:
    """One logical variable of a served checkpoint: ``lookup(ids)`` reads just those rows."""

    def __init__(self, reader: CheckpointReader, entry: VariableEntry, home: Path, changes: RowChanges | None) -> None:
        self._reader, self.entry, self._home, self._changes = reader, entry, home, changes
        self.format = packed_format(reader.manifest.extra, entry)  # packed rows: how to dequantize them
        self._verified: list[torch.Tensor] = [torch.zeros(len(p.sums), dtype=torch.bool) for p in entry.pieces]

    @property
    def shape(self) -> torch.Size:
        return torch.Size(self.entry.shape)

    @property
    def dtype(self) -> torch.dtype:
        return self.entry.dtype

    @property
    def packed(self) -> str | None:
        """The packed format of a quantized table (``"quint8"``, ``"quint4x2"``, ``"float16"``), else None."""
        return None if self.format is None else self.format.name

    def __repr__(self) -> str:
        packed = "" if self.format is None else f", packed={self.format.name!r}"
        return f"ServedTable({self.entry.name!r}, shape={list(self.shape)}, dtype={self.dtype}{packed})"

    def _piece(self, k: int) -> torch.Tensor:
        return self._reader._view(self._home, self.entry, self.entry.pieces[k])

    def _verify(self, k: int, rows: torch.Tensor) -> None:
        piece, done = self.entry.pieces[k], self._verified[k]
        chunks = torch.unique(rows // piece.chunk_rows)
        row_bytes = self.entry.dtype.itemsize * math.prod(piece.shape[1:])
        for c in chunks[~done[chunks]].tolist():  # each chunk once per reader
            # Read with pread, not through the map: verifying a chunk must not leave its pages in
            # this process's memory, only the rows a lookup reads.
            count = min(piece.chunk_rows, piece.shape[0] - c * piece.chunk_rows) * row_bytes
            data = self._reader._pread(self._home, piece.file, piece.begin + c * piece.chunk_rows * row_bytes, count)
            if CHECKSUMS[piece.checksum][0](data) != piece.sums[c]:
                raise CheckpointError(
                    f"checksum mismatch in {self._home / piece.file}, variable {self.entry.name!r}, "
                    f"rows {c * piece.chunk_rows}.. of piece {piece.key!r}"
                )
            done[c] = True

    def lookup(self, ids: Any, *, packed: bool = False) -> torch.Tensor:
        """Rows ``ids`` (any shape) of the variable, read from the files: shape ``ids.shape + row_shape``.

        A quantized table's rows come dequantized to float32 (``[..., dim]``), or as stored
        (``packed=True``: ``[..., width]`` bytes with their scale and bias, see :attr:`packed`).
        """
        rows = self._reader._consistent(lambda: self._lookup(ids))
        if self.format is None or check_bool(packed, "packed"):
            return rows
        return self.format.unpack(rows)

    def _lookup(self, ids: Any) -> torch.Tensor:
        layout = self.entry.layout
        if layout is None or layout.axis != 0:
            raise CheckpointError(f"variable {self.entry.name!r} is not split by rows; read it whole with read()")
        ids = as_ids(ids)
        check_ids(ids, layout.num_rows)
        flat = ids.reshape(-1)
        out = empty((flat.numel(), *self.entry.shape[1:]), dtype=self.entry.dtype)
        for k, pos, rows in layout.split_ids(flat):
            self._verify(k, rows)
            out.index_copy_(0, pos, self._piece(k).index_select(0, rows))
        changed = self._changes
        if changed is not None:  # rows a later delta replaced (ids sorted and unique)
            at = torch.searchsorted(changed.rows, flat).clamp_(max=changed.rows.numel() - 1)
            hit = changed.rows[at] == flat
            out[hit] = changed.values.index_select(0, at[hit]).to(out.dtype)
        return out.reshape((*ids.shape, *self.entry.shape[1:]))  # a tuple: 0-d ids of 1-D params give 0-d

    def read(self, *, packed: bool = False) -> torch.Tensor:
        """The whole variable (verified), as a new tensor; a quantized table dequantized unless ``packed``."""
        stored = read_shard(self._reader.directory, self.entry.name)
        return stored if self.format is None or check_bool(packed, "packed") else self.format.unpack(stored)


class CheckpointReader:
    """A checkpoint opened for serving: ``reader["name"].lookup(ids)``; close it, or use ``with``."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.directory = checkpoint_directory(path)
        self._maps: dict[tuple[Path, str], tuple[mmap.mmap | None, torch.Tensor, int]] = {}
        self._closed = False
        self._buffer = bytearray()
        self._open()

    def _identity(self) -> tuple[int, int]:
        st = os.stat(self.directory / MANIFEST, follow_symlinks=False)
        return st.st_ino, st.st_mtime_ns

    def _open(self) -> None:
        self._release()
        with Chain.open(self.directory) as chain:  # locked shared: no save half-way through while we look
            self.manifest = chain.newest.manifest
            self._seen = self._identity()
            for link in chain.links:
                for name in link.manifest.files():
                    self._maps[(link.directory, name)] = _map(link.directory / name)
            self._sources = {}
            for name in chain.names():
                entry, link, later = chain.source(name)
                self._sources[name] = (entry, link.directory, _merged(chain.changes(later, entry)))
        self._tables: dict[str, ServedTable] = {}

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError(f"the reader of {self.directory} is closed; open the checkpoint again")

    def _pread(self, home: Path, file: str, offset: int, count: int) -> memoryview:
        if len(self._buffer) < count:
            self._buffer = bytearray(count)
        view = memoryview(self._buffer)[:count]
        got = os.preadv(self._maps[(home, file)][2], [view], offset)
        if got != count:
            raise CheckpointError(f"file {home / file} is truncated")
        return view

    def _view(self, home: Path, entry: VariableEntry, piece: Piece) -> torch.Tensor:
        raw = self._maps[(home, piece.file)][1]
        nbytes = entry.dtype.itemsize
        for d in piece.shape:
            nbytes *= d
        if piece.begin + nbytes > raw.numel():
            raise CheckpointError(f"file {home / piece.file} of variable {entry.name!r} is truncated")
        return raw[piece.begin : piece.begin + nbytes].view(entry.dtype).view(piece.shape)

    def _consistent(self, read: Any) -> Any:
        # Rows come from one version: if a save replaced the checkpoint before or during the read,
        # re-open and read again (a save only reuses files after committing a new manifest).
        self._check_open()
        for _ in range(3):
            if self._identity() != self._seen:
                self._open()
            result = read()
            if self._identity() == self._seen:
                return result
        raise CheckpointError(f"{self.directory} kept changing while it was read; try again")

    def __getitem__(self, name: str) -> ServedTable:
        self._check_open()
        if self._identity() != self._seen:
            self._open()
        if name not in self._tables:
            if name not in self._sources:
                near = sorted(self._sources)[:5]
                raise CheckpointError(f"variable {name!r} is not in the checkpoint {self.directory}; it holds {near}")
            self._tables[name] = ServedTable(self, *self._sources[name])
        return self._tables[name]

    def __contains__(self, name: object) -> bool:
        return name in self._sources

    def names(self) -> list[str]:
        return sorted(self._sources)

    def close(self) -> None:
        """Unmap the files; later lookups raise."""
        self._release()
        self._closed = True

    def _release(self) -> None:
        maps, self._maps, self._tables = getattr(self, "_maps", {}), {}, {}
        for name in list(maps):
            mapped, _, fd = maps.pop(name)  # drop the tensor over the map first: it holds the buffer
            os.close(fd)
            if mapped is not None:
                with contextlib.suppress(BufferError):  # a caller still holds a view: closed when dropped
                    mapped.close()

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _map(path: Path) -> tuple[mmap.mmap | None, torch.Tensor, int]:
    with open_regular(path, f"data file {path}") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) if os.fstat(f.fileno()).st_size else None
        fd = os.dup(f.fileno())  # kept for the verifying reads
    raw = torch.frombuffer(mapped, dtype=torch.uint8) if mapped else torch.empty(0, dtype=torch.uint8)
    return mapped, raw, fd


def _merged(changes: list[RowChanges]) -> RowChanges | None:
    """All row changes of a chain as one: ids sorted and unique, each with its newest value."""
    rows = torch.cat([c.rows for c in changes]) if changes else torch.empty(0, dtype=torch.int64)
    if rows.numel() == 0:
        return None
    values = torch.cat([c.values for c in changes])
    unique, inverse = torch.unique(rows, return_inverse=True)
    newest = torch.full((unique.numel(),), -1, dtype=torch.int64)
    newest.scatter_reduce_(0, inverse, torch.arange(rows.numel()), "amax")
    return RowChanges(unique, values.index_select(0, newest))


def open_checkpoint(path: str | os.PathLike) -> CheckpointReader:
    """Open the checkpoint at ``path`` for serving reads (see :class:`CheckpointReader`).

    >>> import tempfile
    >>> from shardvar import Layout, save, shard_tensor
    >>> d = tempfile.mkdtemp()
    >>> save({"users": shard_tensor(torch.arange(20.).reshape(10, 2), Layout.mod(10, 3))}, d)
    >>> with open_checkpoint(d) as served:
    ...     served["users"].lookup(torch.tensor([7, 0])).tolist()
    [[14.0, 15.0], [0.0, 1.0]]
    """
    return CheckpointReader(path)
