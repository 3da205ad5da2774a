"""The speed guard: every speed path, as a ratio to its unsharded baseline, against benchmarks/baseline.json.

    python benchmarks/guard.py             # the table; exit status 1 when a ratio got worse
    python benchmarks/guard.py --update    # rewrite baseline.json with this run's ratios (deliberately)

Each row times a sharded path and its unsharded baseline alternately in this run (the machine's
state weighs on both) and takes the median ratio over ``--rounds`` rounds; the distributed rows
are 2 ranks (gloo, loopback) against one process doing both ranks' ids, the weak-scaling rows a
rank's step (one thread, its own batch) against one process with one thread and one batch (the
fused row's: the local EmbeddingBagCollection's). A row is flagged when its
ratio is worse than the committed one by more than ``tolerance`` (a fraction, in baseline.json):
ratios are steadier than times, but a busy machine still moves them, so rerun a flagged row before
believing it. Not a CI test; run it before calling a change done and put its table in the note.
Adding a path is one entry in CASES: a name and a function of the sizes that returns
(sharded step, baseline step), or ``distributed(path)``.

The rows in HUGE_PAGES run a second time in a child process with torch's huge-page switch on
(``THP_MEM_ALLOC_ENABLE=1``, read once per process): faults then cost little, so what sharding
itself costs shows most there (issue 28). Those rows end in ``[huge pages on]``.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
import bench_distributed
import bench_weak_scaling
from _common import print_table, zipf_ids
from bench_optim import CASES as OPTIMIZERS
from bench_paths import ratio

import shardvar
from shardvar import Layout, ShardedVariable

BASELINE = Path(__file__).parent / "baseline.json"
Step = Callable[[], object]
_SCRATCH: list[Path] = []  # the checkpoint rows' directories, removed at the end


@dataclass(frozen=True)
class Sizes:
    rows: int = 1 << 17
    dim: int = 64
    ids: int = 1 << 15  # a lookup of about a millisecond: the paths, not Python's overhead
    checkpoint_rows: int = 1 << 17
    dist_rows: int = 1 << 17
    dist_batch: int = 1 << 15

    @functools.cached_property
    def table(self) -> torch.Tensor:
        return torch.randn(self.rows, self.dim, generator=torch.Generator().manual_seed(0))

    @functools.cached_property
    def zipf(self) -> torch.Tensor:
        return zipf_ids(self.ids, self.rows)


def _user_shards(s: Sizes, count: int) -> ShardedVariable:
    parts = shardvar.shard_tensor(s.table, Layout.mod(s.rows, count)).variables
    return ShardedVariable([p.clone() for p in parts], partition_strategy="mod")


def lookup_slab(s: Sizes) -> tuple[Step, Step]:
    v = shardvar.shard_tensor(s.table, Layout.div(s.rows, 8))
    return lambda: shardvar.embedding_lookup(v, s.zipf), lambda: F.embedding(s.zipf, s.table)


def lookup_user(s: Sizes, count: int) -> tuple[Step, Step]:
    v = _user_shards(s, count)
    return lambda: shardvar.embedding_lookup(v, s.zipf), lambda: F.embedding(s.zipf, s.table)


def lookup_one_shard(s: Sizes) -> tuple[Step, Step]:
    v = ShardedVariable([s.table.clone()])
    return lambda: shardvar.embedding_lookup(v, s.zipf), lambda: F.embedding(s.zipf, s.table)


def lookup_list(s: Sizes) -> tuple[Step, Step]:
    parts = [p.clone() for p in shardvar.shard_tensor(s.table, Layout.mod(s.rows, 8)).variables]
    return lambda: shardvar.embedding_lookup(parts, s.zipf, "mod"), lambda: F.embedding(s.zipf, s.table)


def scatter(s: Sizes) -> tuple[Step, Step]:
    v, target, updates = _user_shards(s, 8), s.table.clone(), torch.randn(s.ids, s.dim)
    return lambda: v.scatter_add(s.zipf, updates), lambda: target.index_add_(0, s.zipf, updates)


def bag(s: Sizes) -> tuple[Step, Step]:
    offsets = torch.arange(0, s.ids, 16)
    plain = nn.EmbeddingBag.from_pretrained(s.table, freeze=False, mode="sum")
    mine = shardvar.ShardedEmbeddingBag.from_pretrained(s.table, freeze=False, mode="sum", partitioner=8)

    def step(m: nn.Module) -> Step:
        def go() -> None:
            m(s.zipf, offsets).sum().backward()
            for p in m.parameters():
                p.grad = None

        return go

    return step(mine), step(plain)


def _train(module: nn.Module, opt: object, ids: torch.Tensor) -> Step:
    def go() -> None:
        module(ids).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()

    return go


def train_torch(s: Sizes, sparse: bool) -> tuple[Step, Step]:
    make = (lambda p: torch.optim.SGD(p, lr=0.01)) if sparse else (lambda p: torch.optim.Adam(p, lr=0.01))
    plain = nn.Embedding.from_pretrained(s.table.clone(), freeze=False, sparse=sparse)
    mine = shardvar.ShardedEmbedding.from_pretrained(s.table, freeze=False, partitioner=8, sparse=sparse)
    return _train(mine, make(list(mine.parameters())), s.zipf), _train(plain, make(list(plain.parameters())), s.zipf)


def train_sparse_adam(s: Sizes) -> tuple[Step, Step]:
    plain = nn.Embedding.from_pretrained(s.table.clone(), freeze=False, sparse=True)
    mine = shardvar.ShardedEmbedding.from_pretrained(s.table, freeze=False, partitioner=8, sparse=True)
    make = functools.partial(torch.optim.SparseAdam, lr=0.01)
    return _train(mine, make(list(mine.parameters())), s.zipf), _train(plain, make(list(plain.parameters())), s.zipf)


def train_fused(s: Sizes) -> tuple[Step, Step]:
    ours, theirs = OPTIMIZERS["fused RowWiseAdagrad vs SparseAdam"]
    mine = shardvar.ShardedEmbedding.from_pretrained(s.table, freeze=False, partitioner=8, sparse=True)
    plain = nn.Embedding.from_pretrained(s.table.clone(), freeze=False, sparse=True)
    return _train(mine, ours(mine), s.zipf), _train(plain, theirs(list(plain.parameters())), s.zipf)


def lookup_large(s: Sizes) -> tuple[Step, Step]:
    # 2^18 ids x 64: a 64 MiB output whose first touch is most of a lookup (issue 28's path).
    v, ids = shardvar.shard_tensor(s.table, Layout.div(s.rows, 8)), zipf_ids(1 << 18, s.rows, seed=1)
    return lambda: shardvar.embedding_lookup(v, ids), lambda: F.embedding(ids, s.table)


def _collections(s: Sizes, sparse: bool) -> tuple[list[str], dict, torch.Tensor, nn.ModuleDict, nn.Module]:
    """4 tables of 8 mod shards as an EmbeddingBagCollection and as 4 nn.EmbeddingBags, and their inputs."""
    names, batch = [f"t{i}" for i in range(4)], s.ids // 16
    ids = {k: zipf_ids(s.ids, s.rows, seed=i) for i, k in enumerate(names)}
    plain = nn.ModuleDict({k: nn.EmbeddingBag(s.rows, s.dim, mode="sum", sparse=sparse) for k in names})
    configs = {k: shardvar.TableConfig(s.rows, s.dim, 8, "mod") for k in names}
    return names, ids, torch.arange(batch) * 16, plain, shardvar.EmbeddingBagCollection(configs, sparse=sparse)


def collection_fused(s: Sizes) -> tuple[Step, Step]:
    """4 tables' bag step, fused row-wise Adagrad, against 4 nn.EmbeddingBags and torch's sparse Adagrad."""
    names, ids, offsets, plain, ebc = _collections(s, sparse=True)
    grad = torch.randn(offsets.numel(), s.dim)
    plain_opt = torch.optim.Adagrad(plain.parameters(), lr=0.01)
    shardvar.optim.fuse(shardvar.optim.RowWiseAdagrad(ebc, lr=0.01))

    def theirs() -> None:
        sum((plain[k](ids[k], offsets) * grad).sum() for k in names).backward()
        plain_opt.step()
        plain_opt.zero_grad()

    def ours() -> None:
        sum((v * grad).sum() for v in ebc(ids, dict.fromkeys(names, offsets)).values()).backward()

    return ours, theirs


def collection_forward(s: Sizes) -> tuple[Step, Step]:
    """The forward of 4 sparse tables of 8 mod shards (issue 25: <= 1.1x) against 4 nn.EmbeddingBags."""
    names, ids, offsets, plain, ebc = _collections(s, sparse=True)
    every = dict.fromkeys(names, offsets)
    return lambda: ebc(ids, every), lambda: [plain[k](ids[k], offsets) for k in names]


def collection_forward_fused(s: Sizes) -> tuple[Step, Step]:
    """The same forward under a fused optimizer, which lays each mod table row by row: no id arithmetic."""
    names, ids, offsets, plain, ebc = _collections(s, sparse=True)
    shardvar.optim.fuse(shardvar.optim.RowWiseAdagrad(ebc, lr=0.01))
    every = dict.fromkeys(names, offsets)
    return lambda: ebc(ids, every), lambda: [plain[k](ids[k], offsets) for k in names]


def quantized_bag(s: Sizes) -> tuple[Step, Step]:
    offsets = torch.arange(0, s.ids, 20)
    plain = nn.EmbeddingBag.from_pretrained(s.table, mode="sum")
    bag8 = shardvar.ShardedEmbeddingBag.from_pretrained(s.table, mode="sum", partitioner=8)
    q8 = shardvar.quantize(bag8, torch.quint8)
    return lambda: q8(s.zipf, offsets), lambda: plain(s.zipf, offsets)


def checkpoint(s: Sizes, restore: bool) -> tuple[Step, Step]:
    root = Path(tempfile.mkdtemp(prefix="shardvar-guard-"))
    _SCRATCH.append(root)
    table = torch.randn(s.checkpoint_rows, s.dim)
    v = shardvar.shard_tensor(table, Layout.div(s.checkpoint_rows, 8))
    target = shardvar.shard_tensor(torch.zeros_like(table), Layout.mod(s.checkpoint_rows, 5))
    shardvar.save({"t": v}, root / "ck")
    raw = root / "raw.bin"
    torch.save(table, raw)
    if restore:
        return lambda: shardvar.load({"t": target}, root / "ck"), lambda: torch.load(raw)
    return lambda: shardvar.save({"t": v}, root / "ck"), lambda: torch.save(table, raw)


@functools.cache
def _distributed_run(s: Sizes, rounds: int) -> dict:
    return bench_distributed.run(s.dist_rows, s.dim, s.dist_batch, rounds, paths=("dense", "sparse"), profile=False)


def distributed(path: str) -> Callable[[Sizes, int, float], list[float]]:
    """Ratios of 2 ranks' forward+backward (``path``: dense or sparse gradients) to one process's."""

    def ratios(s: Sizes, rounds: int, min_s: float) -> list[float]:
        stats = _distributed_run(s, max(rounds, 3))
        return [a / b for a, b in zip(stats[path]["ms"], stats[f"one process, {path}"]["ms"], strict=True)]

    return ratios


@functools.cache
def _weak_run(s: Sizes, rounds: int) -> dict:
    return bench_weak_scaling.run(s.dist_rows, s.dim, s.dist_batch, rounds)


def weak(path: str) -> Callable[[Sizes, int, float], list[float]]:
    """Ratios of a rank's step (2 ranks x 1 thread, each its own batch and its share of a table twice the
    size) to one process x 1 thread stepping one batch (``path``: dense, sparse or fused; issue 37)."""

    def ratios(s: Sizes, rounds: int, min_s: float) -> list[float]:
        return bench_weak_scaling.ratios(_weak_run(s, max(rounds, 5))[path], "step", "one process")

    return ratios


def timed(make: Callable[[Sizes], tuple[Step, Step]]) -> Callable[[Sizes, int, float], list[float]]:
    return lambda s, rounds, min_s: ratio(*make(s), rounds, min_s)


CASES: list[tuple[str, Callable[[Sizes, int, float], list[float]]]] = [
    ("lookup, slab (8 div shards) / F.embedding", timed(lookup_slab)),
    ("lookup, user-allocated (8 mod shards) / F.embedding", timed(lambda s: lookup_user(s, 8))),
    ("lookup, one shard / F.embedding", timed(lookup_one_shard)),
    ("lookup, 1024 mod shards / F.embedding", timed(lambda s: lookup_user(s, 1024))),
    ("lookup, list of 8 tensors / F.embedding", timed(lookup_list)),
    ("lookup, 2^18 ids (8 div shards) / F.embedding", timed(lookup_large)),
    ("scatter_add (8 mod shards) / index_add_", timed(scatter)),
    ("bag fwd+bwd, sum (8 shards) / nn.EmbeddingBag", timed(bag)),
    ("training step, Adam (dense) / nn.Embedding", timed(lambda s: train_torch(s, sparse=False))),
    ("training step, SGD (sparse) / nn.Embedding", timed(lambda s: train_torch(s, sparse=True))),
    ("training step, SparseAdam / nn.Embedding", timed(train_sparse_adam)),
    ("training step, fused shardvar.optim / SparseAdam", timed(train_fused)),
    ("collection step, fused RowWiseAdagrad (4 x 8 mod shards) / nn.EmbeddingBag + Adagrad", timed(collection_fused)),
    ("collection forward (4 x 8 mod shards) / nn.EmbeddingBag", timed(collection_forward)),
    ("collection forward, fused (4 x 8 mod shards) / nn.EmbeddingBag", timed(collection_forward_fused)),
    ("bag forward, int8 (8 shards) / nn.EmbeddingBag fp32", timed(quantized_bag)),
    ("2 ranks fwd+bwd, dense / one process", distributed("dense")),
    ("2 ranks fwd+bwd, sparse / one process", distributed("sparse")),
    ("weak scaling, 2 ranks x 1 thread fwd+bwd, dense / 1 process x 1 thread", weak("dense")),
    ("weak scaling, 2 ranks x 1 thread sparse SGD step / 1 process x 1 thread", weak("sparse")),
    ("weak scaling, 2 ranks x 1 thread collection step, fused RowWiseAdagrad / 1 process x 1 thread", weak("fused")),
    ("checkpoint save (8 shards) / torch.save", timed(lambda s: checkpoint(s, restore=False))),
    ("checkpoint restore (into 5 shards) / torch.load", timed(lambda s: checkpoint(s, restore=True))),
]


HUGE_PAGES = (  # the rows timed again with the switch on: lookups, bags, optimizer steps, 2 ranks
    "lookup, slab (8 div shards) / F.embedding",
    "lookup, user-allocated (8 mod shards) / F.embedding",
    "lookup, 2^18 ids (8 div shards) / F.embedding",
    "bag fwd+bwd, sum (8 shards) / nn.EmbeddingBag",
    "training step, Adam (dense) / nn.Embedding",
    "training step, SGD (sparse) / nn.Embedding",
    "training step, SparseAdam / nn.Embedding",
    "2 ranks fwd+bwd, dense / one process",
)
ON = " [huge pages on]"


def measure(names: list[str], rounds: int, min_s: float) -> dict[str, list[float]]:
    """Each named row's ratios, in this process."""
    cases, sizes = dict(CASES), Sizes()
    out = {name: cases[name](sizes, rounds, min_s) for name in names}
    for root in _SCRATCH:
        shutil.rmtree(root, ignore_errors=True)
    return out


def measure_huge_pages(names: list[str], rounds: int, min_s: float) -> dict[str, list[float]]:
    """The named rows' ratios in a child process with torch's huge-page switch on."""
    if not names:
        return {}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "on.json"
        cmd = [sys.executable, __file__, "--rounds", str(rounds), "--min-seconds", str(min_s), "--child", str(out)]
        cmd += [x for name in names for x in ("--row", name)]
        subprocess.run(cmd, check=True, env={**os.environ, "THP_MEM_ALLOC_ENABLE": "1"})
        return {name + ON: ratios for name, ratios in json.loads(out.read_text()).items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--update", action="store_true", help="write this run's ratios to baseline.json")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--min-seconds", type=float, default=0.05, help="per timing, per round")
    parser.add_argument("--only", help="run only the rows whose name contains this")
    parser.add_argument("--child", help=argparse.SUPPRESS)  # write --row rows' ratios to this JSON file
    parser.add_argument("--row", action="append", default=[], help=argparse.SUPPRESS)
    args = parser.parse_args()
    warnings.filterwarnings("ignore", "Sparse invariant checks")
    if args.child:
        Path(args.child).write_text(json.dumps(measure(args.row, args.rounds, args.min_seconds)))
        return 0
    committed = json.loads(BASELINE.read_text()) if BASELINE.exists() else {"tolerance": 0.25, "ratios": {}}
    tolerance, start = committed["tolerance"], time.perf_counter()
    picked = [name for name, _ in CASES if not args.only or args.only in name]
    on = [name for name in HUGE_PAGES if not args.only or args.only in name + ON]
    results = measure(picked, args.rounds, args.min_seconds)
    results.update(measure_huge_pages(on, args.rounds, args.min_seconds))
    measured, rows, worse = {}, [], []
    for name, ratios in results.items():
        measured[name] = statistics.median(ratios)
        base = committed["ratios"].get(name)
        flag = "new" if base is None else "ok" if measured[name] <= base * (1 + tolerance) else "WORSE"
        if flag == "WORSE":
            worse.append(name)
        rows.append([name, f"{measured[name]:.2f}x", f"{min(ratios):.2f}-{max(ratios):.2f}",
                     "-" if base is None else f"{base:.2f}x", flag])  # fmt: skip
    print(f"{torch.get_num_threads()} threads, {args.rounds} rounds, tolerance {tolerance:.0%}, "
          f"{time.perf_counter() - start:.0f} s\n")  # fmt: skip
    print_table(["path (ratio of time to its unsharded baseline)", "median", "range", "baseline", "flag"], rows)
    if args.update:
        known = {**committed["ratios"], **measured}  # rows left out with --only keep their ratio
        order = [name for name, _ in CASES] + [name + ON for name in HUGE_PAGES]
        ratios = {name: known[name] for name in order if name in known}
        BASELINE.write_text(json.dumps({"tolerance": tolerance, "ratios": ratios}, indent=1) + "\n")
        print(f"\n{BASELINE} updated")
        return 0
    if worse:
        print(f"\n{len(worse)} ratio(s) worse than baseline.json by more than {tolerance:.0%}: rerun them "
              "(--only NAME); if it holds, find the cause, or --update deliberately")  # fmt: skip
    return 1 if worse else 0


if __name__ == "__main__":
    sys.exit(main())
