"""The table keys of a sliced variable's slices, written and read back, and how an error names a slice.

A slice of ``name`` is stored under ``checkpoint::EncodeTensorNameSlice(name, slice)``
(tensorflow/core/util/saved_tensor_slice_util.cc): OrderedCode (tensorflow/core/lib/strings/
ordered_code.cc) of 0, the name, the axis count, then each axis's start and length (-1: the
whole axis). Such a key is bytes no user wrote (``'\\x00emb\\x00\\x01...'``), so every error
about one names the variable and the slice's rows instead (:func:`describe_key`).
"""

from __future__ import annotations

__all__ = ["slice_key", "parse_slice_key", "describe", "describe_key", "spec"]

# kLengthToHeaderBits: the first two bytes' size bits, by encoded length
_HEADER_BITS = [(0, 0)] + [((0xFF << (8 - n)) & 0xFF, 0) for n in range(1, 8)] + [(0xFF, 0), (0xFF, 0x80), (0xFF, 0xC0)]
_ESCAPES = {0: (0, 0xFF), 0xFF: (0xFF, 0)}


def _signed(value: int) -> bytes:
    """``OrderedCode::WriteSignedNumIncreasing``."""
    x = ~value if value < 0 else value
    if x < 64:
        return bytes([(0x80 ^ value) & 0xFF])
    length = x.bit_length() // 7 + 1
    raw = bytearray((value & ((1 << 80) - 1)).to_bytes(10, "big")[10 - length :])
    header = _HEADER_BITS[length]
    raw[0] ^= header[0]
    raw[1] ^= header[1]
    return bytes(raw)


def _unsigned(value: int) -> bytes:
    """``OrderedCode::WriteNumIncreasing``: a length byte, then big-endian bytes without leading zeros."""
    raw = value.to_bytes(8, "big").lstrip(b"\x00")
    return bytes([len(raw)]) + raw


def slice_key(name: str, extents: list[tuple[int, int]]) -> bytes:
    """The table key of one slice of ``name``: ``checkpoint::EncodeTensorNameSlice`` (length -1: whole axis)."""
    escaped = bytes(b for c in name.encode() for b in _ESCAPES.get(c, (c,)))
    key = b"\x00" + escaped + b"\x00\x01" + _unsigned(len(extents))
    return key + b"".join(_signed(start) + _signed(length) for start, length in extents)


def _read_signed(key: bytes, pos: int) -> tuple[int, int]:
    """``OrderedCode::ReadSignedNumIncreasing``: the number at ``pos`` and the position after it."""
    sign = 0 if key[pos] & 0x80 else 0xFF  # a negative number's bytes are the complement
    first = key[pos] ^ sign
    length = 8 - (first ^ 0xFF).bit_length() if first != 0xFF else 8
    if length == 8 and pos + 1 < len(key):
        second = key[pos + 1] ^ sign
        length = 8 if second < 0x80 else 9 if second < 0xC0 else 10
    raw = bytearray(key[pos : pos + length])
    if len(raw) != length:
        raise ValueError("a number runs past the end of the key")
    header = _HEADER_BITS[length]
    raw[0] ^= header[0]
    if length > 1:
        raw[1] ^= header[1]
    value = int.from_bytes(raw, "big", signed=True)
    if _signed(value) != bytes(key[pos : pos + length]):  # not a canonical encoding: not one TensorFlow wrote
        raise ValueError(f"bytes {bytes(key[pos : pos + length])!r} are not an ordered signed number")
    return value, pos + length


def _read_name(key: bytes) -> tuple[str, int]:
    out, pos = bytearray(), 1
    while pos + 1 < len(key):
        byte, following = key[pos], key[pos + 1]
        if byte not in _ESCAPES:
            out.append(byte)
            pos += 1
        elif (byte, following) == (0, 1):
            return out.decode(errors="replace"), pos + 2
        elif (byte, following) == _ESCAPES[byte]:
            out.append(byte)
            pos += 2
        else:
            break
    raise ValueError("the name is not terminated")


def parse_slice_key(key: bytes) -> tuple[str, list[tuple[int, int]]] | None:
    """``(name, extents)`` of a slice key (the inverse of :func:`slice_key`); None for any other bytes."""
    if not key.startswith(b"\x00"):
        return None
    try:
        name, pos = _read_name(key)
        count = key[pos]
        if count > 8 or pos + 1 + count > len(key):
            return None
        axes = int.from_bytes(key[pos + 1 : pos + 1 + count], "big")
        pos += 1 + count
        extents = []
        for _ in range(min(axes, 64)):
            start, pos = _read_signed(key, pos)
            length, pos = _read_signed(key, pos)
            extents.append((start, length))
    except (ValueError, IndexError):
        return None
    return (name, extents) if pos == len(key) and len(extents) == axes else None


def spec(extents: list[tuple[int, int]] | tuple[tuple[int, int], ...]) -> str:
    """A slice in TensorFlow's ``start,length:...`` spelling (``-``: a whole axis)."""
    return ":".join("-" if n < 0 else f"{o},{n}" for o, n in extents) or "(scalar)"


def describe(name: str, extents: list[tuple[int, int]] | tuple[tuple[int, int], ...]) -> str:
    """How an error names one slice: ``rows 7:10 of 'emb' (slice 7,3:0,4)``."""
    if not extents:
        return f"tensor {name!r}"
    start, length = extents[0]
    rows = "all rows" if length < 0 else f"rows {start}:{start + length}"
    return f"{rows} of {name!r} (slice {spec(extents)})"


def describe_key(key: bytes) -> str:
    """How an error names the table key ``key``: its variable and rows, never the encoded bytes."""
    parsed = parse_slice_key(key)
    if parsed is not None:
        return describe(*parsed)
    if key.startswith(b"\x00"):
        try:
            return f"a slice of {_read_name(key)[0]!r} whose key does not decode"
        except (ValueError, IndexError):
            return f"a slice key that does not decode (hex {key[:40].hex()})"
    return f"tensor {key.decode(errors='replace')[:200]!r}"
