"""Table optimizers against torch.optim: time of a training step, and memory of the state and the step.

    python benchmarks/bench_optim.py [--rows 4194304] [--dim 64] [--ids 65536] [--rounds 5] [--quick]

A sparse table of 8 shards trained with Zipf ids; each row times the shardvar optimizer's step and
the torch.optim baseline's on the same model alternately (torch.utils.benchmark), median and range
of the ratio over the rounds. Memory: the state's size, and the peak RSS growth of three steps in a
fresh process, against the table's size.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import warnings
from pathlib import Path

import torch
from torch import nn
from torch.utils import benchmark

sys.path.insert(0, str(Path(__file__).parent))
from _common import print_table, zipf_ids

import shardvar
from shardvar import optim as so


def _fused(opt: so.TableOptimizer) -> so.TableOptimizer:
    so.fuse(opt)
    return opt


CASES = {  # name -> (ours, baseline)
    "fused RowWiseAdagrad vs SparseAdam": (
        lambda m: _fused(so.RowWiseAdagrad(m, lr=0.01)),
        lambda p: torch.optim.SparseAdam(p, lr=0.01),
    ),
    "RowWiseAdagrad vs SparseAdam": (
        lambda m: so.RowWiseAdagrad(m, lr=0.01),
        lambda p: torch.optim.SparseAdam(p, lr=0.01),
    ),
    "Adagrad vs torch Adagrad (sparse)": (lambda m: so.Adagrad(m, lr=0.01), lambda p: torch.optim.Adagrad(p, lr=0.01)),
    "Adam vs SparseAdam": (lambda m: so.Adam(m, lr=0.01), lambda p: torch.optim.SparseAdam(p, lr=0.01)),
    "SGD vs torch SGD (sparse)": (lambda m: so.SGD(m, lr=0.01), lambda p: torch.optim.SGD(p, lr=0.01)),
}

PEAK = """
import sys, warnings, torch, shardvar
from shardvar import optim as so
warnings.filterwarnings("ignore", "Sparse invariant checks")
rows, dim, n, which = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
def rss(key):
    return int(next(l for l in open("/proc/self/status") if l.startswith(key)).split()[1]) * 1024
ids = torch.randint(0, rows, (n,), generator=torch.Generator().manual_seed(0))
if which == "torch Adagrad, dense nn.Embedding":
    m = torch.nn.Embedding(rows, dim)
    opt = torch.optim.Adagrad(m.parameters(), lr=0.01)
else:
    m = shardvar.ShardedEmbedding(rows, dim, 8, sparse=True)
    opt = (so.Adam if which == "Adam" else so.RowWiseAdagrad)(m, lr=0.01)
    if which.startswith("fused"):
        so.fuse(opt)
state = sum(x.numel() * x.element_size() for x in getattr(opt, "state", {}).values() for x in x.values()
            if isinstance(x, torch.Tensor))
open("/proc/self/clear_refs", "w").write("5")  # the peak from here: the steps, not the model's construction
before = rss("VmRSS")
for _ in range(3):
    m(ids).sum().backward()
    opt.step()
    opt.zero_grad()
print(rss("VmHWM") - before)
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1 << 22)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--ids", type=int, default=1 << 16)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="small sizes, 1 round (a smoke test)")
    args = parser.parse_args()
    if args.quick:
        args.rows, args.ids, args.rounds = 1 << 12, 1 << 10, 1
    min_s = 0.01 if args.quick else 0.2  # quick: each step timed a few times, as a smoke test
    warnings.filterwarnings("ignore", "Sparse invariant checks")
    ids = zipf_ids(args.ids, args.rows)
    table_bytes = args.rows * args.dim * 4
    print(f"table {args.rows} x {args.dim} float32 ({table_bytes >> 20} MiB), 8 shards, {args.ids} Zipf ids\n")
    rows = []
    for name, (ours, theirs) in CASES.items():
        mine = shardvar.ShardedEmbedding(args.rows, args.dim, 8, sparse=True)
        plain = nn.Embedding(args.rows, args.dim, sparse=True)
        steps = []
        for module, opt in ((mine, ours(mine)), (plain, theirs(list(plain.parameters())))):

            def go(module=module, opt=opt) -> None:
                module(ids).sum().backward()
                opt.step()
                opt.zero_grad()

            steps.append(go)
        ratios = []
        for _ in range(args.rounds):
            base = benchmark.Timer("f()", globals={"f": steps[1]}).blocked_autorange(min_run_time=min_s).median
            mine_t = benchmark.Timer("f()", globals={"f": steps[0]}).blocked_autorange(min_run_time=min_s).median
            ratios.append(mine_t / base)
        rows.append(
            [f"training step: {name}", f"{statistics.median(ratios):.2f}x", f"{min(ratios):.2f}-{max(ratios):.2f}"]
        )
    state = so.RowWiseAdagrad(shardvar.ShardedEmbedding(args.rows, args.dim, 8), lr=0.1).state_bytes
    rows.append(["RowWiseAdagrad state / table", f"{state / table_bytes:.4f}", f"{state >> 20} MiB"])
    cases = ("fused RowWiseAdagrad", "RowWiseAdagrad", "Adam", "torch Adagrad, dense nn.Embedding")
    for which in cases[:1] if args.quick else cases:  # quick: one case, as a smoke test
        cmd = [sys.executable, "-c", PEAK, str(args.rows), str(args.dim), str(args.ids), which]
        peak = int(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)
        state = {"Adam": 2 * table_bytes}.get(which, args.rows * 4 if "RowWise" in which else table_bytes)
        ratio = (table_bytes + state + peak) / (table_bytes + state)  # the table and eager state exist before
        rows.append(
            [f"peak of 3 steps / (table + state): {which}", f"{ratio:.2f}", f"+{peak >> 20} MiB during the steps"]
        )
    print_table(["measure", "median", "range / size"], rows)


if __name__ == "__main__":
    main()
