"""Weak scaling: what sharding costs a rank (issue 37), and the exchange's time against gloo's own.

    python benchmarks/bench_weak_scaling.py [--rows 524288] [--dim 64] [--batch 65536] [--repeats 15] [--json]

Two ranks on two cores cannot beat one process that already uses both, so this measures the cost
instead: each rank (gloo on loopback, ONE thread per process) holds ``--rows`` rows of a table of
``world x --rows`` rows (mod, one shard per rank) and steps on its own ``--batch`` Zipf(1.05) ids;
the baseline is one process with one thread stepping on one batch of a ``--rows``-row table: the
same work per process. A rank's step over the baseline's is what sharding costs it (goal <= 1.6x):

* dense: forward + backward, dense gradients (``nn.Embedding``; ``DistributedEmbedding``);
* sparse: forward, backward, sparse SGD step (``sparse=True``, ``torch.optim.SGD``);
* fused: one table in an ``EmbeddingBagCollection`` (baseline) or ``DistributedEmbeddingBagCollection``,
  bags of 16 ids, ``RowWiseAdagrad`` fused into backward (shardvar.optim.fuse).

The exchange's all_to_alls are timed inside the step (a wrapper on its Comm: "a2a"), with the
exchange's whole forward and backward ("exchange": the calls, serving the rows, the shards'
gradients). The same sequence of all_to_alls (split sizes, widths, dtypes recorded from the step)
is replayed with plain ``dist.all_to_all_single`` in the same run ("raw"): a2a / raw is what
shardvar's calls cost over gloo's (goal <= 1.2x). Every repetition runs each path's step, its
replay and the baselines in turn; each figure is the median over repetitions (a collective step
takes its slowest rank's time), with the range. Wire: bytes a rank sends per step against the
bound (each distinct id it needs from the other rank: its row out, its gradient back).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
from _common import print_table, zipf_ids
from _ranks import gloo_ranks

PATHS = ("dense", "sparse", "fused")
BAG = 16  # ids per bag of the collection path
Step = Callable[[], None]


class Probe:
    """What the exchange of the step in flight did: its all_to_alls (timed, with their shapes) and time."""

    current: Probe | None = None

    def __init__(self) -> None:
        self.calls: list[tuple[tuple[int, ...], torch.dtype, list[int], list[int]]] = []
        self.a2a: list[float] = []  # ms, each call's
        self.exchange = 0.0

    def clear(self) -> None:
        self.calls, self.a2a, self.exchange = [], [], 0.0


def _instrument(exchange: Any, probe: Probe) -> None:
    """Time ``exchange``'s all_to_alls and its forward (wrappers on the instance) for ``probe``."""
    comm, rows = exchange.comm, exchange.rows

    def all_to_all(out: torch.Tensor, inp: torch.Tensor, out_splits: list, in_splits: list, what: str) -> None:
        start = time.perf_counter()
        comm_all_to_all(out, inp, out_splits, in_splits, what)
        probe.a2a.append((time.perf_counter() - start) * 1e3)
        probe.calls.append((tuple(out.shape[1:]), out.dtype, list(out_splits), list(in_splits)))

    def timed_rows(*args: Any, **kwargs: Any) -> torch.Tensor:
        start = time.perf_counter()
        try:
            return rows(*args, **kwargs)
        finally:
            probe.exchange += time.perf_counter() - start

    comm_all_to_all = comm.all_to_all
    comm.all_to_all, exchange.rows = all_to_all, timed_rows


def _time_backwards() -> None:
    """The exchange's backward, timed for ``Probe.current`` (autograd looks the method up on the class)."""
    from shardvar.distributed._exchange import _ExchangeRows

    backward = _ExchangeRows.backward

    def timed(ctx: Any, *grads: Any) -> tuple:
        start = time.perf_counter()
        try:
            return backward(ctx, *grads)
        finally:
            if Probe.current is not None:
                Probe.current.exchange += time.perf_counter() - start

    _ExchangeRows.backward = staticmethod(timed)


def _distributed(path: str, rows: int, dim: int, ids: torch.Tensor, grad: torch.Tensor) -> tuple[Step, Any]:
    """2 ranks' step of ``path`` over a table of ``world x rows`` rows, and its exchange."""
    import shardvar
    from shardvar.distributed import DistributedEmbedding, DistributedEmbeddingBagCollection

    world = dist.get_world_size()
    if path == "fused":
        table = shardvar.TableConfig(rows * world, dim, world, "mod")
        ec = DistributedEmbeddingBagCollection({"t": table}, sparse=True)
        shardvar.optim.fuse(shardvar.optim.RowWiseAdagrad(ec, lr=0.01))
        return _bags(ec, ids, grad), ec.bags[0].store.exchange
    emb = DistributedEmbedding(rows * world, dim, world, "mod", sparse=path == "sparse")
    return _rows(emb, ids, grad, path == "sparse"), emb.store.exchange


def _one_process(path: str, rows: int, dim: int, ids: torch.Tensor, grad: torch.Tensor) -> Step:
    import shardvar

    if path == "fused":
        ec = shardvar.EmbeddingBagCollection({"t": shardvar.TableConfig(rows, dim, 1, "mod")}, sparse=True)
        shardvar.optim.fuse(shardvar.optim.RowWiseAdagrad(ec, lr=0.01))
        return _bags(ec, ids, grad)
    return _rows(nn.Embedding(rows, dim, sparse=path == "sparse"), ids, grad, path == "sparse")


def _rows(module: nn.Module, ids: torch.Tensor, grad: torch.Tensor, sgd: bool) -> Step:
    opt = torch.optim.SGD(module.parameters(), lr=0.01) if sgd else None

    def go() -> None:
        for p in module.parameters():
            p.grad = None  # as optimizer.zero_grad(): each step's gradient is a fresh .grad
        module(ids).backward(grad)
        if opt is not None:
            opt.step()

    return go


def _bags(collection: nn.Module, ids: torch.Tensor, grad: torch.Tensor) -> Step:
    offsets = torch.arange(0, ids.numel(), BAG)
    return lambda: collection({"t": ids}, {"t": offsets})["t"].backward(grad[: offsets.numel()])


def _replay(calls: list) -> Step:
    """The recorded all_to_alls as plain gloo calls on buffers of their sizes (allocated once)."""
    buffers = [
        (torch.zeros(sum(o), *shape, dtype=dtype), torch.zeros(sum(i), *shape, dtype=dtype), o, i)
        for shape, dtype, o, i in calls
    ]

    def go() -> None:
        for out, inp, o, i in buffers:
            dist.all_to_all_single(out, inp, o, i)

    return go


def _timed(step: Step, cpu: list[float] | None = None) -> float:
    """Wall ms of ``step`` from a barrier; ``cpu`` gets the CPU ms this process spent in it (every thread)."""
    dist.barrier()
    start, used = time.perf_counter(), time.process_time()
    step()
    if cpu is not None:
        cpu.append((time.process_time() - used) * 1e3)
    return (time.perf_counter() - start) * 1e3


def measure(rows: int, dim: int, batch: int, repeats: int, paths: tuple[str, ...] = PATHS) -> dict[str, Any]:
    """Every rank of the initialised gloo group calls it; rank 0 gets the figures (others: {})."""
    rank, world = dist.get_rank(), dist.get_world_size()
    ids = zipf_ids(batch, rows * world, seed=100 + rank)
    grad = torch.randn(batch, dim, generator=torch.Generator().manual_seed(rank))
    _time_backwards()
    probes = {p: Probe() for p in paths}
    steps, exchanges, single, replays, sent = {}, {}, {}, {}, {}
    for p in paths:
        steps[p], exchanges[p] = _distributed(p, rows, dim, ids, grad)
        _instrument(exchanges[p], probes[p])
        if rank == 0:  # the baseline: one process, one batch, a rank's share of the table
            single[p] = _one_process(p, rows, dim, zipf_ids(batch, rows, seed=100), grad)
    for p in paths:  # a warm-up step, whose all_to_alls the replay repeats
        Probe.current, before = probes[p], exchanges[p].comm.bytes_sent
        probes[p].clear()
        steps[p]()
        sent[p] = exchanges[p].comm.bytes_sent - before
        replays[p] = _replay(probes[p].calls)
        replays[p]()
        if p in single:
            single[p]()
    keys = ("step", "cpu", "a2a", "exchange", "raw", "one process", "one process cpu")
    times: dict[str, dict[str, list[float]]] = {p: {k: [] for k in keys} for p in paths}
    for _ in range(repeats):
        for p in paths:
            Probe.current = probes[p]
            probes[p].clear()
            times[p]["step"].append(_timed(steps[p], times[p]["cpu"]))
            times[p]["a2a"].append(probes[p].a2a)
            times[p]["exchange"].append(probes[p].exchange * 1e3)
            times[p]["raw"].append(_timed(replays[p]))
        dist.barrier()
        for p in single:  # rank 0 alone: the other rank waits in the barrier
            start, used = time.perf_counter(), time.process_time()
            single[p]()
            times[p]["one process"].append((time.perf_counter() - start) * 1e3)
            times[p]["one process cpu"].append((time.process_time() - used) * 1e3)
        dist.barrier()
    Probe.current = None
    calls = {p: len(probes[p].calls) for p in paths}
    return _gather(times, sent, _bound(ids, rows * world, dim, rank, world), calls)


def _bound(ids: torch.Tensor, rows: int, dim: int, rank: int, world: int) -> int:
    """Bytes a rank must send per step at least: each distinct id another rank owns, its row out and its
    gradient back (float32); shard s of the mod layout is on rank s."""
    from shardvar import Layout

    owner = Layout.mod(rows, world).locate(torch.unique(ids))[0]
    return 2 * int((owner != rank).sum()) * dim * 4


def _gather(times: dict, sent: dict, bound: int, calls: dict) -> dict[str, Any]:
    rank = dist.get_rank()
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (times, sent, bound))
    if rank:
        return {}
    out: dict[str, Any] = {}
    for p, mine in times.items():
        # A collective step takes its slowest rank's time; each rank's own exchange, likewise.
        reps = range(len(mine["step"]))
        stats = {k: [max(r[0][p][k][i] for r in everyone) for i in reps] for k in ("step", "cpu", "exchange", "raw")}
        # A call's time on the rank that reached it last (the other waited for it too): its own cost.
        stats["a2a"] = [sum(map(min, zip(*(r[0][p]["a2a"][i] for r in everyone), strict=True))) for i in reps]
        stats["one process"], stats["one process cpu"] = mine["one process"], mine["one process cpu"]
        stats["sent"] = sum(r[1][p] for r in everyone) / len(everyone)
        stats["bound"] = sum(r[2] for r in everyone) / len(everyone)
        stats["calls"] = calls[p]
        out[p] = stats
    return out


def run(
    rows: int, dim: int, batch: int, repeats: int, paths: tuple[str, ...] = PATHS, world: int = 2, fork: bool = False
) -> dict:
    """Start ``world`` ranks on this machine and return rank 0's :func:`measure` (the guard uses it).

    ``fork``: the ranks are forks of this process (see ``_ranks.gloo_ranks``); else spawned.
    """
    kwargs = {"rows": rows, "dim": dim, "batch": batch, "repeats": repeats, "paths": tuple(paths)}
    # weak scaling: one thread per process, baseline and ranks alike
    return gloo_ranks(measure, kwargs, world, threads=1, start_method="fork" if fork else "spawn")


def ratios(stats: dict, over: str, base: str) -> list[float]:
    """Per repetition, ``over`` / ``base`` (both measured in that repetition)."""
    return [a / b for a, b in zip(stats[over], stats[base], strict=True)]


def _cell(values: list[float], unit: str = "") -> str:
    return f"{statistics.median(values):.2f}{unit} ({min(values):.2f}-{max(values):.2f})"


def report(stats: dict, args: argparse.Namespace) -> None:
    mib = args.rows * args.dim * 4 / 2**20
    print(f"{args.world} ranks x 1 thread, each {args.rows} x {args.dim} float32 rows ({mib:.0f} MiB) of a "
          f"{args.world * args.rows}-row mod table and its own {args.batch} Zipf(1.05) ids, against 1 process x 1 "
          f"thread with one batch on a {args.rows}-row table; {args.repeats} interleaved repetitions, "
          f"{os.cpu_count()} cores. Median (min-max); CPU: the process's, all threads (waits cost none)\n")  # fmt: skip
    steps, exchanges = [], []
    for p, s in stats.items():
        wall, cpu = ratios(s, "step", "one process"), ratios(s, "cpu", "one process cpu")
        steps.append([p, _cell(s["one process"]), _cell(s["step"]), _cell(wall, "x"), _cell(s["one process cpu"]),
                      _cell(s["cpu"]), _cell(cpu, "x")])  # fmt: skip
        wire = f"{s['sent'] / 1024:.0f} KiB, {s['sent'] / s['bound']:.3f}x"
        exchanges.append([p, _cell(s["exchange"]), _cell(s["a2a"]), _cell(s["raw"]),
                          _cell(ratios(s, "a2a", "raw"), "x"), f"{s['calls']}", wire])  # fmt: skip
    print_table(["step", "1 process ms", "2 ranks ms", "ratio (goal <= 1.6x)", "1 process CPU ms", "a rank's CPU ms",
                 "CPU ratio"], steps)  # fmt: skip
    print()
    print_table(["exchange", "fwd+bwd ms", "its all_to_alls ms", "raw gloo ms", "a2a / raw (goal <= 1.2x)",
                 "a2a calls", "sent per rank / bound"], exchanges)  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=1 << 19, help="rows per rank")
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=1 << 16, help="ids per rank per step")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--paths", nargs="+", default=list(PATHS), choices=PATHS)
    p.add_argument("--quick", action="store_true", help="small sizes, 2 repeats (a smoke test)")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = p.parse_args()
    if args.quick:
        args.rows, args.dim, args.batch, args.repeats = 1 << 12, 16, 1 << 10, 2
    # This process has run no torch op: its forks are ranks at once (the guard, which has, spawns them).
    stats = run(args.rows, args.dim, args.batch, args.repeats, tuple(args.paths), args.world, fork=True)
    if args.json:
        print(json.dumps({"args": vars(args), "paths": stats}, indent=1))
    else:
        report(stats, args)


if __name__ == "__main__":
    main()
