"""A DLRM-style model on synthetic Criteo-shaped data: 26 sparse features in one embedding collection.

    python examples/dlrm.py --steps 100                          # one process
    torchrun --nproc-per-node 2 examples/dlrm.py --steps 100     # tables sharded over 2 ranks

The model, data and training loop are ``shardvar.cli.dlrm`` (``shardvar demo --tables 26`` runs
them too). Under torchrun every step looks all 26 tables up in one exchange per group of alike
tables; ``--placement auto`` replicates the tiny tables, splits the large ones by rows and places
the rest whole. ``--save DIR`` ends with a checkpoint any world size, layout or plain model can
restore.
"""

from __future__ import annotations

import argparse
import gc
import os
from datetime import timedelta

import torch.distributed as dist

import shardvar
from shardvar.cli.dlrm import build, tables, train


def main() -> None:
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")  # huge pages for large tensors, before the first one
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch", type=int, default=256, help="global batch, split over the ranks")
    parser.add_argument("--scale", type=float, default=0.001, help="Criteo's cardinalities times this")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--placement", choices=["row", "table", "auto"], default="row",
                        help="tables split by rows, whole (round robin over the ranks), or planned")  # fmt: skip
    parser.add_argument("--save", default=None)
    args = parser.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    configs = tables(args.scale)
    placement = {"row": None, "table": dict.fromkeys(configs, "table"), "auto": "auto"}[args.placement]
    model = build(configs, world, placement)
    losses = train(model, configs, args.steps, args.batch, args.lr, world)
    if world == 1 or dist.get_rank() == 0:
        head, tail = sum(losses[:10]) / min(10, len(losses)), sum(losses[-10:]) / min(10, len(losses))
        print(f"dlrm: {world} process(es), 26 tables, {args.steps} steps: loss {head:.4f} -> {tail:.4f}")
    if args.save:
        (shardvar.distributed.save if world > 1 else shardvar.save)({"model": model}, args.save)
    if world > 1:
        gc.collect()  # gloo work held by garbage cycles goes while the group is alive
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
