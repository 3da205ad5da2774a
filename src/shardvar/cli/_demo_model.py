"""The demo's data and model: Zipf clicks, a recommendation model with two tables, its training loop.

Shared by the one-process demo and the distributed one (``--procs N``).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from torch import nn

from ..checkpoint import load
from ..nn import ShardedEmbedding
from ..variables import RowInitializer
from ._progress import StepBar

__all__ = ["Clicks", "RecModel", "zipf"]


def zipf(n: int, size: int, g: torch.Generator, exponent: float = 1.05) -> torch.Tensor:
    """Ids whose popularity follows Zipf(exponent), the hot ones scattered over [0, n)."""
    weights = torch.arange(1, n + 1, dtype=torch.float64).pow(-exponent).float()
    scatter = torch.randperm(n, generator=torch.Generator().manual_seed(n))
    return scatter[torch.multinomial(weights, size, replacement=True, generator=g)]


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


def _train(
    model: RecModel, data: Clicks, args: argparse.Namespace, label: str, show: bool
) -> tuple[list[float], float]:
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    g = torch.Generator().manual_seed(args.seed + 1)
    losses = []
    with StepBar(label, args.steps, enabled=show) as bar:
        start = time.perf_counter()
        for step in range(args.steps):
            users, items, label_ = data.batch(args.batch, g)
            loss = nn.functional.binary_cross_entropy_with_logits(model(users, items), label_)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
            bar.update(step + 1, f"loss {sum(losses[-20:]) / len(losses[-20:]):.4f}")
        seconds = time.perf_counter() - start
    model.optimizer = opt  # kept for the checkpoint
    return losses, seconds / args.steps


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
    load({"model": restored}, path)
    with torch.no_grad():
        predictions = restored(*_eval_batch(data, args))
    return restored, float((predictions - reference).abs().max())


def _other(strategy: str) -> str:
    """The strategy the demo restores into: the one it did not train with."""
    return "div" if strategy == "mod" else "mod"
