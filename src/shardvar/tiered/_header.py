"""What a backing file holds and where: its record layout, and the header that records it.

A backing file is a 4 KiB header (magic, then JSON: rows, dim, dtype, state width, spare records,
record size, whether it was closed cleanly, whether every row is in its own record), then
``rows + spare`` records back to back, then, where it has spare records, one int64 per record:
which row that record holds (``RecordLog``: rows written back go to free records in sequence).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from .._errors import ShardvarError

__all__ = ["BackingFileError", "RecordLayout", "HEADER", "MAGIC", "OWNER_BYTES", "read_header", "write_header"]

MAGIC = b"SHVTIER1"
HEADER = 4096
OWNER_BYTES = 8  # a record's owner: the row it holds, plus one (0: the row of its own number, or none)
_ALIGN = 8  # a record's state starts 8-byte aligned, so it can be viewed as float32 in place


class BackingFileError(ShardvarError, OSError):
    """A backing file cannot be created, opened or written (busy, unclean, full disk, not writable)."""


@dataclass(frozen=True)
class RecordLayout:
    """What one record holds: ``dim`` values of ``dtype``, then ``state_width`` float32 state slots; and how many
    records the file has besides one per row (``spare``: room a log of written back rows moves through)."""

    rows: int
    dim: int
    dtype: str
    state_width: int = 0
    spare: int = 0

    @property
    def row_bytes(self) -> int:
        return self.dim * torch.empty((), dtype=self.torch_dtype).element_size()

    @property
    def state_offset(self) -> int:
        return -(-self.row_bytes // _ALIGN) * _ALIGN

    @property
    def record_bytes(self) -> int:
        return -(-(self.state_offset + 4 * self.state_width) // _ALIGN) * _ALIGN

    @property
    def places(self) -> int:
        """Records in the file: one per row, and the spare ones."""
        return self.rows + self.spare

    @property
    def owners_offset(self) -> int:
        """Where the owner of each record is kept (after the records; only where there are spare records)."""
        return HEADER + self.places * self.record_bytes

    @property
    def file_bytes(self) -> int:
        return self.owners_offset + (self.places * OWNER_BYTES if self.spare else 0)

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    def split(self, records: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``[n, record_bytes]`` uint8 as (values ``[n, dim]``, state ``[n, state_width]``), views."""
        values = records[:, : self.row_bytes].view(self.torch_dtype)
        state = records[:, self.state_offset : self.state_offset + 4 * self.state_width].view(torch.float32)
        return values, state

    def join(self, values: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        """Records from values and state (the padding bytes zero)."""
        records = torch.zeros((values.shape[0], self.record_bytes), dtype=torch.uint8)
        v, s = self.split(records)
        v.copy_(values)
        s.copy_(state)
        return records


def write_header(fd: int, layout: RecordLayout, *, clean: bool, ordered: bool = True) -> None:
    """``ordered``: every row is in its own record (none was written back through the log)."""
    meta = {**asdict(layout), "record_bytes": layout.record_bytes, "clean": clean, "ordered": ordered}
    body = json.dumps(meta).encode()
    os.pwrite(fd, MAGIC + body.ljust(HEADER - len(MAGIC), b" "), 0)
    if not clean:
        os.fsync(fd)  # "in use" is on disk before any record changes


def read_header(fd: int, path: Path) -> tuple[RecordLayout, bool, bool]:
    """(layout, closed cleanly, every row in its own record)."""
    raw = os.pread(fd, HEADER, 0)
    if not raw.startswith(MAGIC):
        raise BackingFileError(f"{str(path)!r} is not a shardvar backing file (no {MAGIC.decode()} header)")
    try:
        meta = json.loads(raw[len(MAGIC) :].decode())
        spare = int(meta.get("spare", 0))  # (files written before spare records had none)
        layout = RecordLayout(int(meta["rows"]), int(meta["dim"]), str(meta["dtype"]), int(meta["state_width"]), spare)
        ok = isinstance(getattr(torch, layout.dtype), torch.dtype) and isinstance(meta["clean"], bool)
        ok = ok and layout.rows >= 0 and layout.dim >= 1 and layout.state_width >= 0 and spare >= 0
        ok = ok and layout.record_bytes == meta["record_bytes"] and isinstance(meta.get("ordered", True), bool)
    except (ValueError, KeyError, TypeError, AttributeError, OverflowError):
        ok = False
    if not ok:
        raise BackingFileError(f"backing file {str(path)!r} has a damaged header")
    return layout, meta["clean"], meta.get("ordered", True)
