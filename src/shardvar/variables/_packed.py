"""Packed row formats: how a row-wise quantized table row is laid out, packed and read back.

The one home of the rule, used by the quantized modules, the checkpoint (which stores packed
rows as ``uint8`` and serves them dequantized) and the benchmarks. The formats are torch's own
(``torch.ops.quantized.embedding_bag_*_prepack``), so its CPU bag kernels read them as they are:

* ``quint8``: ``dim`` bytes (one per element), then the row's scale and bias as two float32
  (8 bytes): ``value = q * scale + bias``, ``bias`` is the row's minimum.
* ``quint4x2``: ``dim / 2`` bytes, element ``2j`` in the low nibble of byte ``j`` and ``2j + 1`` in
  the high one, then scale and bias as two float16 (4 bytes). ``dim`` must be even.
* ``float16``: the row cast to float16, no scale or bias (kept as a ``float16`` tensor).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .._errors import ShardvarDTypeError, ShardvarValueError

__all__ = ["FORMATS", "RowFormat", "row_format"]

_Q = torch.ops.quantized


@dataclass(frozen=True)
class RowFormat:
    """One packed row format: its name (the torch dtype's), storage dtype and bytes per row."""

    name: str
    dtype: torch.dtype  # what the user asks for: torch.quint8, torch.quint4x2 or torch.float16
    storage: torch.dtype  # what the packed tensor holds: uint8 rows, or float16 rows
    per_byte: int  # elements per stored byte (0: not a byte format)
    overhead: int  # bytes of scale and bias at the end of each row
    bag: Callable[..., torch.Tensor] | None  # torch's bag kernel over packed rows (sum/mean), if any

    def width(self, dim: int) -> int:
        """Stored elements per row of a ``dim``-wide table."""
        return dim if self.per_byte == 0 else dim // self.per_byte + self.overhead

    def dim(self, width: int) -> int:
        """The table's width for ``width`` stored elements per row (the inverse of :meth:`width`)."""
        return width if self.per_byte == 0 else (width - self.overhead) * self.per_byte

    def row_bytes(self, dim: int) -> int:
        return self.width(dim) * self.storage.itemsize

    def check(self, source_dtype: torch.dtype, dim: int, what: str) -> None:
        """Refuse a table this format cannot hold: not floating point, or an odd dim for 4-bit."""
        if not source_dtype.is_floating_point:
            raise ShardvarDTypeError(f"{what} has dtype {source_dtype}; only floating-point tables can be quantized")
        if self.per_byte > 1 and dim % self.per_byte:
            raise ShardvarValueError(
                f"{what} has embedding_dim {dim}; {self.name} packs {self.per_byte} elements a byte, so the dim "
                f"must be a multiple of {self.per_byte} (use torch.quint8 for this table)"
            )

    def pack(self, rows: torch.Tensor) -> torch.Tensor:
        """``[n, dim]`` float rows as ``[n, width]`` packed rows (one kernel call)."""
        rows = rows.detach()
        if self.per_byte == 0:
            return rows.to(self.storage).contiguous()
        rows = rows.to(torch.float32).contiguous()
        return _Q.embedding_bag_byte_prepack(rows) if self.per_byte == 1 else _Q.embedding_bag_4bit_prepack(rows)

    def unpack(self, packed: torch.Tensor) -> torch.Tensor:
        """``[..., width]`` packed rows as ``[..., dim]`` float32 rows, as the bag kernel reads them.

        The kernel itself dequantizes (one bag per row), so a row read here, served from a
        checkpoint or summed into a bag is the same float32 value to the last bit.
        """
        if self.bag is None:
            return packed.to(torch.float32)
        flat = packed.reshape(-1, packed.shape[-1]).contiguous()
        at = torch.arange(flat.shape[0], device=packed.device)
        out = self.bag(flat, at, at, False, 0, False, None, None, False) if flat.shape[0] else None
        if out is None:
            out = torch.empty(0, self.dim(packed.shape[-1]), device=packed.device)
        return out.reshape(*packed.shape[:-1], out.shape[-1])

    def step(self, packed: torch.Tensor) -> torch.Tensor:
        """Each row's quantization step (its scale), ``[n]``; 0 for float16 rows (no step)."""
        if self.per_byte == 0:
            return torch.zeros(packed.shape[0])
        return self._scale_bias(packed)[..., 0]

    def _scale_bias(self, packed: torch.Tensor) -> torch.Tensor:
        """``[..., 2]`` float32: each packed row's scale and bias."""
        tail = packed[..., packed.shape[-1] - self.overhead :]
        aligned = tail.clone(memory_format=torch.contiguous_format)  # a fresh, aligned buffer for the float view
        return aligned.view(torch.float32 if self.per_byte == 1 else torch.float16).to(torch.float32)


FORMATS = {
    f.name: f
    for f in (
        RowFormat("quint8", torch.quint8, torch.uint8, 1, 8, _Q.embedding_bag_byte_rowwise_offsets),
        RowFormat("quint4x2", torch.quint4x2, torch.uint8, 2, 4, _Q.embedding_bag_4bit_rowwise_offsets),
        RowFormat("float16", torch.float16, torch.float16, 0, 0, None),
    )
}


def row_format(dtype: object) -> RowFormat:
    """The format for ``dtype`` (``torch.quint8``, ``torch.quint4x2``, ``torch.float16`` or one's name)."""
    name = str(dtype).removeprefix("torch.") if isinstance(dtype, (torch.dtype, str)) else None
    if name == "half":
        name = "float16"
    if name not in FORMATS:
        raise ShardvarDTypeError(
            f"quantized dtype must be one of torch.quint8, torch.quint4x2, torch.float16; got {dtype!r}"
        )
    return FORMATS[name]
