"""``shardvar demo --tables N``'s pieces: the DLRM-style model trained on P processes, beside its
unsharded twin, and restored into other layouts."""

from __future__ import annotations

import gc
import os
import socket
import statistics
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from ..checkpoint import load
from ..distributed import plan_collection
from ..distributed import save as distributed_save
from ..nn import TableConfig
from ._clicks import DemoSettings
from ._dlrm import DLRM, build_dlrm, criteo_tables, dlrm_batch, train_dlrm

__all__ = ["dlrm_on_processes", "dlrm_predict", "plain_dlrm", "restore_dlrm", "timed_train_dlrm"]


def _worker(rank: int, args: DemoSettings, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=args.procs, timeout=timedelta(seconds=120))
    configs = criteo_tables(args.scale, args.tables or 26)
    model = build_dlrm(configs, args.procs, "auto")
    seconds: list[float] = []
    losses = train_dlrm(model, configs, args.steps, args.batch, args.lr, args.procs, seconds)
    per_step = statistics.median(seconds[3:] or seconds)
    distributed_save({"model": model}, out)
    if rank == 0:
        placement = plan_collection(configs, args.procs)
        torch.save({"losses": losses, "per_step": per_step, "placement": placement}, Path(out) / "demo-run.pt")
    gc.collect()  # gloo work held by garbage cycles goes while the group is alive
    dist.destroy_process_group()


def dlrm_on_processes(args: DemoSettings, out: Path) -> dict[str, Any]:
    """Train on ``args.procs`` processes (``placement="auto"``) and save to ``out`` from every rank;
    rank 0's ``losses``, ``per_step`` (median seconds) and the ``placement`` it planned."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(args, port, str(out)), nprocs=args.procs, join=True)
    run = torch.load(out / "demo-run.pt", weights_only=False)
    (out / "demo-run.pt").unlink()
    return run


def plain_dlrm(model: nn.Module, configs: dict[str, TableConfig]) -> nn.Module:
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


def timed_train_dlrm(model: nn.Module, configs: dict, args: DemoSettings) -> tuple[list[float], float]:
    """Losses, and the median time of a step after the first few (which pay one-time costs)."""
    seconds: list[float] = []
    losses = train_dlrm(model, configs, args.steps, args.batch, args.lr, seconds=seconds)
    return losses, statistics.median(seconds[3:] or seconds)


def restore_dlrm(path: Path, configs: dict[str, TableConfig]) -> nn.Module:
    """Every table in 2 div shards (another layout than the saved one), loaded from the checkpoint."""
    other = {
        n: TableConfig(c.num_embeddings, c.embedding_dim, min(2, c.num_embeddings), "div") for n, c in configs.items()
    }
    model = build_dlrm(other, 1)
    load({"model": model}, path)
    return model


def dlrm_predict(model: nn.Module, configs: dict[str, TableConfig]) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits and clicks of held-out batches (steps training never draws)."""
    held_out = [dlrm_batch(configs, 2048, 1_000_000 + k) for k in range(2)]
    return torch.cat([model(d, i) for d, i, _ in held_out]), torch.cat([c for _, _, c in held_out])
