"""Distributed training step: 2 ranks' forward+backward against one process doing the same work.

    python benchmarks/bench_distributed.py [--rows 262144] [--dim 64] [--batch 65536] [--repeats 9]

Each rank looks up its own ``--batch`` Zipf(1.05) ids in a table sharded over the ranks (mod, one
shard per rank; gloo over loopback, one thread per rank) and back-propagates a fixed gradient:
with dense shard gradients, with sparse ones, and through DTensor's row-sharded ``nn.Embedding``
(``RowwiseParallel``). The baseline is ONE process with every thread doing all ranks' ids on the
unsharded table with ``F.embedding`` (dense and sparse). Every repetition runs each path once, in
turn, so the machine's state weighs on all alike: the table gives the median, the spread
(min-max) and the ratio to the one-process baseline (goal, issue 27: <= 0.6x), the bytes a rank
sends per step over the lower bound (each distinct id a rank needs from another rank crosses
once each way: its row forward, its gradient backward; goal <= 1.1x), and what a step allocates
(torch's profiler, MiB) and the pages it first-touches (minor page faults), per rank.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
from _common import print_table, zipf_ids
from _ranks import gloo_ranks

PATHS = ("dense", "sparse", "dtensor")  # the distributed paths; "one process" paths are rank 0's baselines


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _allocated_mib(step: Callable[[], None]) -> float:
    """Bytes one call of ``step`` allocates on the CPU and keeps past the op that allocated it, in MiB."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    return sum(max(e.self_cpu_memory_usage, 0) for e in prof.events() if e.name != "[memory]") / 2**20


def _distributed_steps(rows: int, dim: int, ids: torch.Tensor, grad: torch.Tensor) -> dict[str, Callable[[], None]]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import RowwiseParallel, parallelize_module

    from shardvar.distributed import DistributedEmbedding

    world = dist.get_world_size()
    steps = {}
    for path in ("dense", "sparse"):
        emb = DistributedEmbedding(rows, dim, world, "mod", sparse=path == "sparse")
        steps[path] = _step(emb, ids, grad)
    mesh = init_device_mesh("cpu", (world,))
    plain = parallelize_module(
        nn.Embedding(rows, dim), mesh, RowwiseParallel(input_layouts=Shard(0), output_layouts=Shard(0))
    )
    steps["dtensor"] = _step(plain, ids, grad)
    return steps


def _step(module: nn.Module, ids: torch.Tensor, grad: torch.Tensor) -> Callable[[], None]:
    def go() -> None:
        for p in module.parameters():
            p.grad = None  # as optimizer.zero_grad(): each step's gradient is a fresh .grad
        out = module(ids)
        out.backward(grad)

    return go


def _one_process_steps(rows: int, dim: int, ids: torch.Tensor, grad: torch.Tensor) -> dict[str, Callable[[], None]]:
    out = {}
    for path in ("dense", "sparse"):
        weight = nn.Parameter(torch.randn(rows, dim))

        def go(w: nn.Parameter = weight, sparse: bool = path == "sparse") -> None:
            w.grad = None
            F.embedding(ids, w, sparse=sparse).backward(grad)

        out[f"one process, {path}"] = go
    return out


def _timed(step: Callable[[], None]) -> tuple[float, int]:
    dist.barrier()
    faults, start = _faults(), time.perf_counter()
    step()
    dist.barrier()
    return (time.perf_counter() - start) * 1e3, _faults() - faults


def measure(
    rows: int, dim: int, batch: int, repeats: int, paths: tuple[str, ...] = PATHS, profile: bool = True
) -> dict[str, dict]:
    """Every rank of the initialised gloo group calls it; rank 0 gets ``{path: stats}`` (others: {}).
    ``profile``: also the bytes a step allocates (one more step each, under torch's profiler)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    threads = torch.get_num_threads()
    everyone = [zipf_ids(batch, rows, seed=100 + r) for r in range(world)]
    grads = [torch.randn(batch, dim, generator=torch.Generator().manual_seed(r)) for r in range(world)]
    steps = {k: v for k, v in _distributed_steps(rows, dim, everyone[rank], grads[rank]).items() if k in paths}
    single = _one_process_steps(rows, dim, torch.cat(everyone), torch.cat(grads)) if rank == 0 else {}
    single = {k: v for k, v in single.items() if k.split(", ")[1] in paths}
    times: dict[str, list[float]] = {k: [] for k in [*steps, *single]}
    faults: dict[str, list[int]] = {k: [] for k in times}
    for rep in range(repeats + 1):  # the first is a warm-up
        for name, step in steps.items():
            ms, pf = _timed(step)
            if rep:
                times[name].append(ms), faults[name].append(pf)
        torch.set_num_threads(threads * world)  # one process has the whole machine
        for name, step in single.items():
            start, pf = time.perf_counter(), _faults()
            step()
            if rep:
                times[name].append((time.perf_counter() - start) * 1e3), faults[name].append(_faults() - pf)
        torch.set_num_threads(threads)
        dist.barrier()
    return _summarise(steps, single if profile else {}, times, faults, everyone, rows, dim, profile)


def _summarise(
    steps: dict, single: dict, times: dict, faults: dict, everyone: list, rows: int, dim: int, profile: bool
) -> dict[str, dict]:
    from shardvar.distributed import DistributedEmbedding

    rank, world = dist.get_rank(), dist.get_world_size()
    probe = DistributedEmbedding(rows, dim, world, "mod")
    comm = probe.variable.comm
    before = comm.bytes_sent
    probe(everyone[rank]).sum().backward()
    sent = comm.bytes_sent - before
    unique = torch.unique(everyone[rank])
    owner = torch.tensor(probe.variable.placement)[probe.layout.locate(unique)[0]]
    bound = 2 * int((owner != rank).sum()) * dim * 4  # each remote row out and its gradient back
    local = {name: {"ms": times[name], "faults": statistics.median(faults[name])} for name in steps}
    for name, step in steps.items():
        local[name]["mib"] = _allocated_mib(step) if profile else float("nan")
    wire: list = [None] * world
    dist.all_gather_object(wire, (local, sent, bound))
    if rank:
        return {}
    out = {}
    for name in steps:  # a collective step takes as long as its slowest rank
        ms = [max(w[0][name]["ms"][i] for w in wire) for i in range(len(wire[0][0][name]["ms"]))]
        out[name] = {**wire[0][0][name], "ms": ms, "mib": max(w[0][name]["mib"] for w in wire)}
    for name in [k for k in times if k not in steps]:  # the one-process baselines, in order
        step = single.get(name)
        out[name] = {
            "ms": times[name],
            "faults": statistics.median(faults[name]),
            "mib": _allocated_mib(step) if step else float("nan"),
        }
    out["wire"] = {"sent": sum(w[1] for w in wire), "bound": sum(w[2] for w in wire)}
    return out


def run(
    rows: int, dim: int, batch: int, repeats: int, world: int = 2, paths: tuple[str, ...] = PATHS, profile: bool = True
) -> dict:
    """Spawn ``world`` ranks on this machine and return rank 0's :func:`measure` (the guard uses it)."""
    kwargs = {"rows": rows, "dim": dim, "batch": batch, "repeats": repeats, "paths": tuple(paths), "profile": profile}
    return gloo_ranks(measure, kwargs, world, threads=max(1, (os.cpu_count() or 1) // world))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=1 << 18)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=1 << 16, help="ids per rank per step")
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="small sizes, 2 repeats (a smoke test)")
    args = p.parse_args()
    if args.quick:
        args.rows, args.dim, args.batch, args.repeats = 1 << 12, 16, 1 << 10, 2
    stats = run(args.rows, args.dim, args.batch, args.repeats, args.world)
    wire = stats.pop("wire")
    table = []
    for name, s in stats.items():
        ms = s["ms"]
        base = stats["one process, " + ("sparse" if name.endswith("sparse") else "dense")]["ms"]
        ratios = [a / b for a, b in zip(ms, base, strict=True)]
        label = name if name.startswith("one") else f"{args.world} ranks, {name}"
        table.append([label, f"{statistics.median(ms):.1f}", f"{min(ms):.1f}-{max(ms):.1f}",
                      f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})",
                      f"{s['mib']:.1f}", f"{s['faults']:.0f}"])  # fmt: skip
    table_mib = args.rows * args.dim * 4 / 2**20
    print(f"table {args.rows} x {args.dim} float32 ({table_mib:.0f} MiB; mod, one shard per rank), {args.batch} "
          f"Zipf ids per rank, fwd+bwd; {args.repeats} interleaved repetitions, {os.cpu_count()} cores\n")  # fmt: skip
    print_table(["path", "median ms", "min-max ms", "vs one process (goal <= 0.6x)", "MiB alloc/step",
                 "page faults/step"], table)  # fmt: skip
    sent, bound = wire["sent"], wire["bound"]
    ratio = sent / bound if bound else float("nan")
    print(f"\nwire: {sent / args.world / 1024:.0f} KiB sent per rank per step, lower bound "
          f"{bound / args.world / 1024:.0f} KiB: {ratio:.3f}x the bound (goal <= 1.1x)")  # fmt: skip


if __name__ == "__main__":
    main()
