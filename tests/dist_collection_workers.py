"""Workers for the distributed embedding-collection tests (run by dist_workers.main)."""

from __future__ import annotations

import torch

import shardvar
from shardvar import TableConfig
from shardvar.distributed import DistributedEmbeddingBag, DistributedEmbeddingBagCollection
from shardvar.variables import RowInitializer

TABLES = {
    "a": TableConfig(30, 4, 3, "mod"),
    "b": TableConfig(20, 4, 2, "div"),
    "c": TableConfig(11, 4),
    "d": TableConfig(9, 6, 2, "div"),
    "e": TableConfig(7, 4),
    "f": TableConfig(5, 4),
    "g": TableConfig(6, 6),
}
PLACEMENT = {"c": "table", "e": 1, "f": "replicate", "g": "replicate"}


def batch(rank: int, step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return {k: torch.randint(0, c.num_embeddings, (3, 2), generator=g) for k, c in TABLES.items()}


def all_to_alls(module: torch.nn.Module) -> int:
    comms = {id(m.store.exchange.comm): m.store.exchange.comm for m in module.modules() if hasattr(m, "store")}
    return sum(c.calls["all_to_all"] for c in comms.values())


def train_collection(rank: int, world: int, path: str) -> dict:
    ebc = DistributedEmbeddingBagCollection(TABLES, placement=PLACEMENT, initializer=RowInitializer(5))
    shardvar.distributed.save({"model": ebc}, f"{path}/init")
    opt = torch.optim.SGD(ebc.parameters(), lr=0.1)
    per_step = []
    for step in range(4):
        before = all_to_alls(ebc)
        out = ebc(batch(rank, step))
        sum((v * (i + 1)).pow(2).sum() for i, v in enumerate(out.values())).backward()
        opt.step()
        opt.zero_grad()
        per_step.append(all_to_alls(ebc) - before)
    shardvar.distributed.save({"model": ebc}, f"{path}/final")
    lone = DistributedEmbeddingBag(30, 4, 2)
    before = all_to_alls(lone)
    lone(torch.tensor([[1, 2]])).sum().backward()
    return {"per_step": per_step, "one_table": all_to_alls(lone) - before, "groups": len(ebc.groups)}


SPARSE_TABLES = {"r": TableConfig(8, 4), "a": TableConfig(30, 4, 3, "mod")}


def train_sparse_replicated(rank: int, world: int, path: str) -> dict:
    ebc = DistributedEmbeddingBagCollection(
        SPARSE_TABLES, placement={"r": "replicate"}, sparse=True, initializer=RowInitializer(5)
    )
    shardvar.distributed.save({"model": ebc}, f"{path}/init")
    opt = torch.optim.SparseAdam(list(ebc.parameters()), lr=0.05)
    for step in range(4):
        g = torch.Generator().manual_seed(100 * step + rank)
        feats = {
            k: torch.randint(0, c.num_embeddings // (1 + rank), (3, 2), generator=g) for k, c in SPARSE_TABLES.items()
        }
        out = ebc(feats)
        sum(v.pow(2).sum() for v in out.values()).backward()
        opt.step()
        opt.zero_grad()
    shardvar.distributed.save({"model": ebc}, f"{path}/final")
    return {"replica": ebc.embedding_bags["r"].weight.detach().clone()}


def auto_placement(rank: int, world: int) -> dict:
    ebc = DistributedEmbeddingBagCollection(TABLES, placement="auto")
    out = ebc(batch(rank, 0))
    return {
        "groups": len(ebc.groups),
        "replicated": sorted(ebc.replicas.configs),
        "shapes": {k: tuple(v.shape) for k, v in out.items()},
    }
