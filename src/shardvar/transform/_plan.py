"""Plan: a strategy (name -> layout), a placement (name -> device of each shard) and what it uses."""

from __future__ import annotations

from dataclasses import dataclass, field

from .._errors import ShardvarError, ShardvarValueError
from .._format import format_bytes
from ._spec import PartitionSpec

__all__ = ["Plan", "PlanError"]


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

    HEADERS = ("device", "budget", "used", "use", "lookups", "shards")

    def rows(self) -> list[list[str]]:
        """One row per device under :attr:`HEADERS`: its budget, bytes used, share of lookups, shards."""
        rows = []
        for d, budget in self.budgets.items():
            shards = [f"{name}[{s}]" for name, where in self.placement.items() for s, x in enumerate(where) if x == d]
            share = f"{self.load.get(d, 0.0):.1%}" if self.load else "-"
            used = self.used.get(d, 0)
            rows.append([d, format_bytes(budget), format_bytes(used), f"{used / budget:.1%}", share, _summary(shards)])
        return rows

    def table(self) -> str:
        widths = (-12, 11, 11, 6, 8, 0)  # negative: left-aligned
        lines = [
            " ".join(f"{c:<{-w}}" if w < 0 else f"{c:>{w}}" for c, w in zip(r, widths, strict=True))
            for r in [list(self.HEADERS), *self.rows()]
        ]
        return "\n".join(line.rstrip() for line in lines)

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


def _summary(shards: list[str], limit: int = 6) -> str:
    if not shards:
        return "-"
    more = f", ... (+{len(shards) - limit})" if len(shards) > limit else ""
    return ", ".join(shards[:limit]) + more
