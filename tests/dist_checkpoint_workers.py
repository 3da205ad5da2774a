"""Workers for the distributed asynchronous and delta checkpoint tests (run by dist_workers.main)."""

from __future__ import annotations

import threading

import torch
from torch import nn

import shardvar
from dist_workers import DIM, ROWS, Model, batch, local_state
from shardvar.distributed import DistributedEmbedding
from shardvar.variables import RowInitializer


def _train(model: Model, dense: nn.Module, opt: torch.optim.Optimizer, rank: int, steps: range) -> None:
    for step in steps:
        ids, target = batch(rank, step, 9)
        loss = (dense(model.emb(ids).mean(1)).squeeze(1) - target).pow(2).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()


def async_then_delta(rank: int, world: int, path: str) -> dict:
    """Train; save asynchronously and keep training (collectives included) while it writes; then a delta."""
    torch.manual_seed(0)
    model = Model(DistributedEmbedding(ROWS, DIM, 4, "mod", initializer=RowInitializer(5)))
    dense = nn.parallel.DistributedDataParallel(model.head)
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    _train(model, dense, opt, rank, range(2))
    snapshot = local_state(model, opt)
    reached, opened = threading.Event(), threading.Event()

    def gate(done: int, total: int) -> None:
        reached.set()
        opened.wait(60)

    handle = shardvar.distributed.save({"model": model, "opt": opt}, f"{path}/full", asynchronous=True, progress=gate)
    assert reached.wait(60)
    _train(model, dense, opt, rank, range(2, 5))  # all_to_alls and DDP all_reduces while the writer waits
    blocked = not handle.done()
    opened.set()
    handle.wait(60)
    shardvar.distributed.save({"model": model, "opt": opt}, f"{path}/delta", delta_of=f"{path}/full")
    return {"snapshot": snapshot, "final": local_state(model, opt), "blocked": blocked}
