"""26 tables (Criteo's sparse features, cardinalities scaled down): one collection against 26 modules.

    python benchmarks/bench_collection.py [--scale 0.01] [--batch 4096] [--rounds 5] [--quick]

Local: a forward+backward step of ``EmbeddingBagCollection`` against 26 separate
``ShardedEmbeddingBag``s and against 26 unsharded ``nn.EmbeddingBag``s (ratios of time, median and
range over rounds, measured alternately). Distributed (2 processes, gloo on loopback): a step of
``DistributedEmbeddingBagCollection`` against 26 ``DistributedEmbeddingBag``s: time, all_to_all
calls per step, and bytes sent to the other rank against the lower bound (the distinct ids each
rank looks up on the other's shards: one row forward, one gradient row backward).
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.utils import benchmark

sys.path.insert(0, str(Path(__file__).parent))
from _common import print_table

import shardvar
from shardvar import EmbeddingBagCollection, TableConfig
from shardvar.distributed import DistributedEmbeddingBag, DistributedEmbeddingBagCollection

# Criteo Kaggle's 26 categorical cardinalities (as in the DLRM reference's day-0 counts).
CRITEO = [1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194, 27, 14992,
          5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572]  # fmt: skip
DIM = 16


def tables(scale: float) -> dict[str, TableConfig]:
    return {
        f"c{i}": TableConfig(max(4, int(n * scale)), DIM, 1 if n * scale < 1000 else 4, "mod")
        for i, n in enumerate(CRITEO)
    }


def batch(configs: dict[str, TableConfig], size: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randint(0, c.num_embeddings, (size, 1), generator=g) for k, c in configs.items()}


def ratio(fn: Callable, base: Callable, rounds: int, min_s: float) -> list[float]:
    out = []
    for _ in range(rounds):
        b = benchmark.Timer("f()", globals={"f": base}).blocked_autorange(min_run_time=min_s).median
        m = benchmark.Timer("f()", globals={"f": fn}).blocked_autorange(min_run_time=min_s).median
        out.append(m / b)
    return out


def local_rows(args: argparse.Namespace) -> list[list[object]]:
    configs = tables(args.scale)
    ebc = EmbeddingBagCollection(configs)
    separate = nn.ModuleDict(
        {k: shardvar.ShardedEmbeddingBag(c.num_embeddings, DIM, c.partitioner, "mod") for k, c in configs.items()}
    )
    plain = nn.ModuleDict({k: nn.EmbeddingBag(c.num_embeddings, DIM) for k, c in configs.items()})
    ids = batch(configs, args.batch, 0)

    def step(run: Callable[[], dict]) -> Callable[[], None]:
        def go() -> None:
            torch.cat(list(run().values()), 1).pow(2).sum().backward()

        return go

    collection = step(lambda: ebc(ids))
    rows = []
    for label, module in (("26 ShardedEmbeddingBags", separate), ("26 unsharded nn.EmbeddingBags", plain)):
        r = ratio(collection, step(lambda m=module: {k: m[k](v) for k, v in ids.items()}), args.rounds, args.min_s)
        rows.append([f"collection step vs {label}", f"{statistics.median(r):.2f}x", f"{min(r):.2f}-{max(r):.2f}"])
    return rows


def _calls(modules: list[nn.Module]) -> tuple[int, int]:
    comms = {
        id(c): c for m in modules for sub in m.modules() if hasattr(sub, "store") for c in [sub.store.exchange.comm]
    }
    return sum(c.calls["all_to_all"] for c in comms.values()), sum(c.bytes_sent for c in comms.values())


def _worker(rank: int, port: int, args: argparse.Namespace, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    configs = tables(args.scale)
    ebc = DistributedEmbeddingBagCollection(configs)
    separate = nn.ModuleDict(
        {k: DistributedEmbeddingBag(c.num_embeddings, DIM, c.partitioner, "mod") for k, c in configs.items()}
    )
    ids = batch(configs, args.batch, rank)
    results = {}
    for label, run in (
        ("collection", lambda: ebc(ids)),
        ("26 modules", lambda: {k: separate[k](v) for k, v in ids.items()}),
    ):
        module = ebc if label == "collection" else separate
        times = []
        for _ in range(args.rounds * 3):
            calls0, bytes0 = _calls([module])
            dist.barrier()
            start = time.perf_counter()
            torch.cat(list(run().values()), 1).pow(2).sum().backward()
            times.append(time.perf_counter() - start)
            calls1, bytes1 = _calls([module])
        results[label] = (statistics.median(times), calls1 - calls0, bytes1 - bytes0)
    # The lower bound on what this rank sends: a row for each distinct id the other rank reads
    # from this rank's shards, and a gradient row for each distinct id this rank reads from its.
    other = batch(configs, args.batch, 1 - rank)
    bound = 0
    for i, k in enumerate(configs):
        layout = ebc.layouts[k]

        def owners(v: torch.Tensor, i: int = i, layout=layout) -> torch.Tensor:
            return (i + layout.locate(v.reshape(-1).unique())[0]) % 2  # "row" placement

        bound += (int((owners(other[k]) == rank).sum()) + int((owners(ids[k]) != rank).sum())) * DIM * 4
    torch.save({"results": results, "bound": bound}, f"{out}/rank{rank}.pt")
    dist.destroy_process_group()


def distributed_rows(args: argparse.Namespace) -> list[list[object]]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(_worker, args=(port, args, out), nprocs=2)
        r0 = torch.load(f"{out}/rank0.pt")
    (t_c, calls_c, bytes_c), (t_s, calls_s, bytes_s) = r0["results"]["collection"], r0["results"]["26 modules"]
    return [
        [
            "2 processes: collection step / 26 modules' step",
            f"{t_c / t_s:.2f}x",
            f"{t_c * 1e3:.1f} vs {t_s * 1e3:.1f} ms",
        ],
        ["2 processes: all_to_all calls per step", f"{calls_c} vs {calls_s}", "collection vs 26 modules"],
        [
            "2 processes: bytes sent / unique-id lower bound",
            f"{bytes_c / max(r0['bound'], 1):.2f}",
            f"collection {bytes_c}, 26 modules {bytes_s} bytes (rank 0)",
        ],
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scale", type=float, default=0.01, help="cardinalities times this")
    parser.add_argument("--batch", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="tiny tables, 1 round (a smoke test)")
    args = parser.parse_args()
    if args.quick:
        args.scale, args.batch, args.rounds = 0.0001, 64, 1
    args.min_s = 0.05 if args.quick else 0.2
    configs = tables(args.scale)
    rows = sum(c.num_embeddings for c in configs.values())
    print(f"26 tables, {rows} rows of {DIM} in all, batch {args.batch} (one id per feature), {args.rounds} rounds\n")
    print_table(["measure", "value", "range / detail"], local_rows(args) + distributed_rows(args))


if __name__ == "__main__":
    main()
