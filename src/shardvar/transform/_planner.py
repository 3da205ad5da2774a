"""plan: a strategy and placement that fit devices with memory budgets and balance their load.

Each variable is split by rows (explicit contiguous sizes) among the devices in proportion to
the room each has left against its fair share of the total, largest variables first. Given id
frequencies, the split balances expected lookups as well as bytes.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from .._errors import ShardvarError, ShardvarValueError
from .._format import format_bytes
from ..layout import Layout
from ..partitioners import check_shape, element_size
from ._spec import PartitionSpec

__all__ = ["Plan", "PlanError", "plan"]


class PlanError(ShardvarError, ValueError):
    """The variables do not fit the devices; the message says which device and by how much."""


@dataclass
class Plan:
    """A strategy (name -> explicit layout), a placement (name -> device of each shard) and usage."""

    strategy: dict[str, PartitionSpec]
    placement: dict[str, list[str]]
    budgets: dict[str, int]
    used: dict[str, int] = field(default_factory=dict)
    load: dict[str, float] = field(default_factory=dict)
    shard_bytes: dict[str, list[int]] = field(default_factory=dict)

    def table(self) -> str:
        lines = [f"{'device':<12} {'budget':>11} {'used':>11} {'use':>6} {'lookups':>8}  shards"]
        for d, budget in self.budgets.items():
            shards = [
                f"{name}[{self.placement[name].index(d)}]" for name in self.placement if d in self.placement[name]
            ]
            share = f"{self.load.get(d, 0.0):7.1%}" if self.load else "      -"
            used = self.used.get(d, 0)
            lines.append(
                f"{d:<12} {format_bytes(budget):>11} {format_bytes(used):>11} {used / budget:6.1%} "
                f"{share:>8}  {', '.join(shards) or '-'}"
            )
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()

    def draw(self, path: str) -> None:
        """A PNG of the shard map: one bar per device, stacked by shard bytes (needs matplotlib)."""
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            raise ShardvarValueError("drawing a plan needs matplotlib: pip install 'shardvar[plot]'") from None
        devices = list(self.budgets)
        fig, ax = plt.subplots(figsize=(max(4, 1.6 * len(devices)), 4))
        bottoms = [0.0] * len(devices)
        colors = plt.get_cmap("tab20")
        for k, (name, where) in enumerate(self.placement.items()):
            for d, nbytes in zip(where, self.shard_bytes[name], strict=True):
                i = devices.index(d)
                ax.bar(i, nbytes / 2**20, bottom=bottoms[i] / 2**20, color=colors(k % 20), edgecolor="white")
                ax.text(i, (bottoms[i] + nbytes / 2) / 2**20, name, ha="center", va="center", fontsize=7)
                bottoms[i] += nbytes
        for i, d in enumerate(devices):
            ax.hlines(self.budgets[d] / 2**20, i - 0.4, i + 0.4, colors="red", linestyles="dashed")
        ax.set_xticks(range(len(devices)), devices)
        ax.set_ylabel("MiB (dashed: budget)")
        ax.set_title("shard map")
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)


def _split(total: int, weights: list[float]) -> list[int]:
    """``total`` rows in proportion to ``weights`` (largest remainders), summing exactly."""
    s = sum(weights)
    raw = [total * w / s for w in weights]
    out = [math.floor(r) for r in raw]
    for i in sorted(range(len(raw)), key=lambda i: raw[i] - out[i], reverse=True)[: total - sum(out)]:
        out[i] += 1
    return out


def _cut_by_cost(cost: torch.Tensor, shares: list[int], rows: int) -> list[int]:
    """Contiguous sizes whose summed ``cost`` follows the row ``shares`` of each device."""
    cumulative = torch.cumsum(cost.double(), 0)
    total = float(cumulative[-1])
    bounds, acc = [], 0
    for share in shares[:-1]:
        acc += share
        bounds.append(int(torch.searchsorted(cumulative, total * acc / rows)))
    edges = [0, *bounds, rows]
    return [max(0, b - a) for a, b in itertools.pairwise(edges)]


def plan(
    shapes: Mapping[str, Sequence[int]] | nn.Module,
    devices: Mapping[str, int],
    *,
    dtype: torch.dtype | str = torch.float32,
    frequencies: Mapping[str, torch.Tensor] | None = None,
    min_split_bytes: int = 1 << 20,
) -> Plan:
    """Split each variable by rows over ``devices`` (name -> bytes budget) to fit and balance.

    Variables smaller than ``min_split_bytes`` are kept whole, on the device with most room.
    ``frequencies[name]`` (one weight per row) balances expected lookups too.

    >>> p = plan({"users": (1000, 64), "items": (300, 64)}, {"cpu:0": 300_000, "cpu:1": 100_000}, min_split_bytes=0)
    >>> p.placement["users"], p.strategy["users"].partitioner.sizes
    (['cpu:0', 'cpu:1'], (750, 250))
    """
    if isinstance(shapes, nn.Module):
        shapes = {n: tuple(p.shape) for n, p in shapes.named_parameters() if p.dim() >= 1}
    if not devices:
        raise ShardvarValueError("plan needs at least one device with a budget, e.g. {'cpu:0': 2 << 30}")
    budgets = {str(d): int(b) for d, b in devices.items()}
    bad = [d for d, b in budgets.items() if b <= 0]
    if bad:
        raise ShardvarValueError(f"device budgets must be positive bytes; got {[(d, budgets[d]) for d in bad]}")
    items = []
    for name, shape in shapes.items():
        shape = check_shape(shape)
        row_bytes = math.prod(shape[1:]) * element_size(dtype, 16)
        items.append((name, shape, row_bytes, shape[0] * row_bytes))
    total, capacity = sum(i[3] for i in items), sum(budgets.values())
    fair = {d: total * b / capacity for d, b in budgets.items()}
    if total > capacity:
        short = ", ".join(f"{d} by {format_bytes(fair[d] - budgets[d])}" for d in budgets)
        raise PlanError(
            f"the variables need {format_bytes(total)} but the devices hold {format_bytes(capacity)}: short by "
            f"{format_bytes(total - capacity)} in all (at a balanced fill: {short})"
        )
    used = dict.fromkeys(budgets, 0)
    load = dict.fromkeys(budgets, 0.0)
    result = Plan({}, {}, budgets, used, {}, {})
    for name, shape, row_bytes, nbytes in sorted(items, key=lambda i: -i[3]):
        room = {d: max(0.0, fair[d] - used[d]) for d in budgets}
        if nbytes < min_split_bytes or shape[0] <= 1 or sum(room.values()) <= 0:
            best = max(budgets, key=lambda d: (budgets[d] - used[d], -list(budgets).index(d)))
            chosen, sizes = [best], [shape[0]]
        else:
            order = [d for d in budgets if room[d] > 0]
            shares = _split(shape[0], [room[d] for d in order])
            if frequencies and name in frequencies:
                f = torch.as_tensor(frequencies[name], dtype=torch.float64).reshape(-1)
                if f.numel() != shape[0]:
                    raise ShardvarValueError(
                        f"frequencies[{name!r}] has {f.numel()} entries; expected {shape[0]} (one per row)"
                    )
                # Balance expected lookups first; give way to a bytes balance only as far as the
                # budgets demand (the byte-balanced split always fits).
                by_bytes = shares
                for weight in (1.0, 0.75, 0.5, 0.25):
                    cost = (1 - weight) / shape[0] + weight * f / f.sum().clamp(min=1e-300)
                    shares = _cut_by_cost(cost, by_bytes, shape[0])
                    if all(used[d] + s * row_bytes <= budgets[d] for d, s in zip(order, shares, strict=True)):
                        break
                else:
                    shares = by_bytes
            chosen = [d for d, s in zip(order, shares, strict=True) if s > 0]
            sizes = [s for s in shares if s > 0]
        for d, rows in zip(chosen, sizes, strict=True):
            used[d] += rows * row_bytes
        if frequencies and name in frequencies:
            f = torch.as_tensor(frequencies[name], dtype=torch.float64).reshape(-1)
            edges = [0, *torch.tensor(sizes).cumsum(0).tolist()]
            for d, a, b in zip(chosen, edges, edges[1:], strict=False):
                load[d] += float(f[a:b].sum() / f.sum())
        result.strategy[name] = PartitionSpec(Layout.explicit(sizes))
        result.placement[name] = chosen
        result.shard_bytes[name] = [s * row_bytes for s in sizes]
    over = {d: used[d] - budgets[d] for d in budgets if used[d] > budgets[d]}
    if over:
        raise PlanError(
            "no split fits: "
            + ", ".join(
                f"{d} would be over its {format_bytes(budgets[d])} budget by {format_bytes(x)}" for d, x in over.items()
            )
        )
    if frequencies:
        weight = sum(1 for n in frequencies if n in shapes)
        result.load = {d: v / max(weight, 1) for d, v in load.items()}
    return result
