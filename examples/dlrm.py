"""A DLRM-style model on synthetic Criteo-shaped data: 26 sparse features in one embedding collection.

    python examples/dlrm.py --steps 100                          # one process
    torchrun --nproc-per-node 2 examples/dlrm.py --steps 100     # tables sharded over 2 ranks
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --standalone --max-restarts 3 --nproc-per-node 2 \
        examples/dlrm.py --steps 1000 --checkpoint-dir ck --checkpoint-every 100   # a long run that survives

The model, data and training loop are ``shardvar.workloads``' (``shardvar demo --tables 26`` runs
them too). Under torchrun every step looks all 26 tables up in one exchange per group of alike
tables; ``--placement auto`` replicates the tiny tables, splits the large ones by rows and places
the rest whole. ``--save DIR`` ends with a checkpoint any world size, layout or plain model can
restore. ``--checkpoint-dir DIR --checkpoint-every K`` writes an asynchronous checkpoint every K
steps (training goes on while it writes) and, on start, resumes from the latest complete one in
DIR, at any world size: under ``torchrun --max-restarts N`` a killed rank costs the steps since
the last checkpoint, and the losses are exactly those of an uninterrupted run. ``--timeout``
bounds every collective: a rank that dies or hangs, or ranks that run different numbers of
steps, end every process with a clear error within it. Relaunching a run that finished says so
and exits 0; a flag out of range is refused before anything starts (exit status 2).
"""

from __future__ import annotations

import argparse
import gc
import os
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

import shardvar
from shardvar.cli import integer, real
from shardvar.workloads import Checkpoints, build_dlrm, criteo_tables, explain_steps, train_dlrm


def main() -> None:
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")  # huge pages for large tensors, before the first one
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=integer(1), default=100)
    parser.add_argument("--batch", type=integer(1), default=256, help="global batch, split over the ranks")
    parser.add_argument("--scale", type=real(positive=True), default=0.001, help="Criteo's cardinalities times this")
    parser.add_argument("--lr", type=real(positive=True), default=0.1)
    parser.add_argument("--placement", choices=["row", "table", "auto"], default="row",
                        help="tables split by rows, whole (round robin over the ranks), or planned")  # fmt: skip
    parser.add_argument("--save", default=None)
    parser.add_argument("--checkpoint-dir", type=Path, default=None, help="periodic checkpoints; resume from here")
    parser.add_argument("--checkpoint-every", type=integer(1), default=100, help="steps between checkpoints")
    parser.add_argument("--losses", type=Path, default=None, help="append each step's loss here (rank 0)")
    parser.add_argument(
        "--timeout", type=real(positive=True), default=60.0, help="seconds any collective may wait for the others"
    )
    args = parser.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if args.batch % world:
        parser.error(f"--batch {args.batch} must divide by the {world} processes: each takes an equal slice")
    if world > 1:
        dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    configs = criteo_tables(args.scale)
    placement = {"row": None, "table": dict.fromkeys(configs, "table"), "auto": "auto"}[args.placement]
    model = build_dlrm(configs, world, placement, timeout=args.timeout)
    checkpoints = args.checkpoint_dir and Checkpoints(args.checkpoint_dir, args.checkpoint_every, args.timeout)
    record = None
    if args.losses and (world == 1 or dist.get_rank() == 0):
        record = lambda step, loss: args.losses.open("a").write(f"{step} {loss!r}\n")  # noqa: E731
    losses = train_dlrm(model, configs, args.steps, args.batch, args.lr, world, timeout=args.timeout,
                        checkpoints=checkpoints, on_loss=record)  # fmt: skip
    if (world == 1 or dist.get_rank() == 0) and not losses:  # resumed from a checkpoint at or past --steps
        done, path = checkpoints.latest()
        print(f"dlrm: the run in {args.checkpoint_dir} has finished: {path.name} holds {done} of {args.steps} steps")
    elif world == 1 or dist.get_rank() == 0:
        head, tail = sum(losses[:10]) / min(10, len(losses)), sum(losses[-10:]) / min(10, len(losses))
        print(f"dlrm: {world} process(es), 26 tables, {args.steps} steps: loss {head:.4f} -> {tail:.4f}")
    if args.save and world > 1:
        try:
            shardvar.distributed.save({"model": model}, args.save, timeout=args.timeout)
        except shardvar.ShardvarDistributedError as e:
            raise explain_steps(e, args.steps, running=False) from None
    elif args.save:
        shardvar.save({"model": model}, args.save)
    if world > 1:
        gc.collect()  # gloo work held by garbage cycles goes while the group is alive
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
