"""Partition strategies: how logical rows map to (shard, local row), and how tensors split and join.

Each strategy is a singleton registered in :data:`STRATEGIES`. A strategy *is* its name (a
``str`` subclass, so ``layout.strategy == "div"`` holds and a Layout's repr stays
``Layout(strategy='div', ...)``) and carries its behaviour; nothing else in shardvar dispatches
on a strategy's name. Every function here is pure and vectorised over ids.
"""

from __future__ import annotations

import functools

import torch

from .._errors import ShardvarValueError
from ._slices import SlicePiece, div_slice_pieces, mod_slice_pieces

__all__ = ["Strategy", "DivStrategy", "ModStrategy", "STRATEGIES", "get_strategy", "balanced_sizes", "mod_sizes"]


def balanced_sizes(num_rows: int, num_shards: int) -> tuple[int, ...]:
    """Contiguous sizes where the first ``num_rows % num_shards`` shards get one extra row."""
    q, r = divmod(num_rows, num_shards)
    return (q + 1,) * r + (q,) * (num_shards - r)


def mod_sizes(num_rows: int, num_shards: int) -> tuple[int, ...]:
    """Rows held by each shard when id ``i`` lives in shard ``i % num_shards``."""
    return balanced_sizes(num_rows, num_shards)


@functools.lru_cache(maxsize=256)
def _ends_and_starts(sizes: tuple[int, ...], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    ends = torch.tensor(sizes, dtype=torch.int64, device=device).cumsum(0)
    return ends, ends - torch.tensor(sizes, dtype=torch.int64, device=device)


@functools.lru_cache(maxsize=1024)
def starts_of(sizes: tuple[int, ...]) -> tuple[int, ...]:
    """First storage row of each shard when the shards are laid back to back in shard order."""
    out, acc = [], 0
    for s in sizes:
        out.append(acc)
        acc += s
    return tuple(out)


def _along(axis: int, entry: slice) -> tuple:
    return (slice(None),) * axis + (entry,)


class Strategy(str):
    """One way of assigning logical rows to shards: a name that knows how to map, split and join."""

    name: str = ""
    contiguous: bool = False  # whether each shard holds one contiguous range of logical rows

    def __new__(cls, *_: object) -> Strategy:
        return super().__new__(cls, cls.name)

    def __reduce__(self) -> tuple:
        return get_strategy, (self.name,)  # unpickles to the registered singleton

    def __repr__(self) -> str:
        return repr(self.name)

    def sizes(self, num_rows: int, num_shards: int) -> tuple[int, ...]:
        """The canonical shard sizes of ``num_rows`` rows over ``num_shards`` shards."""
        raise NotImplementedError

    def check_sizes(self, sizes: tuple[int, ...]) -> None:
        """Raise ShardvarValueError when ``sizes`` cannot be a layout of this strategy."""
        raise NotImplementedError

    def locate(self, sizes: tuple[int, ...], ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Map valid logical ids to (shard, local row); both int64, shaped like ``ids``."""
        raise NotImplementedError

    def global_ids(self, sizes: tuple[int, ...], shard: torch.Tensor, row: torch.Tensor) -> torch.Tensor:
        """Inverse of :meth:`locate`."""
        raise NotImplementedError

    def slice_pieces(self, sizes: tuple[int, ...], start: int, stop: int, step: int) -> list[SlicePiece]:
        """Per-shard pieces of the normalised slice ``range(start, stop, step)``."""
        raise NotImplementedError

    def progression(self, sizes: tuple[int, ...], shard: int) -> tuple[int, int]:
        """(first logical index, step) of the indices shard ``shard`` holds, in local order."""
        raise NotImplementedError

    def storage_rows(self, sizes: tuple[int, ...], ids: torch.Tensor) -> torch.Tensor:
        """Row of each id in the shards concatenated in shard order."""
        shard, row = self.locate(sizes, ids)
        _, starts = _ends_and_starts(sizes, ids.device)
        return starts[shard] + row

    def storage_rows_into(
        self, sizes: tuple[int, ...], ids: torch.Tensor, out: torch.Tensor, scratch: torch.Tensor | None = None
    ) -> torch.Tensor:
        """:meth:`storage_rows` of valid ``ids`` written into ``out`` (which may be ``ids``), allocating
        nothing where ``scratch`` (to work in) is given: a buffer used again costs no fresh pages.
        ``out`` and ``scratch`` are like ``ids``, of its dtype or, where ``out is ids``, any integer
        dtype that holds every row (int32 halves the bytes of each pass)."""
        return out.copy_(self.storage_rows(sizes, ids))

    def split(self, tensor: torch.Tensor, sizes: tuple[int, ...], axis: int) -> list[torch.Tensor]:
        """Each shard's part of ``tensor`` along ``axis``, as views (no copy)."""
        parts = []
        for s in range(len(sizes)):
            start, step = self.progression(sizes, s)
            stop = start + step * (sizes[s] - 1) + 1 if sizes[s] else start
            parts.append(tensor[_along(axis, slice(start, stop, step))])
        return parts

    def join(self, parts: list[torch.Tensor], sizes: tuple[int, ...], axis: int) -> torch.Tensor:
        """The logical tensor from its shards' parts (a new tensor; differentiable)."""
        whole = torch.cat(parts, dim=axis) if len(parts) > 1 else parts[0]
        if self.contiguous or len(parts) == 1:
            return whole
        order = self.storage_rows(sizes, torch.arange(sum(sizes), device=whole.device))
        return whole.index_select(axis, order)


class DivStrategy(Strategy):
    """Contiguous ranges of rows; any sizes (balanced, ceil-style, or explicit)."""

    name = "div"
    contiguous = True

    def sizes(self, num_rows: int, num_shards: int) -> tuple[int, ...]:
        return balanced_sizes(num_rows, num_shards)

    def check_sizes(self, sizes: tuple[int, ...]) -> None:
        return None  # any non-negative contiguous sizes form a valid div layout

    def locate(self, sizes: tuple[int, ...], ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n = len(sizes)
        num_rows = sum(sizes)
        if sizes == balanced_sizes(num_rows, n):
            # Arithmetic instead of a search: the common case, and the hot path of every lookup.
            q, r = divmod(num_rows, n)
            if r == 0:
                return ids.div(q, rounding_mode="floor"), ids.remainder(q)
            big, cut = q + 1, r * (q + 1)
            tail = (ids - cut).clamp_min(0)
            qq = max(q, 1)
            in_head = ids < cut
            shard = torch.where(in_head, ids.div(big, rounding_mode="floor"), r + tail.div(qq, rounding_mode="floor"))
            return shard, torch.where(in_head, ids.remainder(big), tail.remainder(qq))
        ends, starts = _ends_and_starts(sizes, ids.device)
        shard = torch.searchsorted(ends, ids, right=True)
        return shard, ids - starts[shard]

    def global_ids(self, sizes: tuple[int, ...], shard: torch.Tensor, row: torch.Tensor) -> torch.Tensor:
        _, starts = _ends_and_starts(sizes, row.device)
        return starts[shard] + row

    def slice_pieces(self, sizes: tuple[int, ...], start: int, stop: int, step: int) -> list[SlicePiece]:
        return div_slice_pieces(sizes, start, stop, step)

    def progression(self, sizes: tuple[int, ...], shard: int) -> tuple[int, int]:
        return starts_of(sizes)[shard], 1

    def storage_rows(self, sizes: tuple[int, ...], ids: torch.Tensor) -> torch.Tensor:
        return ids  # contiguous shards in order are the logical rows themselves

    def storage_rows_into(
        self, sizes: tuple[int, ...], ids: torch.Tensor, out: torch.Tensor, scratch: torch.Tensor | None = None
    ) -> torch.Tensor:
        return out if out is ids else out.copy_(ids)

    def split(self, tensor: torch.Tensor, sizes: tuple[int, ...], axis: int) -> list[torch.Tensor]:
        return [tensor.narrow(axis, start, size) for start, size in zip(starts_of(sizes), sizes, strict=True)]


class ModStrategy(Strategy):
    """Id ``i`` lives in shard ``i % n`` at local row ``i // n``."""

    name = "mod"

    def sizes(self, num_rows: int, num_shards: int) -> tuple[int, ...]:
        return mod_sizes(num_rows, num_shards)

    def check_sizes(self, sizes: tuple[int, ...]) -> None:
        expected = mod_sizes(sum(sizes), len(sizes))
        if tuple(sizes) != expected:
            raise ShardvarValueError(
                f"a mod layout of {sum(sizes)} rows over {len(sizes)} shards must have sizes "
                f"{list(expected)} (shard s holds ids s, s+n, ...); got {list(sizes)}"
            )

    def locate(self, sizes: tuple[int, ...], ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n = len(sizes)
        return ids.remainder(n), ids.div(n, rounding_mode="floor")

    def global_ids(self, sizes: tuple[int, ...], shard: torch.Tensor, row: torch.Tensor) -> torch.Tensor:
        return row * len(sizes) + shard

    def slice_pieces(self, sizes: tuple[int, ...], start: int, stop: int, step: int) -> list[SlicePiece]:
        return mod_slice_pieces(len(sizes), start, stop, step)

    def progression(self, sizes: tuple[int, ...], shard: int) -> tuple[int, int]:
        return shard, len(sizes)

    def storage_rows(self, sizes: tuple[int, ...], ids: torch.Tensor) -> torch.Tensor:
        # Shard s starts at s*q + min(s, r); pure arithmetic (no gather), bit operations when n is a
        # power of two: this runs on every lookup of a mod table.
        n = len(sizes)
        if n == 1:
            return ids
        q, r = divmod(sum(sizes), n)
        if n & (n - 1) == 0:
            shard, out = ids & (n - 1), ids >> (n.bit_length() - 1)
        else:
            shard, out = ids.remainder(n), ids.div(n, rounding_mode="floor")
        out.add_(shard, alpha=q)  # in place: each pass over the ids costs as much as the lookup's own
        return out.add_(shard.clamp(max=r)) if r else out  # clamp_ has no vmap batching rule

    def storage_rows_into(
        self, sizes: tuple[int, ...], ids: torch.Tensor, out: torch.Tensor, scratch: torch.Tensor | None = None
    ) -> torch.Tensor:
        n = len(sizes)
        if n == 1:
            return out if out is ids else out.copy_(ids)
        q, r = divmod(sum(sizes), n)
        if not r and out is not ids and out.dtype == torch.int64:
            # Id j*n + s is row s*q + j = q*id - (n*q - 1)*j: three passes, no scratch (int64 holds q*id).
            if n & (n - 1) == 0:
                torch.bitwise_right_shift(ids, n.bit_length() - 1, out=out)
            else:
                torch.div(ids, n, rounding_mode="floor", out=out)
            return out.mul_(1 - n * q).add_(ids, alpha=q)
        if n & (n - 1) == 0:
            shard = torch.bitwise_and(ids, n - 1, out=scratch)
            torch.bitwise_right_shift(ids, n.bit_length() - 1, out=out)
        else:
            shard = torch.remainder(ids, n, out=scratch)
            torch.div(ids, n, rounding_mode="floor", out=out)
        out.add_(shard, alpha=q)
        return out.add_(shard.clamp_(max=r)) if r else out


STRATEGIES: dict[str, Strategy] = {s.name: s for s in (DivStrategy(), ModStrategy())}


def get_strategy(name: object) -> Strategy:
    """The registered strategy called ``name``, with an error that lists the known ones."""
    if isinstance(name, Strategy):
        return name
    try:
        return STRATEGIES[name]  # type: ignore[index]
    except (KeyError, TypeError):
        raise ShardvarValueError(f"unknown partition strategy {name!r}; expected one of {sorted(STRATEGIES)}") from None
