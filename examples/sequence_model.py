"""A small sequence model over user histories: an EmbeddingCollection feeding a transformer encoder.

    python examples/sequence_model.py --steps 150                          # one process
    torchrun --nproc-per-node 2 examples/sequence_model.py --steps 150     # the table sharded over 2 ranks

Each user has a history of item ids (2 to 12 of them) drawn mostly from one hidden cluster of
items; the model predicts whether a candidate item is from that cluster. One item table serves two
features, ``history`` (a sequence: every id's row, as ``JaggedRows``) and ``candidate``; the
history is padded, encoded by a transformer, averaged over its real positions and compared with
the candidate's row. The table trains with the fused ``RowWiseAdagrad`` (sparse gradients; its
rows change inside backward), the dense layers with Adam. Under torchrun the table is a
``DistributedEmbeddingCollection`` (one exchange per step) and the dense layers are DDP.
``--save DIR`` ends with a checkpoint of the whole model and both optimizers (its table restores
into any layout, world size or a plain ``nn.Embedding``); ``--checkpoint-dir DIR --checkpoint-every K``
writes one every K steps (asynchronously) and, on start, resumes from the latest complete one: the
run goes on exactly as if it had not stopped (each step's batch depends on the step alone).

    python examples/sequence_model.py --steps 150 --checkpoint-dir ck --checkpoint-every 50
"""

from __future__ import annotations

import argparse
import gc
import os
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import shardvar
from shardvar import EmbeddingCollection, KeyedJagged, TableConfig, optim
from shardvar.cli import integer
from shardvar.workloads import Checkpoints

ITEMS, CLUSTERS, DIM = 400, 8, 16
TABLES = {"item": TableConfig(ITEMS, DIM, 4, "mod", feature_names=["history", "candidate"])}


def batch(size: int, g: torch.Generator) -> tuple[KeyedJagged, torch.Tensor]:
    """Histories (mostly from each user's cluster: item % CLUSTERS) and candidates, with the labels."""
    cluster = torch.randint(0, CLUSTERS, (size,), generator=g)
    lengths = torch.randint(2, 13, (size,), generator=g)
    owner = torch.repeat_interleave(torch.arange(size), lengths)
    items = torch.randint(0, ITEMS // CLUSTERS, (len(owner),), generator=g) * CLUSTERS
    stray = torch.rand(len(owner), generator=g) < 0.2
    history = torch.where(stray, torch.randint(0, ITEMS, (len(owner),), generator=g), items + cluster[owner])
    candidate = torch.randint(0, ITEMS, (size,), generator=g)
    candidate = torch.where(torch.rand(size, generator=g) < 0.5, candidate - candidate % CLUSTERS + cluster, candidate)
    label = (candidate % CLUSTERS == cluster).float()
    values = torch.cat([history, candidate])
    return KeyedJagged(("history", "candidate"), values, torch.stack([lengths, torch.ones_like(lengths)])), label


class Dense(nn.Module):
    """Encode the padded history, average its real positions, score it against the candidate."""

    def __init__(self) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(DIM, nhead=2, dim_feedforward=32, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=1, enable_nested_tensor=False)
        self.out = nn.Linear(2 * DIM, 1)

    def forward(self, history: shardvar.JaggedRows, candidate: torch.Tensor) -> torch.Tensor:
        padded = history.to_padded()  # [users, longest history, DIM]
        pad = torch.arange(padded.shape[1]) >= history.lengths[:, None]
        encoded = self.encoder(padded, src_key_padding_mask=pad).masked_fill(pad[..., None], 0.0)
        user = encoded.sum(1) / history.lengths[:, None]
        return self.out(torch.cat([user * candidate, candidate], 1)).squeeze(1)


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=integer(1), default=150)
    parser.add_argument("--batch", type=integer(1), default=64, help="users per step and rank")
    parser.add_argument("--save", default=None, help="end with a checkpoint of the model and both optimizers")
    parser.add_argument("--checkpoint-dir", type=Path, default=None, help="periodic checkpoints; resume from here")
    parser.add_argument("--checkpoint-every", type=integer(1), default=50, help="steps between checkpoints")
    return parser.parse_args()


def _step(tables: nn.Module, dense: nn.Module, dense_opt: torch.optim.Optimizer, step: int, size: int) -> float:
    # Each step's batch from its own seed: a resumed run draws what the uninterrupted one would have.
    g = torch.Generator().manual_seed(1_000_003 * step + 1 + int(os.environ.get("RANK", "0")))
    features, label = batch(size, g)
    rows = tables(features)
    logits = dense(rows["history"], rows["candidate"].values)
    loss = nn.functional.binary_cross_entropy_with_logits(logits, label)
    dense_opt.zero_grad()
    loss.backward()  # the table's rows are updated here
    dense_opt.step()
    return float(loss.detach())


def main() -> None:
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")  # huge pages for large tensors, before the first one
    args = _parse()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    torch.manual_seed(0)  # the same dense weights on every rank
    dense = Dense()
    if world > 1:
        dist.init_process_group("gloo", timeout=timedelta(seconds=120))
        tables = shardvar.distributed.DistributedEmbeddingCollection(TABLES, sparse=True)
        ddp = nn.parallel.DistributedDataParallel(dense)
    else:
        tables = EmbeddingCollection(TABLES, sparse=True)
    table_opt, dense_opt = optim.RowWiseAdagrad(tables, lr=1.0), torch.optim.Adam(dense.parameters(), lr=1e-2)
    optim.fuse(table_opt)
    # The whole model and both optimizers: what a resumed run needs to go on as if it had not stopped.
    state = {"model": tables, "dense": dense, "table_opt": table_opt, "dense_opt": dense_opt}
    checkpoints = args.checkpoint_dir and Checkpoints(
        args.checkpoint_dir, args.checkpoint_every, label="sequence model"
    )
    first = checkpoints.resume(state, world) if checkpoints else 0
    losses = []
    for step in range(first, args.steps):
        losses.append(_step(tables, ddp if world > 1 else dense, dense_opt, step, args.batch))
        if checkpoints:
            checkpoints.after(step + 1, state, world)
    if checkpoints:
        checkpoints.wait()
    if (world == 1 or dist.get_rank() == 0) and not losses:
        print(f"sequence model: the run in {args.checkpoint_dir} has finished ({first} of {args.steps} steps)")
    elif world == 1 or dist.get_rank() == 0:
        n = min(20, len(losses))
        head, tail = sum(losses[:n]) / n, sum(losses[-n:]) / n
        print(f"sequence model: {world} process(es), {args.steps} steps: loss {head:.3f} -> {tail:.3f}")
    if args.save:
        (shardvar.distributed.save if world > 1 else shardvar.save)(state, args.save)
    if world > 1:
        del ddp
        gc.collect()  # gloo work held by garbage cycles goes while the group is alive
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
