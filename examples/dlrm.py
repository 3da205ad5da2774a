"""A DLRM-style model on synthetic Criteo-shaped data: 26 sparse features in one embedding collection.

    python examples/dlrm.py --steps 100                          # one process
    torchrun --nproc-per-node 2 examples/dlrm.py --steps 100     # tables sharded over 2 ranks

13 dense features go through a bottom MLP; 26 categorical ones (Criteo's cardinalities scaled
down) are looked up in an ``EmbeddingBagCollection`` (one process) or a
``DistributedEmbeddingBagCollection`` (several: each step is one exchange for all 26 tables);
the pooled vectors and the bottom MLP's output interact by pairwise dot products, and a top MLP
predicts the click. Under torchrun each rank takes its slice of the same global batch and the
dense gradients are summed over ranks, so every world size trains the same model.
``--save DIR`` ends with a checkpoint any world size, layout or plain model can restore.
"""

from __future__ import annotations

import argparse
import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

import shardvar
from shardvar import EmbeddingBagCollection, TableConfig
from shardvar.distributed import DistributedEmbeddingBagCollection
from shardvar.variables import RowInitializer

CRITEO = [1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194, 27, 14992,
          5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572]  # fmt: skip
DENSE, DIM = 13, 16


def tables(scale: float) -> dict[str, TableConfig]:
    """Criteo's 26 tables, cardinalities times ``scale``; the big ones split in 4 mod shards."""
    return {
        f"cat_{i}": TableConfig(max(2, int(n * scale)), DIM, 4 if n * scale > 1000 else 1, "mod")
        for i, n in enumerate(CRITEO)
    }


class DLRM(nn.Module):
    """Bottom MLP, embedding collection, pairwise-dot interaction, top MLP (the DLRM reference's shape)."""

    def __init__(self, embeddings: nn.Module, num_tables: int) -> None:
        super().__init__()
        self.embeddings = embeddings
        self.bottom = nn.Sequential(nn.Linear(DENSE, 32), nn.ReLU(), nn.Linear(32, DIM), nn.ReLU())
        pairs = (num_tables + 1) * num_tables // 2
        self.top = nn.Sequential(nn.Linear(DIM + pairs, 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, dense: torch.Tensor, sparse: dict[str, torch.Tensor]) -> torch.Tensor:
        x = self.bottom(dense)
        pooled = self.embeddings(sparse)
        features = torch.stack([x, *pooled.values()], dim=1)  # [batch, 27, DIM]
        dots = features @ features.transpose(1, 2)
        i, j = torch.triu_indices(features.shape[1], features.shape[1], offset=1)
        return self.top(torch.cat([x, dots[:, i, j]], dim=1)).squeeze(1)


def batch(configs: dict[str, TableConfig], size: int, step: int) -> tuple[torch.Tensor, dict, torch.Tensor]:
    """A global batch of synthetic Criteo-shaped rows: dense features, one id per table, clicks."""
    g = torch.Generator().manual_seed(step)
    dense = torch.randn(size, DENSE, generator=g).abs().log1p()
    ids = {k: torch.randint(0, c.num_embeddings, (size, 1), generator=g) for k, c in configs.items()}
    logit = dense[:, 0] - dense[:, 1] + (ids["cat_8"].squeeze(1) == 0).float()  # something to learn
    return dense, ids, torch.bernoulli(torch.sigmoid(logit), generator=g)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch", type=int, default=256, help="global batch, split over the ranks")
    parser.add_argument("--scale", type=float, default=0.001, help="Criteo's cardinalities times this")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--save", default=None)
    args = parser.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank = dist.get_rank() if world > 1 else 0
    configs = tables(args.scale)
    init = RowInitializer(seed=1, std=0.1)  # table values that depend on nothing but the row
    if world > 1:
        emb = DistributedEmbeddingBagCollection(configs, initializer=init)
    else:
        emb = EmbeddingBagCollection(configs)
        start = 0
        with torch.no_grad():  # the values the distributed collection gives: by row of the tables laid end to end
            for bag in emb.embedding_bags.values():
                rows = start + bag.layout.storage_rows(torch.arange(bag.num_embeddings))
                bag.weight.copy_(init.rows(rows, (DIM,), torch.float32))
                start += bag.num_embeddings
    torch.manual_seed(0)  # the dense layers: the same initial values on every rank and world size
    model = DLRM(emb, len(configs))
    dense_params = [*model.bottom.parameters(), *model.top.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    per_rank = args.batch // world
    losses = []
    for step in range(args.steps):
        dense, ids, clicks = batch(configs, args.batch, step)
        mine = slice(rank * per_rank, (rank + 1) * per_rank)
        logits = model(dense[mine], {k: v[mine] for k, v in ids.items()})
        loss = nn.functional.binary_cross_entropy_with_logits(logits, clicks[mine], reduction="sum") / args.batch
        opt.zero_grad()
        loss.backward()
        if world > 1:  # the dense layers are replicated: sum their gradients over the ranks, in one call
            flat = torch.cat([p.grad.reshape(-1) for p in dense_params])
            dist.all_reduce(flat)
            torch.nn.utils.vector_to_parameters(flat, [p.grad for p in dense_params])
            total = loss.detach().clone()
            dist.all_reduce(total)
            loss = total
        opt.step()
        losses.append(float(loss.detach()))
    if rank == 0:
        head, tail = sum(losses[:10]) / min(10, len(losses)), sum(losses[-10:]) / min(10, len(losses))
        print(f"dlrm: {world} process(es), 26 tables, {args.steps} steps: loss {head:.4f} -> {tail:.4f}")
    if args.save:
        save = shardvar.distributed.save if world > 1 else shardvar.save
        save({"model": model}, args.save)
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
