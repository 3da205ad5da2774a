"""The Layout value object: how one logical tensor is split into shards along one axis."""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .._deprecation import renamed
from .._errors import ShardvarIndexError, ShardvarTypeError, ShardvarValueError
from .._validate import check_int, check_int_sequence
from ._ids import as_ids, check_ids, group_positions
from ._slices import SlicePlan, normalise_slice
from ._strategies import Strategy, balanced_sizes, get_strategy, starts_of

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


@dataclass(frozen=True)
class Layout:
    """How a logical tensor is split into shards along ``axis``.

    ``strategy="div"``: shard s holds a contiguous range of ``sizes[s]`` rows (any sizes; the
    reference's balanced split gives the first ``rows % n`` shards one extra row).
    ``strategy="mod"``: id i lives in shard ``i % n`` at local row ``i // n``.
    A layout splits a tensor into its shards (:meth:`split`), joins them back (:meth:`join`)
    and serialises itself (:meth:`to_json`, :meth:`from_json`).

    >>> layout = Layout.div(10, 4)
    >>> layout
    Layout(strategy='div', sizes=(3, 3, 2, 2), axis=0)
    >>> layout.locate(torch.tensor([0, 3, 9]))
    (tensor([0, 1, 3]), tensor([0, 0, 1]))
    >>> eval(repr(layout)) == layout and Layout.from_json(layout.to_json()) == layout
    True
    """

    strategy: Strategy
    sizes: tuple[int, ...]
    axis: int = 0

    def __post_init__(self) -> None:
        strategy = get_strategy(self.strategy)
        if isinstance(self.sizes, (str, bytes)) or not isinstance(self.sizes, Sequence):
            raise ShardvarTypeError(f"sizes must be a sequence of ints; got {self.sizes!r}")
        sizes = check_int_sequence(self.sizes, "shard sizes", 0)
        if not sizes:
            raise ShardvarValueError("a layout needs at least one shard; got sizes ()")
        axis = check_int(self.axis, "axis", minimum=0)
        strategy.check_sizes(sizes)
        object.__setattr__(self, "strategy", strategy)
        object.__setattr__(self, "sizes", sizes)
        object.__setattr__(self, "axis", axis)

    # -- constructors -------------------------------------------------------------------------
    @classmethod
    def div(cls, num_rows: int, num_shards: int, axis: int = 0) -> Layout:
        """Contiguous ranges; the first ``num_rows % num_shards`` shards get one extra row."""
        return cls.balanced("div", num_rows, num_shards, axis)

    @classmethod
    def mod(cls, num_rows: int, num_shards: int, axis: int = 0) -> Layout:
        """Id i in shard ``i % num_shards`` at row ``i // num_shards``."""
        return cls.balanced("mod", num_rows, num_shards, axis)

    @classmethod
    def balanced(cls, strategy: str | Strategy, num_rows: int, num_shards: int, axis: int = 0) -> Layout:
        """``strategy``'s canonical sizes for ``num_rows`` rows over ``num_shards`` shards."""
        n = check_int(num_shards, "num_shards", minimum=1)
        rows = check_int(num_rows, "num_rows", minimum=0)
        strategy = get_strategy(strategy)
        return cls(strategy, strategy.sizes(rows, n), axis)

    @classmethod
    def explicit(cls, sizes: Sequence[int], axis: int = 0) -> Layout:
        """Contiguous ranges of the given sizes (zero-size shards allowed)."""
        return cls("div", tuple(sizes), axis)

    @classmethod
    def ceil(cls, num_rows: int, num_shards: int, axis: int = 0) -> Layout:
        """Contiguous ``torch.chunk``-style ranges, as DTensor and TorchRec split rows."""
        n = check_int(num_shards, "num_shards", minimum=1)
        return cls("div", ceil_sizes(check_int(num_rows, "num_rows", minimum=0), n), axis)

    @classmethod
    @renamed(strategy="partition_strategy")
    def from_partitions(
        cls, shape: Sequence[int], partitions: Sequence[int], partition_strategy: str = "div"
    ) -> Layout:
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
        return cls.balanced(partition_strategy, shape[axis], n, axis)

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> Layout:
        """The layout :meth:`to_json` wrote; anything malformed raises ShardvarValueError."""
        if not isinstance(obj, Mapping) or set(obj) != {"strategy", "sizes", "axis"}:
            raise ShardvarValueError(f"a layout's JSON form is {{'strategy', 'sizes', 'axis'}}; got {obj!r:.200}")
        if not isinstance(obj["sizes"], (list, tuple)):
            raise ShardvarValueError(f"a layout's sizes must be a list of ints; got {obj['sizes']!r:.100}")
        return cls(obj["strategy"], tuple(obj["sizes"]), obj["axis"])

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict: ``{"strategy": ..., "sizes": [...], "axis": ...}``."""
        return {"strategy": str(self.strategy.name), "sizes": list(self.sizes), "axis": self.axis}

    # -- properties ---------------------------------------------------------------------------
    @property
    def num_shards(self) -> int:
        return len(self.sizes)

    @property
    def num_rows(self) -> int:
        return sum(self.sizes)

    @property
    def contiguous(self) -> bool:
        """Whether each shard holds one contiguous range of logical rows."""
        return self.strategy.contiguous

    @property
    def is_balanced(self) -> bool:
        """Whether the sizes are the strategy's canonical ones (the reference's split)."""
        return self.sizes == balanced_sizes(self.num_rows, self.num_shards)

    @property
    def offsets(self) -> tuple[int, ...]:
        """First logical row of each shard (``div`` only: ``mod`` shards are not contiguous)."""
        if not self.contiguous:
            raise ShardvarValueError(
                f"{self.strategy} shards are not contiguous ranges; use shard_ids(s) instead of offsets"
            )
        return starts_of(self.sizes)

    @property
    def storage_offsets(self) -> tuple[int, ...]:
        """First row of each shard when the shards lie back to back in shard order (any strategy)."""
        return starts_of(self.sizes)

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

    def _check_shard(self, shard: int) -> int:
        if not 0 <= shard < self.num_shards:
            raise ShardvarIndexError(f"shard must be in [0, {self.num_shards}); got {shard}")
        return shard

    def shard_shape(self, shape: Sequence[int], shard: int) -> tuple[int, ...]:
        """Shape of shard ``shard`` of a logical tensor of ``shape``."""
        shape = self.check_shape(shape)
        self._check_shard(shard)
        return (*shape[: self.axis], self.sizes[shard], *shape[self.axis + 1 :])

    def shard_shapes(self, shape: Sequence[int]) -> list[tuple[int, ...]]:
        return [self.shard_shape(shape, s) for s in range(self.num_shards)]

    # -- tensors ------------------------------------------------------------------------------
    def split(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Each shard's part of the logical ``tensor``, as views of it (clone to own them).

        >>> [p.tolist() for p in Layout.mod(5, 2).split(torch.arange(5))]
        [[0, 2, 4], [1, 3]]
        """
        self.check_shape(tensor.shape)
        return self.strategy.split(tensor, self.sizes, self.axis)

    def join(self, parts: Sequence[torch.Tensor]) -> torch.Tensor:
        """The logical tensor from its shards (on the first part's device; differentiable).

        >>> Layout.mod(5, 2).join([torch.tensor([0, 2, 4]), torch.tensor([1, 3])]).tolist()
        [0, 1, 2, 3, 4]
        """
        if len(parts) != self.num_shards:
            raise ShardvarValueError(f"layout {self} joins {self.num_shards} shards; got {len(parts)}")
        device = parts[0].device
        return self.strategy.join([p.to(device) for p in parts], self.sizes, self.axis)

    # -- ids ----------------------------------------------------------------------------------
    def locate(self, ids: object, check: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """Logical ids -> (shard, local row), vectorised; ids outside [0, rows) raise IndexError."""
        ids = as_ids(ids)
        if check:
            check_ids(ids, self.num_rows)
        return self.strategy.locate(self.sizes, ids)

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
        return self.strategy.global_ids(self.sizes, shard, row)

    def split_ids(self, ids: torch.Tensor) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
        """For each shard that valid 1-D ``ids`` touch: (shard, positions in ``ids``, local rows).

        >>> [(s, p.tolist(), r.tolist()) for s, p, r in Layout.mod(10, 2).split_ids(torch.tensor([3, 4, 5]))]
        [(0, [1], [2]), (1, [0, 2], [1, 2])]
        """
        shard, row = self.strategy.locate(self.sizes, ids)
        return [(s, pos, row.index_select(0, pos)) for s, pos in group_positions(shard, self.num_shards)]

    def storage_rows(self, ids: object, check: bool = True) -> torch.Tensor:
        """Row of each logical id in the shards concatenated in shard order (their storage order)."""
        ids = as_ids(ids)
        if check:
            check_ids(ids, self.num_rows)
        return self.strategy.storage_rows(self.sizes, ids)

    def shard_progression(self, shard: int) -> tuple[int, int, int]:
        """(start, step, count): shard ``shard`` holds logical indices ``start + step * i``, i < count."""
        start, step = self.strategy.progression(self.sizes, self._check_shard(shard))
        return start, step, self.sizes[shard]

    def shard_ids(self, shard: int, device: torch.device | str | None = None) -> torch.Tensor:
        """The logical ids shard ``shard`` holds, in local row order."""
        start, step, count = self.shard_progression(shard)
        return start + step * torch.arange(count, device=device)

    # -- slices -------------------------------------------------------------------------------
    def decompose_slice(self, key: slice) -> SlicePlan:
        """Per-shard local slices equal to ``key`` applied to the whole axis (numpy semantics)."""
        return _plan(self.strategy, self.sizes, *normalise_slice(key, self.num_rows))


@functools.lru_cache(maxsize=1024)
def _plan(strategy: Strategy, sizes: tuple[int, ...], start: int, stop: int, step: int) -> SlicePlan:
    pieces = strategy.slice_pieces(sizes, start, stop, step)
    return SlicePlan(tuple(pieces), len(range(start, stop, step)))
