"""Every path a user can take, against the unsharded op: lookups, scatters, bags, training steps.

    python benchmarks/bench_paths.py [--rounds 5] [--quick] [--only lookup|bag|train|memory|dist]

Each row times the sharded op and its unsharded baseline alternately (torch.utils.benchmark,
``blocked_autorange`` per round) and prints the median ratio of times with its range over the
rounds. Goals are issue 11's (ratios of time; the distributed row is a ratio of speed).
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils import benchmark

sys.path.insert(0, str(Path(__file__).parent))
from _common import print_table, zipf_ids

import shardvar
from shardvar import Layout, ShardedVariable


def ratio(fn: Callable[[], object], baseline: Callable[[], object], rounds: int, min_s: float) -> list[float]:
    """Per round: median time of ``fn`` over median time of ``baseline``, measured alternately."""
    out = []
    for _ in range(rounds):
        base = benchmark.Timer("f()", globals={"f": baseline}).blocked_autorange(min_run_time=min_s).median
        mine = benchmark.Timer("f()", globals={"f": fn}).blocked_autorange(min_run_time=min_s).median
        out.append(mine / base)
    return out


def row(name: str, goal: str, ratios: list[float]) -> list[object]:
    return [name, f"{statistics.median(ratios):.2f}x", f"{min(ratios):.2f}-{max(ratios):.2f}", goal]


def lookup_rows(args: argparse.Namespace, r: Callable) -> list[list[object]]:
    rows, dim = args.rows, args.dim
    table, ids = torch.randn(rows, dim), zipf_ids(args.ids, rows)
    updates = torch.randn(ids.numel(), dim)
    plain = lambda: F.embedding(ids, table)  # noqa: E731
    out = []
    for shards in (8, 1024):
        mine = ShardedVariable(
            [c.clone() for c in shardvar.shard_tensor(table, Layout.mod(rows, shards)).variables],
            partition_strategy="mod",
        )
        assert torch.equal(shardvar.embedding_lookup(mine, ids), plain())
        goal = "<= 1.1x" if shards == 8 else "<= 1.2x"
        out.append(
            row(
                f"user's shards, {shards} mod: embedding_lookup",
                goal,
                r(lambda m=mine: shardvar.embedding_lookup(m, ids), plain),
            )
        )
    one = ShardedVariable([table.clone()])
    out.append(row("ONE shard: embedding_lookup", "<= 1.05x", r(lambda: shardvar.embedding_lookup(one, ids), plain)))
    emb1 = shardvar.ShardedEmbedding.from_pretrained(table, partitioner=1)
    out.append(row("ONE shard: ShardedEmbedding forward", "<= 1.05x", r(lambda: emb1(ids), plain)))
    parts = [c.clone() for c in shardvar.shard_tensor(table, Layout.mod(rows, 8)).variables]
    out.append(
        row(
            "embedding_lookup(list of 8 tensors, mod)",
            "<= 1.3x",
            r(lambda: shardvar.embedding_lookup(parts, ids, "mod"), plain),
        )
    )
    mine = ShardedVariable(
        [c.clone() for c in shardvar.shard_tensor(table, Layout.mod(rows, 8)).variables], partition_strategy="mod"
    )
    target = table.clone()
    out.append(
        row(
            "user's shards, 8 mod: scatter_add",
            "<= 1.1x",
            r(lambda: mine.scatter_add(ids, updates), lambda: target.index_add_(0, ids, updates)),
        )
    )
    return out


def bag_rows(args: argparse.Namespace, r: Callable) -> list[list[object]]:
    rows, dim, n_ids, n_bags = args.bag_rows, args.dim, args.bag_ids, args.bags
    ids = zipf_ids(n_ids, rows)
    offsets = torch.arange(0, n_ids, n_ids // n_bags)
    weights = torch.rand(n_ids)
    out = []
    cases = [("sum", {}), ("mean", {}), ("max", {}), ("sum", {"psw": True}), ("mean", {"padding_idx": 0})]
    for mode, extra in cases:
        kw = {"padding_idx": extra["padding_idx"]} if "padding_idx" in extra else {}
        plain = nn.EmbeddingBag(rows, dim, mode=mode, **kw)
        mine = shardvar.ShardedEmbeddingBag.from_pretrained(
            plain.weight.detach(), freeze=False, mode=mode, partitioner=8, **kw
        )
        psw = weights if extra.get("psw") else None
        label = mode + (" + per_sample_weights" if psw is not None else "") + (" + padding_idx" if kw else "")
        fwd = lambda m, psw=psw: lambda: m(ids, offsets, per_sample_weights=psw)  # noqa: E731
        with torch.no_grad():
            out.append(row(f"ShardedEmbeddingBag forward, {label}", "<= 1.1x", r(fwd(mine), fwd(plain))))

        def step(m: nn.Module, psw: torch.Tensor | None = psw) -> Callable[[], None]:
            def go() -> None:
                m(ids, offsets, per_sample_weights=psw).sum().backward()
                for p in m.parameters():
                    p.grad = None

            return go

        out.append(row(f"ShardedEmbeddingBag forward+backward, {label}", "<= 1.1x", r(step(mine), step(plain))))
    table = plain.weight.detach()
    mine = shardvar.shard_tensor(table, Layout.div(rows, 8))
    out.append(
        row(
            "embedding_bag (8 div) vs F.embedding_bag",
            "<= 1.1x",
            r(lambda: shardvar.embedding_bag(mine, ids, offsets), lambda: F.embedding_bag(ids, table, offsets)),
        )
    )
    return out


def train_rows(args: argparse.Namespace, r: Callable) -> list[list[object]]:
    rows, dim = args.rows, args.dim
    ids = zipf_ids(args.train_ids, rows)
    optimizers = {
        "dense Adam": (False, lambda p: torch.optim.Adam(p, lr=0.01)),
        "Adagrad (dense)": (False, lambda p: torch.optim.Adagrad(p, lr=0.01)),
        "SparseAdam": (True, lambda p: torch.optim.SparseAdam(p, lr=0.01)),
        "sparse SGD": (True, lambda p: torch.optim.SGD(p, lr=0.01)),
        "Adagrad (sparse)": (True, lambda p: torch.optim.Adagrad(p, lr=0.01)),
    }
    out = []
    for name, (sparse, make) in optimizers.items():
        plain = nn.Embedding(rows, dim, sparse=sparse)
        mine = shardvar.ShardedEmbedding.from_pretrained(
            plain.weight.detach(), freeze=False, partitioner=8, sparse=sparse
        )

        def step(m: nn.Module, make: Callable = make) -> Callable[[], None]:
            opt = make(list(m.parameters()))

            def go() -> None:
                m(ids).pow(2).sum().backward()
                opt.step()
                opt.zero_grad()

            return go

        out.append(row(f"training step, 8 div shards, {name}", "<= 1.1x", r(step(mine), step(plain))))
    return out


MEMORY = """
import sys, warnings, torch, shardvar
from torch import nn
warnings.filterwarnings("ignore", "Sparse invariant checks")
rows, dim, n_ids, name, which = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
sparse = name in ("SparseAdam", "sparse SGD", "Adagrad (sparse)")
make = {"dense Adam": torch.optim.Adam, "Adagrad (dense)": torch.optim.Adagrad, "SparseAdam": torch.optim.SparseAdam,
        "sparse SGD": torch.optim.SGD, "Adagrad (sparse)": torch.optim.Adagrad}[name]
def status(key):
    return int(next(l for l in open("/proc/self/status") if l.startswith(key)).split()[1]) * 1024
ids = torch.randint(0, rows, (n_ids,), generator=torch.Generator().manual_seed(0))
base = status("VmRSS")
m = nn.Embedding(rows, dim, sparse=sparse)
if which == "sharded":
    m = shardvar.ShardedEmbedding.from_pretrained(m.weight.detach(), freeze=False, partitioner=8, sparse=sparse)
opt = make(list(m.parameters()), lr=0.01)
for _ in range(3):
    m(ids).pow(2).sum().backward()
    opt.step()
    opt.zero_grad()
print(status("VmHWM") - base)
"""


def memory_rows(args: argparse.Namespace, r: Callable) -> list[list[object]]:
    """Peak memory of three training steps (a fresh process per case), sharded over unsharded."""
    out = []
    names = ("dense Adam", "Adagrad (dense)", "SparseAdam", "sparse SGD", "Adagrad (sparse)")
    for name in names[:1] if args.quick else names:  # quick: one case, as a smoke test
        peak = {}
        for which in ("sharded", "plain"):
            cmd = [sys.executable, "-c", MEMORY, str(args.rows), str(args.dim), str(args.train_ids), name, which]
            peak[which] = int(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)
        ratio_ = peak["sharded"] / peak["plain"]
        out.append([f"peak memory of a training step, 8 div shards, {name}", f"{ratio_:.3f}x",
                    f"{peak['sharded'] >> 20} / {peak['plain'] >> 20} MiB", "<= 1.05x"])  # fmt: skip
    return out


def dist_rows(args: argparse.Namespace, r: Callable) -> list[list[object]]:
    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        rows, dim = args.rows, args.dim
        table, ids = torch.randn(rows, dim), zipf_ids(args.ids, rows)
        emb = shardvar.DistributedEmbedding(rows, dim, 8, "div")
        speed = [1 / x for x in r(lambda: emb(ids), lambda: F.embedding(ids, table))]
        return [["distributed lookup, 1 process (speed vs F.embedding)", f"{statistics.median(speed):.2f}x",
                 f"{min(speed):.2f}-{max(speed):.2f}", ">= 0.8x"]]  # fmt: skip
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="small sizes, 1 round (a smoke test)")
    parser.add_argument("--only", action="append", choices=["lookup", "bag", "train", "memory", "dist"])
    args = parser.parse_args()
    big = not args.quick
    args.rows, args.dim, args.ids = (1 << 19, 64, 1 << 19) if big else (1 << 12, 16, 1 << 12)
    args.bag_rows, args.bag_ids, args.bags = (1 << 20, 1 << 18, 1 << 14) if big else (1 << 12, 1 << 11, 1 << 7)
    args.train_ids = 1 << 16 if big else 1 << 10
    rounds, min_s = (args.rounds, 0.2) if big else (1, 0.01)
    torch.manual_seed(0)
    warnings.filterwarnings("ignore", "Sparse invariant checks")  # torch.optim.Adagrad's, sparse
    print(f"{torch.get_num_threads()} threads; table {args.rows} x {args.dim}, {args.ids} Zipf(1.05) ids; "
          f"bags: {args.bag_rows} x {args.dim}, {args.bag_ids} ids in {args.bags} bags; {rounds} rounds\n")  # fmt: skip
    r = lambda fn, base: ratio(fn, base, rounds, min_s)  # noqa: E731
    groups = {"lookup": lookup_rows, "bag": bag_rows, "train": train_rows, "memory": memory_rows, "dist": dist_rows}
    rows = []
    for name, fn in groups.items():
        if not args.only or name in args.only:
            rows += fn(args, r)
    print_table(["path (ratio of time to the unsharded op)", "median", "range", "goal"], rows)


if __name__ == "__main__":
    main()
