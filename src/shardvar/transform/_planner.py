"""plan: a strategy and placement that fit devices with memory budgets and balance their load.

What it promises, precisely:

* **Memory.** Every device ends within its budget, filled to the same fraction of its budget as
  every other (up to one row of each variable). Variables are split by rows (explicit contiguous
  sizes), largest first, each in proportion to the room every device has left against its fair
  share; variables under ``min_split_bytes`` are kept whole on the device with most room.
* **Lookups.** Given id frequencies for a variable, its rows are cut into one contiguous piece
  per device holding an equal share of the expected lookups, read from the table's hotter end,
  the devices with the fewest rows first; a device keeps the hottest window of its piece that
  fits its memory quota and the rest goes to devices below quota, and the cuts are corrected
  until the moved lookups are accounted for. Memory quotas are always met exactly. Lookup shares
  come out equal (to a percent or so) when frequencies fall off steeply from one end, as id
  frequencies do (Zipf-like); when rows are about equally hot no split can do better than shares
  in proportion to rows, and that is what it gives. ``Plan.load`` reports the shares reached.
  A device may hold two or more pieces of a table (``placement`` lists each shard's device).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence

import torch
from torch import nn

from .._errors import ShardvarValueError
from .._format import format_bytes
from .._validate import check_int, check_shape
from ..layout import Layout
from ..partitioners import element_size
from ._plan import Plan, PlanError
from ._spec import PartitionSpec

__all__ = ["plan", "Plan", "PlanError"]

_ROUNDS = 12  # cut, fill, recount: enough rounds for the moved mass to settle


def _split(total: int, weights: Sequence[float]) -> list[int]:
    """``total`` rows in proportion to ``weights`` (largest remainders), summing exactly."""
    s = sum(weights)
    raw = [total * w / s for w in weights]
    out = [math.floor(r) for r in raw]
    for i in sorted(range(len(raw)), key=lambda i: raw[i] - out[i], reverse=True)[: total - sum(out)]:
        out[i] += 1
    return out


def _fill(pieces: list[tuple[str, int, int]], quotas: dict[str, int], prefix: torch.Tensor) -> list[tuple]:
    """Each device keeps the hottest window of its piece that fits its row quota; the rest goes to
    devices under quota, in table order."""
    kept, released = [], []
    for d, a, b in pieces:
        q = min(quotas[d], b - a)
        window = prefix[a + q : b + 1] - prefix[a : b - q + 1]  # mass of every q-row window of the piece
        start = a + int(torch.argmax(window)) if b > a else a
        kept.append((d, start, start + q))
        released += [(x, y) for x, y in ((a, start), (start + q, b)) if y > x]
    short = {d: quotas[d] - (b - a) for d, a, b in kept if quotas[d] > b - a}
    for a, b in sorted(released):
        while a < b:
            d = max(short, key=lambda d: short[d])
            take = min(short[d], b - a)
            kept.append((d, a, a + take))
            short[d] -= take
            a += take
    return sorted((r for r in kept if r[2] > r[1]), key=lambda r: r[1])


def _spread(mass: torch.Tensor, quotas: dict[str, int]) -> list[tuple[str, int, int]]:
    """Row ranges per device (see ``_spread_from_head``), the table read from its hotter end."""
    rows = mass.numel()
    if float(mass[: rows // 2].sum()) >= 0.5:
        return _spread_from_head(mass, quotas)
    ranges = _spread_from_head(mass.flip(0), quotas)
    return sorted(((d, rows - b, rows - a) for d, a, b in ranges), key=lambda r: r[1])


def _spread_from_head(mass: torch.Tensor, quotas: dict[str, int]) -> list[tuple[str, int, int]]:
    """Row ranges per device: equal shares of the lookup mass, and each device's row quota exactly.

    The table is cut into one contiguous piece per device of equal mass; each device keeps the
    start of its piece up to its quota and passes the rest on (``_fill``). The mass passed on is
    then taken off the receivers' targets and the cut redone, which converges in a few rounds.
    """
    # Devices with the fewest rows take the first (for a hot head, densest) pieces: they need dense
    # rows to serve their share.
    devices = sorted((d for d in quotas if quotas[d] > 0), key=lambda d: quotas[d])
    cumulative = torch.cumsum(mass, 0)
    prefix = torch.cat([torch.zeros(1, dtype=torch.float64), cumulative])
    share = 1.0 / len(devices)
    targets = dict.fromkeys(devices, share)
    for _ in range(_ROUNDS):
        bounds = torch.tensor(list(targets.values())[:-1], dtype=torch.float64).cumsum(0)
        inner = torch.searchsorted(cumulative, bounds).add(1).clamp(max=mass.numel()).tolist()
        cuts = list(itertools.accumulate([0, *inner, mass.numel()], max))  # monotone across flat stretches
        pieces = list(zip(devices, cuts[:-1], cuts[1:], strict=True))
        ranges = _fill(pieces, quotas, prefix)
        final = dict.fromkeys(devices, 0.0)
        for d, a, b in ranges:
            final[d] += float(prefix[b] - prefix[a])
        targets = {d: max(targets[d] + share - final[d], 0.0) for d in devices}  # correct each cut by its miss
    return ranges


def _merge(ranges: list[tuple[str, int, int]]) -> tuple[list[int], list[str]]:
    """Adjacent ranges on one device become one shard: (sizes, device of each shard)."""
    sizes, where = [], []
    for d, a, b in ranges:
        if where and where[-1] == d:
            sizes[-1] += b - a
        else:
            sizes.append(b - a)
            where.append(d)
    return sizes, where


def _frequencies(frequencies: Mapping[str, object] | None, rows: dict[str, int]) -> dict[str, torch.Tensor]:
    """Each variable's lookup frequencies as masses summing to 1, checked: one finite weight >= 0 per row."""
    out = {}
    for name, f in (frequencies or {}).items():
        if name not in rows:
            raise ShardvarValueError(f"frequencies name {name!r}, which is not a variable of the plan: {sorted(rows)}")
        t = torch.as_tensor(f, dtype=torch.float64).reshape(-1)
        if t.numel() != rows[name]:
            raise ShardvarValueError(
                f"frequencies[{name!r}] has {t.numel()} entries; expected {rows[name]} (one per row)"
            )
        bad = ~torch.isfinite(t) | (t < 0)
        if bool(bad.any()):
            i = int(torch.nonzero(bad)[0])
            raise ShardvarValueError(f"frequencies[{name!r}] must be finite and >= 0; got {float(t[i])} at row {i}")
        if float(t.sum()) <= 0:
            raise ShardvarValueError(f"frequencies[{name!r}] are all zero; give at least one positive weight")
        out[name] = t / t.sum()
    return out


def _items(shapes: Mapping[str, Sequence[int]] | nn.Module, dtype: torch.dtype | str) -> list[tuple]:
    if isinstance(shapes, nn.Module):
        shapes = {n: tuple(p.shape) for n, p in shapes.named_parameters() if p.dim() >= 1}
    items = []
    for name, shape in shapes.items():
        shape = check_shape(shape)
        row_bytes = math.prod(shape[1:]) * element_size(dtype, 16)
        items.append((name, shape, row_bytes, shape[0] * row_bytes))
    return sorted(items, key=lambda i: -i[3])


def _budgets(devices: Mapping[str, int]) -> dict[str, int]:
    if not isinstance(devices, Mapping) or not devices:
        raise ShardvarValueError(
            f"plan needs at least one device with a budget, e.g. {{'cpu:0': 2 << 30}}; got {devices!r:.80}"
        )
    budgets = {str(d): check_int(b, f"the budget of {d}") for d, b in devices.items()}
    bad = [(d, b) for d, b in budgets.items() if b <= 0]
    if bad:
        raise ShardvarValueError(f"device budgets must be positive bytes; got {bad}")
    return budgets


def plan(
    shapes: Mapping[str, Sequence[int]] | nn.Module,
    devices: Mapping[str, int],
    *,
    dtype: torch.dtype | str = torch.float32,
    frequencies: Mapping[str, torch.Tensor] | None = None,
    min_split_bytes: int = 1 << 20,
) -> Plan:
    """Split each variable by rows over ``devices`` (name -> bytes budget) to fit and balance.

    See this module's docstring for what is balanced and how precisely.

    >>> p = plan({"users": (1000, 64), "items": (300, 64)}, {"cpu:0": 300_000, "cpu:1": 100_000}, min_split_bytes=0)
    >>> p.placement["users"], p.strategy["users"].partitioner.sizes
    (['cpu:0', 'cpu:1'], (750, 250))
    """
    items, budgets = _items(shapes, dtype), _budgets(devices)
    masses = _frequencies(frequencies, {name: shape[0] for name, shape, _, _ in items})
    total, capacity = sum(i[3] for i in items), sum(budgets.values())
    fair = {d: total * b / capacity for d, b in budgets.items()}
    if total > capacity:
        short = ", ".join(f"{d} by {format_bytes(fair[d] - budgets[d])}" for d in budgets)
        raise PlanError(
            f"the variables need {format_bytes(total)} but the devices hold {format_bytes(capacity)}: short by "
            f"{format_bytes(total - capacity)} in all (at a balanced fill: {short})"
        )
    result = Plan({}, {}, budgets, dict.fromkeys(budgets, 0), {}, {})
    load = dict.fromkeys(budgets, 0.0)
    for name, shape, row_bytes, nbytes in items:
        room = {d: max(0.0, fair[d] - result.used[d]) for d in budgets}
        if nbytes < min_split_bytes or shape[0] <= 1 or sum(room.values()) <= 0:
            best = max(budgets, key=lambda d: (budgets[d] - result.used[d], -list(budgets).index(d)))
            ranges = [(best, 0, shape[0])]
        else:
            quotas = dict(zip(room, _split(shape[0], list(room.values())), strict=True))
            if name in masses:
                ranges = _spread(masses[name], quotas)
            else:
                edges = [0, *torch.tensor(list(quotas.values())).cumsum(0).tolist()]
                ranges = [(d, a, b) for d, a, b in zip(quotas, edges, edges[1:], strict=False) if b > a]
        for d, a, b in ranges:
            result.used[d] += (b - a) * row_bytes
            if name in masses:
                load[d] += float(masses[name][a:b].sum())
        sizes, where = _merge(ranges)
        result.strategy[name] = PartitionSpec(Layout.explicit(sizes))
        result.placement[name] = where
        result.shard_bytes[name] = [s * row_bytes for s in sizes]
    _check_fits(result)
    if masses:
        result.load = {d: v / len(masses) for d, v in load.items()}
    return result


def _check_fits(result: Plan) -> None:
    over = {d: result.used[d] - b for d, b in result.budgets.items() if result.used[d] > b}
    if over:
        raise PlanError(
            "no split fits: "
            + ", ".join(
                f"{d} would be over its {format_bytes(result.budgets[d])} budget by {format_bytes(x)}"
                for d, x in over.items()
            )
        )
