"""A rank that hangs or dies, run as a user's script would be: no os._exit, errors left uncaught.

    python dist_fault_workers.py SCENARIO OUT_DIR      (RANK, WORLD_SIZE, MASTER_* from the launcher)

Scenarios (the last rank is the faulty one, after one good step):
* ``hang``: it stops itself (SIGSTOP) and the others' next lookup times out;
* ``save``: it dies, and the others' final ``shardvar.distributed.save`` fails.

Every other rank writes ``raised<rank>`` (the time it raised and its pid) before letting the
error end the script, which then exits through interpreter shutdown like any user's script.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

import shardvar
from shardvar.distributed import DistributedEmbedding

TIMEOUT = 3.0  # shardvar's collective timeout; the group's own stays at 120 s


def main() -> None:
    scenario, out = sys.argv[1], Path(sys.argv[2])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    (out / f"pid{rank}").write_text(str(os.getpid()))
    emb = DistributedEmbedding(64, 4, world, "div", timeout=TIMEOUT)
    emb(torch.tensor([0, 63])).sum().backward()  # everyone alive: works
    if rank == world - 1:
        if scenario == "hang":
            os.kill(os.getpid(), signal.SIGSTOP)
        os._exit(17)
    try:
        if scenario == "hang":
            emb(torch.tensor([0, 63])).sum().backward()
        else:
            time.sleep(1.0)  # the peer is gone by now
            shardvar.distributed.save({"emb": emb}, out / "ckpt", timeout=TIMEOUT)
    except shardvar.ShardvarDistributedError:
        (out / f"raised{rank}").write_text(json.dumps({"time": time.time(), "pid": os.getpid()}))
        raise


if __name__ == "__main__":
    main()
