"""A reader of the sorted-string table that is a TensorFlow checkpoint's ``.index`` file.

Written here because no well-kept Python package reads this format: TensorFlow's
``core/lib/io/{table,block,format}.cc`` is LevelDB's table without its filter blocks, and the
LevelDB bindings on PyPI (plyvel and friends) open whole databases, not one table file, and need
a C library. The format, from those files:

* footer: the last 48 bytes: two block handles (metaindex, index; each varint64 offset and size),
  zero padding to 40 bytes, then the fixed64 magic ``0xdb4775248b80fb57``;
* block: entries (varint32 shared key bytes, varint32 unshared key bytes, varint32 value length,
  the unshared key bytes, the value), then the fixed32 offsets of its restart points (entries
  whose key is whole) and their fixed32 count; each block is followed by a 5-byte trailer: its
  compression type (TensorFlow writes 0, none) and the masked crc32c of the block and that byte;
* the index block maps a key at or after each data block's last key to that block's handle.

Every length, offset and checksum is verified; anything else is a :class:`TableError`.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator

import google_crc32c

from .._errors import CheckpointError
from ._slices import describe_key

__all__ = ["TableError", "read_table", "unmask", "mask", "varint"]

MAGIC = 0xDB4775248B80FB57
FOOTER = 48
TRAILER = 5
_MASK_DELTA = 0xA282EAD8


class TableError(CheckpointError):
    """A TensorFlow checkpoint's ``.index`` table is truncated, damaged or of an unknown kind."""


def mask(crc: int) -> int:
    """LevelDB's masked crc (a crc of data holding crcs is then not itself a crc of crcs)."""
    return ((((crc >> 15) | (crc << 17)) & 0xFFFFFFFF) + _MASK_DELTA) & 0xFFFFFFFF


def unmask(masked: int) -> int:
    rot = (masked - _MASK_DELTA) & 0xFFFFFFFF
    return ((rot >> 17) | (rot << 15)) & 0xFFFFFFFF


def varint(data: bytes | memoryview, pos: int, what: str, bits: int = 64) -> tuple[int, int]:
    """The little-endian base-128 integer at ``pos`` and the position after it."""
    value = shift = 0
    while True:
        if pos >= len(data):
            raise TableError(f"{what}: a varint runs past the end of its data")
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            break
        shift += 7
        if shift >= bits:
            raise TableError(f"{what}: a varint longer than {bits} bits")
    return value, pos


def _handle(data: bytes | memoryview, pos: int, what: str) -> tuple[tuple[int, int], int]:
    offset, pos = varint(data, pos, what)
    size, pos = varint(data, pos, what)
    return (offset, size), pos


def _block(data: bytes, handle: tuple[int, int], what: str) -> memoryview:
    offset, size = handle
    if offset + size + TRAILER > len(data):
        raise TableError(f"{what}: block handle ({offset}, {size}) runs past the end of the {len(data)}-byte file")
    kind = data[offset + size]
    (stored,) = struct.unpack_from("<I", data, offset + size + 1)
    actual = google_crc32c.value(data[offset : offset + size + 1])
    if unmask(stored) != actual:
        raise TableError(f"{what}: block at {offset} fails its crc32c check (stored {stored:#x}); the file is damaged")
    if kind != 0:
        raise TableError(
            f"{what}: block at {offset} is compressed (type {kind}); TensorFlow writes uncompressed blocks"
        )
    return memoryview(data)[offset : offset + size]


def _entries(block: memoryview, what: str) -> Iterator[tuple[bytes, memoryview]]:
    if len(block) < 4:
        raise TableError(f"{what}: a block of {len(block)} bytes has no restart count")
    (count,) = struct.unpack_from("<I", block, len(block) - 4)
    end = len(block) - 4 - 4 * count
    if count < 1 or end < 0:
        raise TableError(f"{what}: a block of {len(block)} bytes cannot hold {count} restart points")
    restarts = set(struct.unpack_from(f"<{count}I", block, end))
    if 0 not in restarts or max(restarts) > max(end - 1, 0):
        raise TableError(f"{what}: restart points {sorted(restarts)[:4]}... lie outside the block's {end} entry bytes")
    pos, key = 0, b""
    while pos < end:
        start = pos
        shared, pos = varint(block, pos, what, 32)
        unshared, pos = varint(block, pos, what, 32)
        length, pos = varint(block, pos, what, 32)
        if shared > len(key) or (start in restarts and shared) or pos + unshared + length > end:
            raise TableError(f"{what}: the entry at byte {start} of a block is malformed")
        key = key[:shared] + bytes(block[pos : pos + unshared])
        yield key, block[pos + unshared : pos + unshared + length]
        pos += unshared + length


def read_table(data: bytes, what: str) -> dict[bytes, bytes]:
    """Every key and value of the table ``data`` (the bytes of an ``.index`` file), in key order."""
    if len(data) < FOOTER:
        raise TableError(f"{what} is {len(data)} bytes, shorter than a table's {FOOTER}-byte footer: truncated")
    footer = memoryview(data)[len(data) - FOOTER :]
    lo, hi = struct.unpack_from("<II", footer, FOOTER - 8)
    if (hi << 32) | lo != MAGIC:
        raise TableError(f"{what} does not end with a table's magic number: not a TensorFlow checkpoint index")
    _, pos = _handle(footer, 0, what)
    index_handle, _ = _handle(footer, pos, what)
    table: dict[bytes, bytes] = {}
    previous = None
    for _, value in _entries(_block(data, index_handle, what), what):
        handle, end = _handle(value, 0, what)
        if end != len(value):
            raise TableError(f"{what}: an index entry holds {len(value)} bytes, not one block handle")
        for key, entry in _entries(_block(data, handle, what), what):
            if previous is not None and key <= previous:
                raise TableError(f"{what}: keys are out of order at {describe_key(key)}")
            table[key] = bytes(entry)
            previous = key
    return table
