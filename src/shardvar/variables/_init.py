"""Initializers whose value for logical row r depends only on r (and a seed), never on the layout.

Rows are drawn in fixed blocks, each from its own generator seeded by (seed, block); so any
process can produce exactly the rows of its shards, and a single process the whole table, with
identical values and memory bounded by the shard plus one block.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .._errors import ShardvarValueError
from .._pages import empty
from .._validate import check_choice, check_int, check_number

__all__ = ["RowInitializer"]


@dataclass(frozen=True)
class RowInitializer:
    """Normal (``mean``, ``std``) or uniform ([``low``, ``high``)) values, drawn row block by row block.

    >>> init = RowInitializer(seed=7)
    >>> torch.equal(init.rows(torch.tensor([5, 2]), (3,)), init.rows(torch.arange(6), (3,))[[5, 2]])
    True
    """

    seed: int = 0
    kind: str = "normal"
    mean: float = 0.0
    std: float = 1.0
    low: float = -1.0
    high: float = 1.0
    block_rows: int = 4096

    def __post_init__(self) -> None:
        check_int(self.seed, "seed")
        check_choice(self.kind, "kind", ("normal", "uniform"))
        for name in ("mean", "std", "low", "high"):
            check_number(getattr(self, name), name)
        if self.std < 0:
            raise ShardvarValueError(f"std must be >= 0; got {self.std}")
        if self.kind == "uniform" and not self.low < self.high:
            raise ShardvarValueError(f"uniform rows need low < high; got low={self.low}, high={self.high}")
        check_int(self.block_rows, "block_rows", minimum=1)

    def _block(self, block: int, row_shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        g = torch.Generator().manual_seed((self.seed * 1_000_003 + block) % (2**63))
        out = empty((self.block_rows, *row_shape), dtype=torch.float32)
        if self.kind == "normal":
            out.normal_(self.mean, self.std, generator=g)
        else:
            out.uniform_(self.low, self.high, generator=g)
        return out.to(dtype)

    def rows(self, ids: torch.Tensor, row_shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Values of logical rows ``ids`` (any order): shape ``[len(ids), *row_shape]``."""
        ids = ids.reshape(-1).to(torch.int64).cpu()
        out = empty((ids.numel(), *row_shape), dtype=dtype)
        blocks = ids // self.block_rows
        order = torch.argsort(blocks, stable=True)
        unique, counts = torch.unique_consecutive(blocks[order], return_counts=True)
        for b, at in zip(unique.tolist(), order.split(counts.tolist()), strict=True):
            out.index_copy_(0, at, self._block(b, row_shape, dtype).index_select(0, ids[at] - b * self.block_rows))
        return out

    def __call__(self, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The whole logical tensor (rows along dim 0): usable as a ``create_partitioned_variables`` initializer."""
        return self.rows(torch.arange(shape[0]), tuple(shape[1:]), dtype)
