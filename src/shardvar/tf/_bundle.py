"""A TensorFlow tensor bundle: the ``.index`` table of entries and the ``.data-NNNNN-of-NNNNN`` files.

From TensorFlow's ``core/util/tensor_bundle/tensor_bundle.{proto,cc}``: the table's empty key
holds a ``BundleHeaderProto`` (data file count, endianness, format version); every other key is a
tensor's name with a ``BundleEntryProto`` (dtype, shape, data file, offset, size, masked crc32c
of its bytes). A variable saved as slices (a PartitionedVariable, a ShardedVariable) has an entry
with no bytes that lists its slices, each stored under the key ``checkpoint::EncodeTensorNameSlice``
makes (``_slices.slice_key``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import google_crc32c
import torch

from .._errors import CheckpointError, CheckpointIOError
from ._proto import BundleEntryProto, BundleHeaderProto
from ._slices import describe_key
from ._table import TableError, read_table, unmask, varint

__all__ = ["Bundle", "DTYPES", "STRING", "dtype_name"]

STRING = 7
# TensorFlow DataType -> torch dtype (tensorflow/core/framework/types.proto); bfloat16 and bool are
# stored as their 2 and 1 bytes, the unsigned wide types need torch >= 2.3.
DTYPES: dict[int, torch.dtype] = {
    1: torch.float32, 2: torch.float64, 3: torch.int32, 4: torch.uint8, 5: torch.int16, 6: torch.int8,
    8: torch.complex64, 9: torch.int64, 10: torch.bool, 14: torch.bfloat16, 17: torch.uint16,
    18: torch.complex128, 19: torch.float16, 22: torch.uint32, 23: torch.uint64,
}  # fmt: skip
_NAMES = {STRING: "string", 11: "qint8", 12: "quint8", 13: "qint32", 15: "qint16", 16: "quint16", 20: "resource"}
_VERSION = 1  # kTensorBundleVersion: the newest format this reader knows


def dtype_name(code: int) -> str:
    if code in DTYPES:
        return str(DTYPES[code]).removeprefix("torch.")
    return _NAMES.get(code, f"DataType {code}")


@dataclass
class Bundle:
    """The parsed ``.index`` of checkpoint ``prefix``; data files are opened on first read."""

    prefix: Path
    num_shards: int
    entries: dict[bytes, BundleEntryProto]

    @classmethod
    def open(cls, prefix: Path) -> Bundle:
        index = Path(f"{prefix}.index")
        try:
            data = index.read_bytes()
        except FileNotFoundError:
            raise CheckpointError(f"{index} does not exist: {prefix} is not a TensorFlow checkpoint prefix") from None
        except OSError as e:
            raise CheckpointIOError(f"reading {index} failed: {e}") from None
        table = read_table(data, str(index))
        if b"" not in table:
            raise TableError(f"{index} has no bundle header (its empty key): not a TensorFlow V2 checkpoint")
        header = _parse(BundleHeaderProto, table.pop(b""), index, "the header")
        if header.endianness != 0:
            raise CheckpointError(f"{index} was written big-endian; only little-endian checkpoints are read")
        if header.version.min_consumer > _VERSION:
            raise CheckpointError(f"{index} needs a reader of bundle version >= {header.version.min_consumer}")
        if not 1 <= header.num_shards <= 1 << 20:
            raise CheckpointError(f"{index}: the header's data file count {header.num_shards} is absurd")
        entries = {k: _parse(BundleEntryProto, v, index, describe_key(k)) for k, v in table.items()}
        return cls(prefix, header.num_shards, entries)

    def data_file(self, shard: int) -> Path:
        return Path(f"{self.prefix}.data-{shard:05d}-of-{self.num_shards:05d}")

    def check_extent(self, what: str, entry: BundleEntryProto, nbytes: int) -> None:
        """Refuse an entry whose bytes are not where it says, before anything is allocated for it.

        ``what`` names the entry in errors (``tensor 'emb'``, ``rows 0:5 of 'emb' (slice 0,5:0,4)``).
        """
        where = f"{what} of {self.prefix}"
        if entry.size != nbytes:
            raise CheckpointError(f"{where} holds {entry.size} bytes; its dtype and shape need {nbytes}")
        if not 0 <= entry.shard_id < self.num_shards or entry.offset < 0:
            raise CheckpointError(f"{where} points at data file {entry.shard_id}, offset {entry.offset}: out of range")
        path = self.data_file(entry.shard_id)
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            raise CheckpointError(f"{where} is in {path}, which is missing") from None
        if entry.offset + entry.size > size:
            raise CheckpointError(f"{where} ends at byte {entry.offset + entry.size} of {path}, which has {size}")

    def read_into(self, what: str, entry: BundleEntryProto, offset: int, out: memoryview) -> None:
        """Bytes ``[offset, offset + len(out))`` of ``entry`` (``what``, in errors) into ``out``."""
        path = self.data_file(entry.shard_id)
        try:
            fd = os.open(path, os.O_RDONLY)
            try:
                done = 0
                while done < len(out):
                    n = os.preadv(fd, [out[done:]], entry.offset + offset + done)
                    if n == 0:
                        raise CheckpointError(f"{path} ended while reading {what}: truncated")
                    done += n
            finally:
                os.close(fd)
        except FileNotFoundError:
            raise CheckpointError(f"data file {path} is missing") from None
        except OSError as e:
            raise CheckpointIOError(f"reading {path} failed: {e}") from None

    def verify(self, what: str, entry: BundleEntryProto, crc: int) -> None:
        if unmask(entry.crc32c) != crc:
            raise CheckpointError(
                f"{what} of {self.prefix} fails its crc32c check (in {self.data_file(entry.shard_id)}): "
                "the data file is damaged"
            )

    def read_strings(self, key: str, entry: BundleEntryProto, count: int) -> list[bytes]:
        """A string tensor (``WriteStringTensor``): ``count`` varint64 lengths, the masked crc32c of the
        lengths (each as a little-endian uint32, or uint64 past 4 GiB), then the bytes; the entry's crc
        covers those lengths, that checksum and the bytes."""
        what = f"string tensor {key!r}"
        self.check_extent(what, entry, entry.size)
        raw = bytearray(entry.size)
        self.read_into(what, entry, 0, memoryview(raw))
        pos, lengths, crc = 0, [], 0
        for _ in range(count):
            n, pos = varint(raw, pos, what)
            lengths.append(n)
            crc = google_crc32c.extend(crc, n.to_bytes(4 if n < 1 << 32 else 8, "little"))
        stored = bytes(raw[pos : pos + 4])
        crc = google_crc32c.extend(crc, stored)
        pos += 4
        if pos + sum(lengths) != len(raw):
            raise CheckpointError(f"{what} of {self.prefix}: its lengths do not add up to its bytes")
        self.verify(what, entry, google_crc32c.extend(crc, bytes(raw[pos:])))
        out = []
        for n in lengths:
            out.append(bytes(raw[pos : pos + n]))
            pos += n
        return out


def _parse(message: type, data: bytes, index: Path, what: str) -> object:
    try:
        return message.FromString(data)
    except Exception as e:  # protobuf raises its DecodeError, or RuntimeError on deep nesting
        raise TableError(f"{index}: {what} is not a valid {message.__name__}: {e}") from None
