"""Reading and writing the safetensors container, row chunk by row chunk.

The format (https://github.com/huggingface/safetensors): an 8-byte little-endian header length,
a JSON header mapping each tensor name to dtype, shape and data offsets, then the raw bytes.
Writing streams each tensor and computes one checksum per chunk of rows (xxh3-64 from the
``xxhash`` package, about 5x faster than zlib's crc32, which version-2 checkpoints used and are
still read with); reading fetches only the chunks asked for, with plain ``readinto`` (no mmap,
so the address space stays small).
"""

from __future__ import annotations

import json
import math
import os
import struct
import zlib
from collections.abc import Callable, Iterable
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import BinaryIO

import torch
import xxhash

from .._pages import empty

StreamPiece = tuple[int, int, torch.Tensor]  # (index among the streamed tensors, first row, rows)

__all__ = ["CHECKSUMS", "CHECKSUM", "DTYPE_CODES", "CHUNK_BYTES", "FileWriter", "StoredTensor", "read_chunks"]

CHUNK_BYTES = 4 << 20  # checksum granularity: partial reads verify exactly the chunks they touch
CHECKSUMS: dict[str, tuple[Callable[[memoryview], int], int]] = {  # name -> (function, largest value)
    "crc32": (zlib.crc32, 2**32 - 1),
    "xxh3_64": (xxhash.xxh3_64_intdigest, 2**64 - 1),
}
CHECKSUM = "xxh3_64"  # what new saves write

# Every dtype the safetensors format names (its Rust crate and Python package); complex128 has
# no name there, so it cannot be saved (refused before any file is touched).
_NAMES = {
    "float64": "F64",
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint64": "U64",
    "uint32": "U32",
    "uint16": "U16",
    "uint8": "U8",
    "bool": "BOOL",
    "complex64": "C64",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e4m3fnuz": "F8_E4M3FNUZ",
    "float8_e5m2": "F8_E5M2",
    "float8_e5m2fnuz": "F8_E5M2FNUZ",
    "float8_e8m0fnu": "F8_E8M0",
}
DTYPE_CODES = {getattr(torch, name): code for name, code in _NAMES.items() if hasattr(torch, name)}


@dataclass(frozen=True)
class StoredTensor:
    """Where one tensor's bytes lie and the checksum of each chunk of ``chunk_rows`` rows."""

    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    begin: int  # byte offset of the data in the file
    chunk_rows: int
    sums: tuple[int, ...]
    checksum: str = CHECKSUM  # a name in CHECKSUMS

    @property
    def row_bytes(self) -> int:
        return math.prod(self.shape[1:]) * self.dtype.itemsize if self.shape else self.dtype.itemsize

    @property
    def rows(self) -> int:
        return self.shape[0] if self.shape else 1


def chunk_rows_for(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    row_bytes = (math.prod(shape[1:]) if shape else 1) * dtype.itemsize
    return max(1, CHUNK_BYTES // max(row_bytes, 1))


def _bytes_of(t: torch.Tensor) -> memoryview:
    flat = t.detach().reshape(-1)
    if flat.device.type != "cpu":
        flat = flat.cpu()
    return memoryview(flat.contiguous().view(torch.uint8).numpy())


class FileWriter:
    """Streams tensors into one safetensors file whose header (names, shapes, dtypes) is known up front."""

    def __init__(self, file: BinaryIO, layout: list[tuple[str, tuple[int, ...], torch.dtype]]) -> None:
        header: dict[str, object] = {}
        offset = 0
        for key, shape, dtype in layout:
            nbytes = math.prod(shape) * dtype.itemsize
            header[key] = {"dtype": DTYPE_CODES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self._start = 8 + len(raw)
        self._pending = list(layout)
        self._header = header
        # ``file`` is new, or a spare overwritten in place (several times faster than allocating a
        # new file on thin-provisioned and copy-on-write disks; nothing references a spare).
        self._file = file
        self._file.seek(0)
        self._file.write(struct.pack("<Q", len(raw)))
        self._file.write(raw)
        self.stored: list[StoredTensor] = []

    def write(self, key: str, t: torch.Tensor) -> StoredTensor:
        """Append the next tensor; it must be the next one of the header, with its shape and dtype."""
        expected_key, shape, dtype = self._pending.pop(0)
        if (key, tuple(t.shape), t.dtype) != (expected_key, shape, dtype):
            raise ValueError(
                f"expected tensor {expected_key!r} {list(shape)} {dtype}; got {key!r} {list(t.shape)} {t.dtype}"
            )
        chunk_rows = chunk_rows_for(shape, dtype)
        data = _bytes_of(t)
        step = max(1, chunk_rows * (len(data) // max(shape[0], 1) if shape else len(data)))
        name = CHECKSUM
        sums, checksum = [], CHECKSUMS[name][0]
        for i in range(0, max(len(data), 1), step):
            piece = data[i : i + step]
            sums.append(checksum(piece))
            self._file.write(piece)
        begin = self._start + self._header[key]["data_offsets"][0]  # type: ignore[index]
        stored = StoredTensor(key, shape, dtype, begin, chunk_rows, tuple(sums), name)
        self.stored.append(stored)
        return stored

    def write_stream(
        self, keys: list[str], pieces: Iterable[StreamPiece], done: Callable[[int], None]
    ) -> list[StoredTensor]:
        """Write the next ``len(keys)`` tensors of the header from ``pieces`` that interleave them.

        Each piece lands at its own offset (``pwrite``), so one pass over a source can feed every
        tensor at once; a tensor's rows must arrive in order, each chunk checksum streaming over
        them. ``done(nbytes)`` after each piece.
        """
        layout = [self._pending.pop(0) for _ in keys]
        if [k for k, _, _ in layout] != keys:
            raise ValueError(f"expected tensors {[k for k, _, _ in layout]}; got {keys}")
        self._file.flush()  # the header, from the buffered file, before writes that bypass it
        fd = self._file.fileno()
        offsets = [self._header[k]["data_offsets"][0] for k, _, _ in layout]  # type: ignore[index]
        states = [
            _Stream(shape, dtype, self._start + at) for (_, shape, dtype), at in zip(layout, offsets, strict=True)
        ]
        for i, row, t in pieces:
            state = states[i]
            fits = row == state.rows and row + len(t) <= (state.shape[0] if state.shape else 1)
            if not fits or tuple(t.shape[1:]) != state.shape[1:] or t.dtype != state.dtype:  # refused before written
                raise ValueError(f"tensor {keys[i]!r}: rows from {row} {list(t.shape)} {t.dtype} do not come next")
            data = _bytes_of(t)
            written = 0
            while written < len(data):
                written += os.pwrite(fd, data[written:], state.begin + row * state.row_bytes + written)
            state.add(data, len(t))
            done(len(data))
        stored = []
        for (key, shape, dtype), state in zip(layout, states, strict=True):
            if state.rows != (shape[0] if shape else 1):
                raise ValueError(f"tensor {key!r} got {state.rows} rows of {shape[0] if shape else 1}")
            stored.append(StoredTensor(key, shape, dtype, state.begin, state.chunk_rows, state.finish(), CHECKSUM))
        self._file.seek(self._start + self._header[keys[-1]]["data_offsets"][1])  # type: ignore[index]
        self.stored += stored
        return stored

    def abort(self) -> None:
        """Close without finishing (the caller deletes the file)."""
        self._file.close()

    def close(self) -> None:
        if self._pending:
            raise ValueError(f"{len(self._pending)} tensors of the header were never written")
        self._file.truncate()
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()


class _Stream:
    """A tensor being written piece by piece: rows so far and the checksum of each full chunk."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, begin: int) -> None:
        self.shape, self.dtype, self.begin = shape, dtype, begin
        self.row_bytes = math.prod(shape[1:]) * dtype.itemsize if shape else dtype.itemsize
        self.chunk_rows = chunk_rows_for(shape, dtype)
        self.step = max(1, self.chunk_rows * self.row_bytes)
        self.rows, self.filled, self.sums = 0, 0, []
        self.hasher = xxhash.xxh3_64()

    def add(self, data: memoryview, rows: int) -> None:
        self.rows += rows
        while len(data):
            take = min(len(data), self.step - self.filled)
            self.hasher.update(data[:take])
            self.filled, data = self.filled + take, data[take:]
            if self.filled == self.step:
                self.sums.append(self.hasher.intdigest())
                self.hasher.reset()
                self.filled = 0

    def finish(self) -> tuple[int, ...]:
        if self.filled or not self.sums:  # as ``write``: a last partial chunk, or an empty tensor's one sum
            self.sums.append(self.hasher.intdigest())
        return tuple(self.sums)


def _pread_into(fd: int, view: memoryview, offset: int) -> int:
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], offset + done)
        if got == 0:
            break
        done += got
    return done


def read_chunks(
    f: BinaryIO,
    stored: StoredTensor,
    first: int,
    last: int,
    verify: bool = True,
    out: torch.Tensor | None = None,
    pool: Executor | None = None,
) -> torch.Tensor:
    """Rows of chunks ``first..last`` (inclusive) of ``stored``, each chunk's checksum checked.

    With ``out`` (contiguous, exactly those rows) the bytes land there directly, with no copy.
    """
    row_bytes = stored.row_bytes
    start_row = first * stored.chunk_rows
    stop_row = min(stored.rows, (last + 1) * stored.chunk_rows)
    nbytes = (stop_row - start_row) * row_bytes
    shape = (stop_row - start_row, *stored.shape[1:]) if stored.shape else ()
    if out is None:
        out = empty(shape, dtype=stored.dtype)
    if nbytes == 0:
        view = memoryview(b"")
    else:
        view = memoryview(out.reshape(-1).view(torch.uint8).numpy())
    got = _pread_into(f.fileno(), view, stored.begin + start_row * row_bytes)
    if got != nbytes:
        raise ValueError(f"tensor {stored.key!r} is truncated: wanted {nbytes} bytes at chunk {first}, read {got}")
    if verify:
        step = stored.chunk_rows * row_bytes
        parts = [view[i * step : (i + 1) * step] for i in range(last - first + 1)]
        # Both checksums release the GIL: chunks are checked on several cores at once.
        checksum = CHECKSUMS[stored.checksum][0]
        sums = list(pool.map(checksum, parts)) if pool is not None and len(parts) > 1 else [checksum(p) for p in parts]
        for i, c in enumerate(range(first, last + 1)):
            if sums[i] != stored.sums[c]:
                raise ValueError(
                    f"checksum mismatch in tensor {stored.key!r}, rows {c * stored.chunk_rows}.. (chunk {c})"
                )
    return out
