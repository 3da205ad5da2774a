"""The demo's data and model: Zipf clicks, a recommendation model with two tables, its training loop.

Shared by the one-process demo and the distributed one (``--procs N``).
"""

from __future__ import annotations

import argparse
import functools
import shutil
import statistics
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

from ..checkpoint import load
from ..nn import ShardedEmbedding
from ..variables import RowInitializer
from ._console import byte_progress, step_progress

__all__ = ["Clicks", "RecModel", "checkpoint_dir", "step_summary", "train_step", "train_twins", "zipf"]


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


def _tables(args: argparse.Namespace, shards: int, strategy: str) -> tuple[nn.Module, nn.Module]:
    init = RowInitializer(seed=args.seed, std=0.1)
    users = ShardedEmbedding(args.users, args.dim, shards, strategy, _weight=init((args.users, args.dim)))
    items = ShardedEmbedding(args.items, args.dim, shards, strategy, _weight=init((args.items, args.dim)))
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
    models: tuple[RecModel, RecModel], data: Clicks, args: argparse.Namespace
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
    with step_progress(args.progress) as bar:
        task = bar.add_task("training (sharded | unsharded, interleaved)", total=args.steps, status="")
        for step in range(args.steps):
            batch = data.batch(args.batch, g)
            for k in (0, 1) if step % 2 == 0 else (1, 0):
                start = time.perf_counter()
                loss = train_step(models[k], opts[k], batch)
                seconds[k].append(time.perf_counter() - start)
                if k == 0:
                    losses.append(loss)
            bar.update(task, advance=1, status=f"loss {sum(losses[-20:]) / len(losses[-20:]):.4f}")
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


def _eval_batch(data: Clicks, args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    u, i, _ = data.batch(4096, torch.Generator().manual_seed(args.seed + 99))
    return u, i


def _restore_and_compare(
    args: argparse.Namespace, path: Path, reference: torch.Tensor, data: Clicks
) -> tuple[RecModel, float]:
    shards, strategy = args.restore_shards, _other(args.strategy)
    torch.manual_seed(12345)  # other initial values: everything must come from the checkpoint
    users, items = _tables(args, shards, strategy)
    restored = RecModel(users, items, args.dim)
    with byte_progress("restore", args.progress) as bar:
        load({"model": restored}, path, progress=bar)
    with torch.no_grad():
        predictions = restored(*_eval_batch(data, args))
    return restored, float((predictions - reference).abs().max())


def _other(strategy: str) -> str:
    """The strategy the demo restores into: the one it did not train with."""
    return "div" if strategy == "mod" else "mod"


@contextmanager
def checkpoint_dir(args: argparse.Namespace) -> Iterator[Path]:
    """``--checkpoint DIR`` (kept), or a temporary directory removed when the demo ends."""
    if args.checkpoint:
        yield Path(args.checkpoint)
        return
    path = Path(tempfile.mkdtemp(prefix="shardvar-demo-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def where(args: argparse.Namespace, path: Path) -> str:
    """Where the checkpoint went: its path when kept, else that it was removed."""
    return str(path) if args.checkpoint else "removed (--checkpoint DIR keeps it)"
