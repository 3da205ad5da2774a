"""How each partition strategy maps logical rows to (shard, local row).

The strategies live in one registry, :data:`STRATEGIES`; nothing else in shardvar dispatches
on a strategy's name. Every function here is pure and vectorised over ids.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Sequence

import torch

from .._errors import ShardvarValueError
from ._slices import SlicePiece, div_slice_pieces, mod_slice_pieces

__all__ = ["Strategy", "DivStrategy", "ModStrategy", "STRATEGIES", "balanced_sizes", "mod_sizes"]


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


class Strategy:
    """One way of assigning logical rows to shards. Subclasses are stateless singletons."""

    name: str = ""
    contiguous: bool = False  # whether each shard holds one contiguous range of logical rows

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

    def __repr__(self) -> str:
        return f"<strategy {self.name!r}>"


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
            big = q + 1
            cut = r * big
            if r == 0:
                return ids.div(q, rounding_mode="floor"), ids.remainder(q)
            tail = (ids - cut).clamp_min(0)
            qq = max(q, 1)
            in_head = ids < cut
            shard = torch.where(in_head, ids.div(big, rounding_mode="floor"), r + tail.div(qq, rounding_mode="floor"))
            row = torch.where(in_head, ids.remainder(big), tail.remainder(qq))
            return shard, row
        ends, starts = _ends_and_starts(sizes, ids.device)
        shard = torch.searchsorted(ends, ids, right=True)
        return shard, ids - starts[shard]

    def global_ids(self, sizes: tuple[int, ...], shard: torch.Tensor, row: torch.Tensor) -> torch.Tensor:
        _, starts = _ends_and_starts(sizes, row.device)
        return starts[shard] + row

    def slice_pieces(self, sizes: tuple[int, ...], start: int, stop: int, step: int) -> list[SlicePiece]:
        return div_slice_pieces(sizes, start, stop, step)

    def progression(self, sizes: tuple[int, ...], shard: int) -> tuple[int, int]:
        return sum(sizes[:shard]), 1

    def storage_rows(self, sizes: tuple[int, ...], ids: torch.Tensor) -> torch.Tensor:
        return ids  # contiguous shards in order are the logical rows themselves


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
        q, r = divmod(sum(sizes), n)
        if n & (n - 1) == 0:
            shard, row = ids & (n - 1), ids >> (n.bit_length() - 1)
        else:
            row = ids.div(n, rounding_mode="floor")
            shard = ids - row * n
        out = shard * q + row
        return out + shard.clamp(max=r) if r else out


STRATEGIES: dict[str, Strategy] = {s.name: s for s in (DivStrategy(), ModStrategy())}


def get_strategy(name: object) -> Strategy:
    """Look a strategy up by name, with an error that lists the known ones."""
    if isinstance(name, Strategy):
        return name
    try:
        return STRATEGIES[name]  # type: ignore[index]
    except (KeyError, TypeError):
        raise ShardvarValueError(f"unknown partition strategy {name!r}; expected one of {sorted(STRATEGIES)}") from None


def check_int_sequence(values: Sequence[object], what: str, minimum: int) -> tuple[int, ...]:
    """Turn ``values`` into a tuple of ints >= minimum, or raise naming the bad entry."""
    out = []
    for i, v in enumerate(values):
        if isinstance(v, bool):
            raise ShardvarValueError(f"{what} must be integers; got {v!r} at position {i}")
        try:
            v = operator.index(v)  # accepts int, numpy ints and 0-d integer tensors
        except TypeError:
            raise ShardvarValueError(f"{what} must be integers; got {v!r} at position {i}") from None
        if v < minimum:
            raise ShardvarValueError(f"{what} must be >= {minimum}; got {v} at position {i}")
        out.append(int(v))
    return tuple(out)
