"""``shardvar demo --tables N``: the DLRM-style model with N Criteo-shaped tables in one collection.

One process trains it with the collection (one kernel per group of alike tables) and, side by
side, the unsharded model (one ``nn.EmbeddingBag`` per table, the same initial values); with
``--procs P`` the collection runs over P processes (gloo, ``placement="auto"``) and the
checkpoint it writes is compared with the one-process model. Then the checkpoint is restored into
other layouts and the predictions compared.
"""

from __future__ import annotations

import argparse
import gc
import os
import socket
import statistics
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from ..checkpoint import load, save
from ..distributed import plan_collection
from ..distributed import save as distributed_save
from ..nn import TableConfig
from ._console import format_bytes, print_table
from ._demo_model import checkpoint_dir, where
from ._demo_quantized import logloss_of, print_quantized, serve_quantized
from .dlrm import DLRM, batch, build, tables, train

__all__ = ["run_tables_demo"]


def _worker(rank: int, args: argparse.Namespace, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=args.procs, timeout=timedelta(seconds=120))
    configs = tables(args.scale, args.tables)
    model = build(configs, args.procs, "auto")
    seconds: list[float] = []
    losses = train(model, configs, args.steps, args.batch, args.lr, args.procs, seconds)
    per_step = statistics.median(seconds[3:] or seconds)
    distributed_save({"model": model}, out)
    if rank == 0:
        placement = plan_collection(configs, args.procs)
        torch.save({"losses": losses, "per_step": per_step, "placement": placement}, Path(out) / "demo-run.pt")
    gc.collect()  # gloo work held by garbage cycles goes while the group is alive
    dist.destroy_process_group()


def _plain(model: nn.Module, configs: dict[str, TableConfig]) -> nn.Module:
    """The same model with one nn.EmbeddingBag per table (values copied), for comparison."""
    bags = {n: nn.EmbeddingBag(c.num_embeddings, c.embedding_dim, mode=c.mode) for n, c in configs.items()}
    plain = DLRM(_Bags(bags), len(configs))
    plain.load_state_dict(model.state_dict())
    return plain


class _Bags(nn.Module):
    """Separate tables with the collection's interface (``embedding_bags.<name>.weight``)."""

    def __init__(self, bags: dict[str, nn.EmbeddingBag]) -> None:
        super().__init__()
        self.embedding_bags = nn.ModuleDict(bags)

    def forward(self, features: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {n: self.embedding_bags[n](ids) for n, ids in features.items()}


def _timed_train(model: nn.Module, configs: dict, args: argparse.Namespace) -> tuple[list[float], float]:
    """Losses, and the median time of a step after the first few (which pay one-time costs)."""
    seconds: list[float] = []
    losses = train(model, configs, args.steps, args.batch, args.lr, seconds=seconds)
    return losses, statistics.median(seconds[3:] or seconds)


def _restore(path: Path, configs: dict[str, TableConfig]) -> nn.Module:
    """Every table in 2 div shards (another layout than the saved one), loaded from the checkpoint."""
    other = {
        n: TableConfig(c.num_embeddings, c.embedding_dim, min(2, c.num_embeddings), "div") for n, c in configs.items()
    }
    model = build(other, 1)
    load({"model": model}, path)
    return model


def _predict(model: nn.Module, configs: dict[str, TableConfig]) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits and clicks of held-out batches (steps training never draws)."""
    held_out = [batch(configs, 2048, 1_000_000 + k) for k in range(2)]
    return torch.cat([model(d, i) for d, i, _ in held_out]), torch.cat([c for _, _, c in held_out])


def _checkpoint_and_restore(
    args: argparse.Namespace, path: Path, configs: dict, model: nn.Module, losses: list[float], rows: dict, batch: tuple
) -> float:
    """Save (from P processes with ``--procs P``), restore into other layouts; the predictions' max |diff|."""
    dense, ids, reference = batch
    if args.procs > 1:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.spawn(_worker, args=(args, port, str(path)), nprocs=args.procs, join=True)
        run = torch.load(path / "demo-run.pt", weights_only=False)
        kinds = [p if isinstance(p, str) else "table" for p in run["placement"].values()]
        spread = ", ".join(f"{kinds.count(k)} {k}" for k in ("row", "table", "replicate") if kinds.count(k))
        rows[f"{args.procs} processes"] = f"{run['per_step'] * 1e3:.1f} ms per step; placement auto: {spread}"
        rows["loss, processes vs one"] = (
            f"max |diff| = {max(abs(a - b) for a, b in zip(run['losses'], losses, strict=True)):.1e}"
        )
    else:
        save({"model": model}, path)
    restored = _restore(path, configs)
    with torch.no_grad():
        diff = float((restored(dense, ids) - reference).abs().max())
    rows["checkpoint"] = (
        f"{where(args, path)}; restored into 2 div shards per table: predictions max |diff| = {diff:.1e}"
    )
    return diff


def run_tables_demo(args: argparse.Namespace) -> int:
    configs = tables(args.scale, args.tables)
    model = build(configs, 1)
    plain = _plain(model, configs)
    total = sum(c.num_embeddings * c.embedding_dim * 4 for c in configs.values())
    print(f"shardvar demo: DLRM-style model, {args.tables} Criteo-shaped tables ({format_bytes(total)}), "
          f"{args.steps} steps of {args.batch}, {args.procs} process(es)")  # fmt: skip
    losses, step_s = _timed_train(model, configs, args)
    _, plain_s = _timed_train(plain, configs, args)
    rows = {"loss (first 10 steps -> last 10)": f"{sum(losses[:10]) / 10:.4f} -> {sum(losses[-10:]) / 10:.4f}"}
    groups = len(model.embeddings._groups)
    rows["lookups per step"] = f"{groups} kernel(s) for {args.tables} tables (one per group of alike tables)"
    rows["time per step (median)"] = f"{step_s * 1e3:.1f} ms (unsharded tables: {plain_s * 1e3:.1f} ms)"
    dense, ids, _ = batch(configs, 64, 10_000)
    with torch.no_grad():
        reference = model(dense, ids)
        rows["collection vs unsharded model"] = f"max |diff| = {float((reference - plain(dense, ids)).abs().max()):.1e}"
    with checkpoint_dir(args) as path:
        diff = _checkpoint_and_restore(args, path, configs, model, losses, rows, (dense, ids, reference))
    print_table(["summary", ""], [[k, v] for k, v in rows.items()])
    if args.quantize:
        print_quantized(serve_quantized(model, ["embeddings"], logloss_of(lambda m: _predict(m, configs))))
    ok = diff <= 1e-5 and losses[-1] == losses[-1]
    if not ok:
        print("shardvar demo: FAILED (restored predictions differ)")
    return 0 if ok else 1
