"""Workers for the distributed table-optimizer tests (run by dist_workers.main)."""

from __future__ import annotations

from dist_workers import DIM, ROWS, batch
from shardvar import optim as so
from shardvar.distributed import DistributedEmbedding
from shardvar.variables import RowInitializer

OPTIMIZERS = {
    "RowWiseAdagrad": lambda m: so.RowWiseAdagrad(m, lr=0.1),
    "Adam": lambda m: so.Adam(m, lr=0.05),
    "SGD": lambda m: so.SGD(m, lr=0.1, momentum=0.9),
}


def train_table(rank: int, world: int, name: str, sparse: bool, fused: bool) -> dict:
    emb = DistributedEmbedding(ROWS, DIM, 4, "mod", initializer=RowInitializer(3), sparse=sparse)
    opt = OPTIMIZERS[name](emb)
    if fused:
        so.fuse(opt)
    for step in range(5):
        ids, _ = batch(rank, step, 11)
        emb(ids).pow(2).sum().backward()  # every rank's loss: the gradient is their sum
        opt.step()
        opt.zero_grad()
    return {"shards": {s: p.detach().clone() for s, p in emb.variable.local_shards().items()}}
