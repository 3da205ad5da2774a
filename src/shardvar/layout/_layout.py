"""The Layout value object: how one logical tensor is split into shards along one axis."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .._errors import ShardvarIndexError, ShardvarTypeError, ShardvarValueError
from ._ids import as_ids, check_ids
from ._slices import SlicePlan, normalise_slice
from ._strategies import balanced_sizes, check_int_sequence, get_strategy

__all__ = ["Layout", "ceil_sizes"]


def ceil_sizes(num_rows: int, num_shards: int) -> tuple[int, ...]:
    """``torch.chunk``-style sizes (DTensor, TorchRec): ceil(rows / n) each, the rest last, then zeros.

    >>> ceil_sizes(10, 4)
    (3, 3, 3, 1)
    >>> ceil_sizes(5, 4)
    (2, 2, 1, 0)
    """
    chunk = -(-num_rows // num_shards) if num_shards else 0
    return tuple(max(0, min(chunk, num_rows - s * chunk)) for s in range(num_shards))


def _check_count(value: object, what: str, minimum: int) -> int:
    return check_int_sequence([value], what, minimum)[0]


def normalise_axis(axis: object, ndim: int) -> int:
    """Python-style axis (negative counts from the end) checked against ``ndim``."""
    if isinstance(axis, bool) or not isinstance(axis, int):
        raise ShardvarTypeError(f"axis must be an int; got {axis!r}")
    if not -ndim <= axis < ndim:
        raise ShardvarValueError(
            f"axis {axis} is out of range for a tensor of {ndim} dimension(s); expected [{-ndim}, {ndim})"
        )
    return axis % ndim


@dataclass(frozen=True)
class Layout:
    """How a logical tensor is split into shards along ``axis``.

    ``strategy="div"``: shard s holds a contiguous range of ``sizes[s]`` rows (any sizes; the
    reference's balanced split gives the first ``rows % n`` shards one extra row).
    ``strategy="mod"``: id i lives in shard ``i % n`` at local row ``i // n``.

    >>> layout = Layout.div(10, 4)
    >>> layout
    Layout(strategy='div', sizes=(3, 3, 2, 2), axis=0)
    >>> layout.locate(torch.tensor([0, 3, 9]))
    (tensor([0, 1, 3]), tensor([0, 0, 1]))
    """

    strategy: str
    sizes: tuple[int, ...]
    axis: int = 0

    def __post_init__(self) -> None:
        strategy = get_strategy(self.strategy)
        if isinstance(self.sizes, (str, bytes)) or not isinstance(self.sizes, Sequence):
            raise ShardvarTypeError(f"sizes must be a sequence of ints; got {self.sizes!r}")
        sizes = check_int_sequence(self.sizes, "shard sizes", 0)
        if not sizes:
            raise ShardvarValueError("a layout needs at least one shard; got sizes ()")
        axis = _check_count(self.axis, "axis", 0)
        strategy.check_sizes(sizes)
        object.__setattr__(self, "strategy", strategy.name)
        object.__setattr__(self, "sizes", sizes)
        object.__setattr__(self, "axis", axis)

    # -- constructors -------------------------------------------------------------------------
    @classmethod
    def div(cls, num_rows: int, num_shards: int, axis: int = 0) -> Layout:
        """Contiguous ranges; the first ``num_rows % num_shards`` shards get one extra row."""
        n = _check_count(num_shards, "num_shards", 1)
        return cls("div", balanced_sizes(_check_count(num_rows, "num_rows", 0), n), axis)

    @classmethod
    def mod(cls, num_rows: int, num_shards: int, axis: int = 0) -> Layout:
        """Id i in shard ``i % num_shards`` at row ``i // num_shards``."""
        n = _check_count(num_shards, "num_shards", 1)
        return cls("mod", balanced_sizes(_check_count(num_rows, "num_rows", 0), n), axis)

    @classmethod
    def explicit(cls, sizes: Sequence[int], axis: int = 0) -> Layout:
        """Contiguous ranges of the given sizes (zero-size shards allowed)."""
        return cls("div", tuple(sizes), axis)

    @classmethod
    def ceil(cls, num_rows: int, num_shards: int, axis: int = 0) -> Layout:
        """Contiguous ``torch.chunk``-style ranges, as DTensor and TorchRec split rows."""
        n = _check_count(num_shards, "num_shards", 1)
        return cls("div", ceil_sizes(_check_count(num_rows, "num_rows", 0), n), axis)

    @classmethod
    def from_partitions(cls, shape: Sequence[int], partitions: Sequence[int], strategy: str = "div") -> Layout:
        """The layout a partitioner's output (shards per axis, e.g. ``[1, 4, 1]``) describes."""
        shape = check_int_sequence(list(shape), "shape", 0)
        partitions = check_int_sequence(list(partitions), "partitions", 1)
        if len(shape) != len(partitions):
            raise ShardvarValueError(
                f"partitions {list(partitions)} must have one entry per dimension of shape {list(shape)}"
            )
        split = [i for i, p in enumerate(partitions) if p > 1]
        if len(split) > 1:
            raise ShardvarValueError(f"only one axis may have more than one shard; got partitions {list(partitions)}")
        axis = split[0] if split else 0
        if not shape:
            raise ShardvarValueError("a 0-d tensor cannot be partitioned; got shape []")
        n = partitions[axis]
        if n > max(shape[axis], 1):
            raise ShardvarValueError(
                f"cannot split axis {axis} of size {shape[axis]} into {n} shards; at most {shape[axis]}"
            )
        return cls(strategy, get_strategy(strategy).sizes(shape[axis], n), axis)

    # -- properties ---------------------------------------------------------------------------
    @property
    def num_shards(self) -> int:
        return len(self.sizes)

    @property
    def num_rows(self) -> int:
        return sum(self.sizes)

    @property
    def offsets(self) -> tuple[int, ...]:
        """First logical row of each shard (``div`` only: ``mod`` shards are not contiguous)."""
        if not get_strategy(self.strategy).contiguous:
            raise ShardvarValueError(
                f"{self.strategy} shards are not contiguous ranges; use shard_ids(s) instead of offsets"
            )
        return _offsets(self.sizes)

    def __str__(self) -> str:
        return f"{self.strategy}[{', '.join(map(str, self.sizes))}]@axis{self.axis}"

    # -- shapes -------------------------------------------------------------------------------
    def check_shape(self, shape: Sequence[int]) -> tuple[int, ...]:
        """Raise unless ``shape`` is a logical shape this layout splits; return it as a tuple."""
        shape = tuple(int(d) for d in shape)
        if self.axis >= len(shape):
            raise ShardvarValueError(f"layout axis {self.axis} is out of range for shape {list(shape)}")
        if shape[self.axis] != self.num_rows:
            raise ShardvarValueError(
                f"layout {self} covers {self.num_rows} rows but shape {list(shape)} has "
                f"{shape[self.axis]} along axis {self.axis}"
            )
        return shape

    def shard_shape(self, shape: Sequence[int], shard: int) -> tuple[int, ...]:
        """Shape of shard ``shard`` of a logical tensor of ``shape``."""
        shape = self.check_shape(shape)
        if not 0 <= shard < self.num_shards:
            raise ShardvarIndexError(f"shard must be in [0, {self.num_shards}); got {shard}")
        return (*shape[: self.axis], self.sizes[shard], *shape[self.axis + 1 :])

    def shard_shapes(self, shape: Sequence[int]) -> list[tuple[int, ...]]:
        return [self.shard_shape(shape, s) for s in range(self.num_shards)]

    # -- ids ----------------------------------------------------------------------------------
    def locate(self, ids: object, check: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """Logical ids -> (shard, local row), vectorised; ids outside [0, rows) raise IndexError."""
        ids = as_ids(ids)
        if check:
            check_ids(ids, self.num_rows)
        return get_strategy(self.strategy).locate(self.sizes, ids)

    def global_ids(self, shard: object, row: object) -> torch.Tensor:
        """(shard, local row) -> logical ids; the inverse of :meth:`locate`."""
        shard, row = as_ids(shard), as_ids(row)
        shard, row = torch.broadcast_tensors(shard, row)
        check_ids(shard, self.num_shards)
        sizes = torch.tensor(self.sizes, dtype=torch.int64, device=shard.device)
        bad = (row < 0) | (row >= sizes[shard])
        if bool(bad.any()):
            i = int(torch.nonzero(bad.reshape(-1))[0])
            s, r = int(shard.reshape(-1)[i]), int(row.reshape(-1)[i])
            raise ShardvarIndexError(f"local row must be in [0, {self.sizes[s]}) for shard {s}; got {r}")
        return get_strategy(self.strategy).global_ids(self.sizes, shard, row)

    def storage_rows(self, ids: object, check: bool = True) -> torch.Tensor:
        """Row of each logical id in the shards concatenated in shard order (their storage order)."""
        ids = as_ids(ids)
        if check:
            check_ids(ids, self.num_rows)
        return get_strategy(self.strategy).storage_rows(self.sizes, ids)

    def shard_progression(self, shard: int) -> tuple[int, int, int]:
        """(start, step, count): shard ``shard`` holds logical indices ``start + step * i``, i < count."""
        if not 0 <= shard < self.num_shards:
            raise ShardvarIndexError(f"shard must be in [0, {self.num_shards}); got {shard}")
        start, step = get_strategy(self.strategy).progression(self.sizes, shard)
        return start, step, self.sizes[shard]

    def shard_ids(self, shard: int, device: torch.device | str | None = None) -> torch.Tensor:
        """The logical ids shard ``shard`` holds, in local row order."""
        if not 0 <= shard < self.num_shards:
            raise ShardvarIndexError(f"shard must be in [0, {self.num_shards}); got {shard}")
        rows = torch.arange(self.sizes[shard], device=device)
        return get_strategy(self.strategy).global_ids(self.sizes, torch.full_like(rows, shard), rows)

    # -- slices -------------------------------------------------------------------------------
    def decompose_slice(self, key: slice) -> SlicePlan:
        """Per-shard local slices equal to ``key`` applied to the whole axis (numpy semantics)."""
        return _plan(self.strategy, self.sizes, *normalise_slice(key, self.num_rows))


@functools.lru_cache(maxsize=1024)
def _offsets(sizes: tuple[int, ...]) -> tuple[int, ...]:
    out, acc = [], 0
    for s in sizes:
        out.append(acc)
        acc += s
    return tuple(out)


@functools.lru_cache(maxsize=1024)
def _plan(strategy: str, sizes: tuple[int, ...], start: int, stop: int, step: int) -> SlicePlan:
    pieces = get_strategy(strategy).slice_pieces(sizes, start, stop, step)
    return SlicePlan(tuple(pieces), len(range(start, stop, step)))
