"""``shardvar demo``'s data and model: Zipf clicks, a recommendation model with two tables, its training loop.

Shared by the one-process demo and the distributed one (``--procs N``). Nothing here prints: a
caller that draws progress passes a ``StepBar``.
"""

from __future__ import annotations

import functools
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..checkpoint import load
from ..nn import ShardedEmbedding
from ..variables import RowInitializer

__all__ = [
    "Clicks",
    "DemoSettings",
    "RecModel",
    "StepBar",
    "checkpoint_dir",
    "eval_batch",
    "no_bar",
    "other_strategy",
    "rec_tables",
    "restore_and_compare",
    "step_summary",
    "train_step",
    "train_twins",
    "zipf",
]

# A progress display for a loop of ``total`` steps: ``bar(label, total)`` is a context whose value is
# called once a step with the running loss. Picklable (a module-level function or a partial of one),
# so distributed workers get it too.
StepBar = Callable[[str, int], AbstractContextManager[Callable[[float], None]]]


@contextmanager
def no_bar(label: str, total: int) -> Iterator[Callable[[float], None]]:
    """A ``StepBar`` that shows nothing."""
    yield lambda loss: None


@dataclass(frozen=True)
class DemoSettings:
    """What ``shardvar demo`` trains: table sizes, shards, steps, and (``tables``) the DLRM-style variant."""

    users: int = 100_000
    items: int = 20_000
    dim: int = 32
    shards: int = 4
    strategy: str = "mod"
    restore_shards: int = 3
    steps: int = 300
    batch: int = 512
    lr: float = 0.01
    seed: int = 0
    procs: int = 1
    tables: int | None = None
    scale: float = 0.01


def zipf(n: int, size: int, g: torch.Generator, exponent: float = 1.05) -> torch.Tensor:
    """Ids whose popularity follows Zipf(exponent), the hot ones scattered over [0, n)."""
    weights, scatter = _zipf_tables(n, exponent)
    return scatter[torch.multinomial(weights, size, replacement=True, generator=g)]


@functools.lru_cache(maxsize=8)
def _zipf_tables(n: int, exponent: float) -> tuple[torch.Tensor, torch.Tensor]:
    # Drawn once per table size rather than per batch: a permutation of 100k ids per batch cost
    # as much as a training step.
    weights = torch.arange(1, n + 1, dtype=torch.float64).pow(-exponent).float()
    return weights, torch.randperm(n, generator=torch.Generator().manual_seed(n))


class Clicks:
    """Click labels ~ Bernoulli(sigmoid(true_user . true_item)), ids Zipf-distributed."""

    def __init__(self, users: int, items: int, seed: int, dim: int = 8) -> None:
        g = torch.Generator().manual_seed(seed)
        self.true_users = torch.randn(users, dim, generator=g)
        self.true_items = torch.randn(items, dim, generator=g)
        self.users, self.items = users, items

    def batch(self, size: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        u, i = zipf(self.users, size, g), zipf(self.items, size, g)
        p = torch.sigmoid((self.true_users[u] * self.true_items[i]).sum(1))
        return u, i, torch.bernoulli(p, generator=g)


class RecModel(nn.Module):
    """User and item tables (sharded, or plain nn.Embedding for the baseline) and an MLP."""

    def __init__(self, users: nn.Module, items: nn.Module, dim: int) -> None:
        super().__init__()
        self.users, self.items = users, items
        self.mlp = nn.Sequential(nn.Linear(3 * dim, 64), nn.ReLU(), nn.Linear(64, 1))

    def forward(self, users: torch.Tensor, items: torch.Tensor, mlp: nn.Module | None = None) -> torch.Tensor:
        u, i = self.users(users), self.items(items)
        return (mlp or self.mlp)(torch.cat([u, i, u * i], dim=1)).squeeze(1)


def rec_tables(args: DemoSettings, shards: int, partition_strategy: str) -> tuple[nn.Module, nn.Module]:
    """The user and item tables in ``shards`` ``partition_strategy`` shards, values drawn by row from the seed."""
    init = RowInitializer(seed=args.seed, std=0.1)
    users = ShardedEmbedding(args.users, args.dim, shards, partition_strategy, _weight=init((args.users, args.dim)))
    items = ShardedEmbedding(args.items, args.dim, shards, partition_strategy, _weight=init((args.items, args.dim)))
    return users, items


def train_step(model: RecModel, opt: torch.optim.Optimizer, batch: tuple, mlp: nn.Module | None = None) -> float:
    """One step on one batch (users, items, labels); the loss."""
    users, items, labels = batch
    loss = nn.functional.binary_cross_entropy_with_logits(model(users, items, mlp), labels)
    opt.zero_grad()
    loss.backward()
    opt.step()
    return float(loss.detach())


def train_twins(
    models: tuple[RecModel, RecModel], data: Clicks, args: DemoSettings, bar: StepBar = no_bar
) -> tuple[list[float], tuple[list[float], list[float]]]:
    """Train two models on the same batches, a step of one then a step of the other.

    Returns the first model's losses and each model's step times (seconds). The two are timed
    interleaved so that a change in the machine's load lands on both alike (timed in two phases,
    a burst of other work once made the sharded twin look 2.8x slower). The order alternates
    each step, so neither always runs on the caches the other left. Timed with perf_counter, not
    torch.utils.benchmark.Timer: each call is a new step on a new batch, alternating with the
    twin's, and Timer repeats one statement (its warm-up runs would be extra training steps).
    """
    opts = [torch.optim.Adam(m.parameters(), lr=args.lr) for m in models]
    g = torch.Generator().manual_seed(args.seed + 1)
    losses: list[float] = []
    seconds: tuple[list[float], list[float]] = ([], [])
    with bar("training (sharded | unsharded, interleaved)", args.steps) as advance:
        for step in range(args.steps):
            batch = data.batch(args.batch, g)
            for k in (0, 1) if step % 2 == 0 else (1, 0):
                start = time.perf_counter()
                loss = train_step(models[k], opts[k], batch)
                seconds[k].append(time.perf_counter() - start)
                if k == 0:
                    losses.append(loss)
            advance(sum(losses[-20:]) / len(losses[-20:]))
    for m, opt in zip(models, opts, strict=True):
        m.optimizer = opt  # kept for the checkpoint
    return losses, seconds


def step_summary(seconds: tuple[list[float], list[float]], warmup: int = 3, block: int = 25) -> dict[str, str]:
    """Medians of the interleaved step times, their middle half, and the ratio per block of steps."""
    a, b = (s[warmup:] or s for s in seconds)

    def quartiles(x: list[float]) -> str:
        q = statistics.quantiles(x, n=4) if len(x) > 1 else [x[0]] * 3
        return f"{statistics.median(x) * 1e3:.1f} ms (middle half {q[0] * 1e3:.1f}-{q[2] * 1e3:.1f})"

    ratio = statistics.median(a) / statistics.median(b)
    blocks = [
        statistics.median(a[i : i + block]) / statistics.median(b[i : i + block]) for i in range(0, len(a), block)
    ]
    return {
        "time per step, sharded": quartiles(a),
        "time per step, unsharded (nn.Embedding)": f"{quartiles(b)} (sharded: {ratio:.2f}x)",
        "sharded / unsharded, interleaved": (
            f"{ratio:.2f}x (median of {len(a)} steps each; per {block} steps {min(blocks):.2f}-{max(blocks):.2f}x)"
        ),
    }


def eval_batch(data: Clicks, args: DemoSettings) -> tuple[torch.Tensor, torch.Tensor]:
    """Held-out users and items (a generator training never uses)."""
    u, i, _ = data.batch(4096, torch.Generator().manual_seed(args.seed + 99))
    return u, i


def restore_and_compare(
    args: DemoSettings,
    path: Path,
    reference: torch.Tensor,
    data: Clicks,
    progress: Callable[[int, int], None] | None = None,
) -> tuple[RecModel, float]:
    """The checkpoint at ``path`` loaded into ``restore_shards`` shards of the other strategy, and the
    max |diff| of its predictions from ``reference``; ``progress(done, total)`` gets the bytes read."""
    shards, strategy = args.restore_shards, other_strategy(args.strategy)
    torch.manual_seed(12345)  # other initial values: everything must come from the checkpoint
    users, items = rec_tables(args, shards, strategy)
    restored = RecModel(users, items, args.dim)
    load({"model": restored}, path, progress=progress)
    with torch.no_grad():
        predictions = restored(*eval_batch(data, args))
    return restored, float((predictions - reference).abs().max())


def other_strategy(partition_strategy: str) -> str:
    """The strategy the demo restores into: the one it did not train with."""
    return "div" if partition_strategy == "mod" else "mod"


@contextmanager
def checkpoint_dir(keep: str | None) -> Iterator[Path]:
    """``keep`` (a directory the caller keeps), or a temporary directory removed when the block ends."""
    if keep:
        yield Path(keep)
        return
    path = Path(tempfile.mkdtemp(prefix="shardvar-demo-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
