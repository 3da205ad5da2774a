"""A small writer of TensorFlow tensor bundles, from the format spec, for tests that need checkpoints
the committed fixtures are too small or too sound for (big tables, damaged tables).

The committed fixtures under tests/data/tf/ were written by TensorFlow itself; tests check this
writer against them (its output for the same tensors reads back alike), so it cannot drift.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from pathlib import Path

import google_crc32c
import numpy as np

from shardvar.tf._proto import BundleEntryProto, BundleHeaderProto
from shardvar.tf._slices import slice_key
from shardvar.tf._table import MAGIC, mask

CODES = {
    np.dtype(k): v for k, v in {"float32": 1, "float64": 2, "int32": 3, "int64": 9, "float16": 19, "bool": 10}.items()
}


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _block(items: list[tuple[bytes, bytes]], restart_interval: int = 4) -> bytes:
    out, restarts, previous = bytearray(), [], b""
    for i, (key, value) in enumerate(items):
        shared = 0
        if i % restart_interval:
            while shared < min(len(key), len(previous)) and key[shared] == previous[shared]:
                shared += 1
        else:
            restarts.append(len(out))
        out += _varint(shared) + _varint(len(key) - shared) + _varint(len(value)) + key[shared:] + value
        previous = key
    restarts = restarts or [0]
    return bytes(out) + struct.pack(f"<{len(restarts)}I", *restarts) + struct.pack("<I", len(restarts))


def table_bytes(
    items: list[tuple[bytes, bytes]], per_block: int = 8, mutate: Callable[[bytes], bytes] | None = None
) -> bytes:
    """A table of ``items``; ``mutate`` changes each block before its checksum is computed (fuzzing past it)."""
    out, index = bytearray(), []

    def add(block: bytes) -> bytes:
        block = mutate(block) if mutate else block
        handle = _varint(len(out)) + _varint(len(block))
        out.extend(block + b"\x00" + struct.pack("<I", mask(google_crc32c.value(block + b"\x00"))))
        return handle

    for start in range(0, len(items), per_block):
        chunk = items[start : start + per_block]
        index.append((chunk[-1][0], add(_block(chunk))))
    meta = add(_block([]))
    footer = meta + add(_block(index))
    out += footer + b"\x00" * (40 - len(footer)) + struct.pack("<II", MAGIC & 0xFFFFFFFF, MAGIC >> 32)
    return bytes(out)


def write_table(path: Path, items: list[tuple[bytes, bytes]], per_block: int = 8) -> None:
    path.write_bytes(table_bytes(items, per_block))


def write_bundle(prefix: Path, tensors: dict[str, np.ndarray], row_slices: dict[str, list[int]] | None = None) -> None:
    """Tensors in one data file; ``row_slices[name]``: that variable saved as slices of these row counts."""
    row_slices = row_slices or {}
    items: dict[bytes, bytes] = {b"": BundleHeaderProto(num_shards=1).SerializeToString()}
    data = Path(f"{prefix}.data-00000-of-00001")
    offset = 0
    with open(data, "wb") as f:

        def put(key: bytes, array: np.ndarray) -> None:
            nonlocal offset
            raw = np.array(array, order="C")  # ascontiguousarray would make a 0-d array 1-d
            entry = BundleEntryProto(dtype=CODES[raw.dtype], offset=offset, size=raw.nbytes)
            entry.crc32c = mask(google_crc32c.value(raw.reshape(-1).view(np.uint8)))
            for n in raw.shape:
                entry.shape.dim.add(size=n)
            raw.tofile(f)
            offset += raw.nbytes
            items[key] = entry.SerializeToString()

        for name, array in tensors.items():
            if name not in row_slices:
                put(name.encode(), array)
                continue
            full = BundleEntryProto(dtype=CODES[array.dtype])
            for n in array.shape:
                full.shape.dim.add(size=n)
            start = 0
            for rows in row_slices[name]:
                extents = [(start, rows)] + [(0, n) for n in array.shape[1:]]  # as the Saver writes: lengths explicit
                s = full.slices.add()
                for a, n in extents:
                    e = s.extent.add(start=a)
                    if n >= 0:
                        e.length = n
                put(slice_key(name, extents), array[start : start + rows])
                start += rows
            items[name.encode()] = full.SerializeToString()
    write_table(Path(f"{prefix}.index"), sorted(items.items()))
