"""The fused training step of a collection against plain torch (issue 25, part 6), measured interleaved.

    python benchmarks/bench_fused_step.py [--tables 8] [--rows-log2 18] [--dim 64] [--batch 4096] [--ids 20]
                                          [--shards 1,8] [--optimizers adagrad,adam] [--rounds 5] [--quick]

For each optimizer and shard count, two models over the same Zipf ids (exponent 1.05, ``--ids``
per bag, sum pooling; the defaults are the issue's 8 x 2^18 x 64, batch 4096, 20 ids):
- ``plain``: ``--tables`` ``nn.EmbeddingBag(sparse=True)`` with ``torch.optim.Adagrad`` (adagrad)
  or ``torch.optim.SparseAdam`` (adam): the baseline;
- ``shardvar``: ``EmbeddingBagCollection(sparse=True)`` of ``--shards`` mod shards per table with
  ``RowWiseAdagrad`` / ``RowWiseAdam`` fused into backward.
Each round times the training step (forward, backward, update) of both, in turn, then 40 forwards
of each, call by call and alternating (a round's forward time is their median); ratios are to
``plain`` in the same round: median and range (min-max) over the rounds. Memory is measured in a
fresh process per model (peak RSS, ``VmHWM``, growth from before the model is built): building
the tables, against their size; and three training steps, against the tables alone (the issue's
goal) and against the tables plus the optimizer's state (row-wise Adagrad's is 1/64 of the tables
at width 64; RowWiseAdam keeps an element-wise first moment: its state is the tables' size again).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn
from torch.utils import benchmark

sys.path.insert(0, str(Path(__file__).parent))
from _common import print_table, zipf_ids

import shardvar.optim as so
from shardvar import EmbeddingBagCollection, TableConfig

OURS = {"adagrad": so.RowWiseAdagrad, "adam": so.RowWiseAdam}
FORWARD_PAIRS = 40  # forwards of each timed per round, plain and ours in turn

PLAIN: dict[str, Callable[[list[nn.Parameter]], torch.optim.Optimizer]] = {
    "adagrad": lambda p: torch.optim.Adagrad(p, lr=0.01),
    "adam": lambda p: torch.optim.SparseAdam(p, lr=0.01),
}


class Setup:
    """The inputs of every step: ids per table, offsets and the gradient of the bags."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args, self.rows = args, 1 << args.rows_log2
        self.names = [f"t{i}" for i in range(args.tables)]
        self.ids = {k: zipf_ids(args.batch * args.ids, self.rows, seed=i) for i, k in enumerate(self.names)}
        self.offsets = torch.arange(args.batch) * args.ids
        self.grad = torch.randn(args.batch, args.dim, generator=torch.Generator().manual_seed(0))
        self.table_bytes = args.tables * self.rows * args.dim * 4

    def build(self, which: str, shards: int) -> nn.Module:
        a = self.args
        if which == "plain":
            return nn.ModuleDict({k: nn.EmbeddingBag(self.rows, a.dim, mode="sum", sparse=True) for k in self.names})
        configs = {k: TableConfig(self.rows, a.dim, shards, "mod") for k in self.names}
        return EmbeddingBagCollection(configs, sparse=True)

    def optimizer(self, which: str, opt: str, model: nn.Module) -> torch.optim.Optimizer:
        if which == "plain":
            return PLAIN[opt](list(model.parameters()))
        optimizer = OURS[opt](model, lr=0.01)
        so.fuse(optimizer)
        return optimizer

    def steps(self, which: str, model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[Callable, Callable]:
        """(forward, training step) of one model."""
        names, ids, offsets, grad = self.names, self.ids, self.offsets, self.grad
        if which == "plain":

            def forward() -> list[torch.Tensor]:
                return [model[k](ids[k], offsets) for k in names]
        else:

            def forward() -> list[torch.Tensor]:
                return list(model(ids, dict.fromkeys(names, offsets)).values())

        def step() -> None:
            sum((v * grad).sum() for v in forward()).backward()
            optimizer.step()  # the fused one has nothing left to do, as a training loop calls it anyway
            optimizer.zero_grad()

        return forward, step


def _rss(key: str) -> int:
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith(key)).split()[1]) * 1024


def _state_bytes(optimizer: torch.optim.Optimizer) -> int:
    if isinstance(optimizer, so.TableOptimizer):
        return optimizer.state_bytes
    tensors = [x for state in optimizer.state.values() for x in state.values() if isinstance(x, torch.Tensor)]
    return sum(x.numel() * x.element_size() for x in tensors if x.dim())  # not the step counts


def child_memory(setup: Setup, which: str, opt: str, shards: int) -> dict[str, float]:
    """Peak RSS growth of building the tables, then of three training steps (in this fresh process)."""
    torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)  # torch.optim's first use imports ~70 MiB of modules
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak from here on
    before = _rss("VmRSS")
    model = setup.build(which, shards)
    build = _rss("VmHWM") - before
    optimizer = setup.optimizer(which, opt, model)
    _, step = setup.steps(which, model, optimizer)
    step()  # torch's SparseAdam makes its state at the first step
    state = _state_bytes(optimizer)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    for _ in range(3):
        step()
    train = _rss("VmHWM") - before
    return {"build": build / setup.table_bytes, "train": train / (setup.table_bytes + state),
            "train_tables": train / setup.table_bytes, "state": state / setup.table_bytes}  # fmt: skip


def memory(setup: Setup, which: str, opt: str, shards: int) -> dict[str, float]:
    if setup.args.quick:  # a check that it runs: in this process, whose peak says nothing
        return child_memory(setup, which, opt, shards)
    cmd = [sys.executable, __file__, *sys.argv[1:], "--child", f"{which},{opt},{shards}"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def timings(setup: Setup, opt: str, shards: int, rounds: int) -> dict[str, list[float]]:
    """Times (ms) of forward and step, plain and shardvar, interleaved round by round.

    A forward (a few ms) is timed call by call, plain and ours in turn (which goes first alternates),
    ``FORWARD_PAIRS`` pairs per round: a round's time of each is the median of its calls, so a
    moment of load on a shared machine moves both alike or neither.
    """
    fns: dict[str, Callable] = {}
    for which in ("plain", "shardvar"):
        model = setup.build(which, shards)
        forward, step = setup.steps(which, model, setup.optimizer(which, opt, model))
        fns[f"{which} forward"], fns[f"{which} step"] = forward, step
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(rounds):
        for label in ("plain step", "shardvar step"):
            timer = benchmark.Timer("fn()", globals={"fn": fns[label]}, num_threads=torch.get_num_threads())
            times[label].append(timer.timeit(2).median * 1e3)
        calls: dict[str, list[float]] = {"plain forward": [], "shardvar forward": []}
        for i in range(FORWARD_PAIRS):
            for label in sorted(calls, reverse=bool(i % 2)):
                start = time.perf_counter()
                fns[label]()
                calls[label].append((time.perf_counter() - start) * 1e3)
        for label, xs in calls.items():
            times[label].append(statistics.median(xs))
    return times


def _spread(xs: list[float]) -> str:
    return f"{statistics.median(xs):.2f} [{min(xs):.2f}-{max(xs):.2f}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tables", type=int, default=8)
    parser.add_argument("--rows-log2", type=int, default=18)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--batch", type=int, default=4096)
    parser.add_argument("--ids", type=int, default=20, help="ids per bag")
    parser.add_argument("--shards", default="1,8", help="mod shards per table, comma-separated")
    parser.add_argument("--optimizers", default="adagrad,adam", help=f"of {sorted(OURS)}, comma-separated")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's; 1 steadies a loaded machine)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, one round (a check that it runs)")
    parser.add_argument("--child", help=argparse.SUPPRESS)  # which,optimizer,shards: one memory measurement
    args = parser.parse_args()
    if args.quick:
        args.tables, args.rows_log2, args.batch, args.rounds = 2, 10, 64, 1
    warnings.filterwarnings("ignore", "Sparse invariant checks")
    if args.threads:
        torch.set_num_threads(args.threads)
    setup = Setup(args)
    if args.child:
        which, opt, shards = args.child.split(",")
        print(json.dumps(child_memory(setup, which, opt, int(shards))))
        return
    rows = []
    for opt in args.optimizers.split(","):
        for shards in map(int, args.shards.split(",")):
            t = timings(setup, opt, shards, args.rounds)
            fwd = [a / b for a, b in zip(t["shardvar forward"], t["plain forward"], strict=True)]
            step = [a / b for a, b in zip(t["shardvar step"], t["plain step"], strict=True)]
            mem = {w: memory(setup, w, opt, shards) for w in ("shardvar", "plain")}
            rows.append([f"{opt}, {shards} shard(s)", _spread(fwd), _spread(step),
                         f"{statistics.median(t['shardvar step']):.0f} / {statistics.median(t['plain step']):.0f}",
                         f"{mem['shardvar']['train_tables']:.3f} ({mem['plain']['train_tables']:.2f})",
                         f"{mem['shardvar']['train']:.3f} ({mem['plain']['train']:.2f})",
                         f"{mem['shardvar']['build']:.3f} ({mem['plain']['build']:.2f})",
                         f"{mem['shardvar']['state']:.2f} ({mem['plain']['state']:.2f})"])  # fmt: skip
    a = args
    print(f"{a.tables} tables x 2^{a.rows_log2} x {a.dim} ({setup.table_bytes >> 20} MiB), batch {a.batch}, "
          f"{a.ids} Zipf ids per bag, {a.rounds} rounds, {torch.get_num_threads()} thread(s); "
          "ratios to plain torch in the same round: median [min-max]; memory: shardvar (plain)")  # fmt: skip
    heads = ["optimizer, shards per table", "forward ratio", "step ratio", "step ms (ours / plain)",
             "train peak / tables", "train peak / (tables+state)", "build peak / tables", "state / tables"]  # fmt: skip
    print_table(heads, rows)


if __name__ == "__main__":
    main()
