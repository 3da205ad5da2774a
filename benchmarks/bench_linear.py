"""A vocabulary-parallel output projection (ShardedLinear, shard_parameter) against nn.Linear.

    python benchmarks/bench_linear.py [--vocab 16384] [--dim 128] [--tokens 256] [--shards 4] [--quick]

Forward, and forward + backward, of the ``[tokens, dim] -> [tokens, vocab]`` projection. Every
candidate and the nn.Linear baseline are timed with torch.utils.benchmark.Timer in alternation,
round after round, in the same run; the table gives each one's median over the rounds, the spread
(interquartile range) and the ratio to the baseline's median. "separate shards" rows hold shards
that share no slab (each shard computes its slice of the logits, joined along the last axis).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn
from torch.utils.benchmark import Timer

sys.path.insert(0, str(Path(__file__).parent))
from _common import print_table

from shardvar import Layout, ShardedLinear, ShardedVariable, shard_parameter
from shardvar.variables import ShardStore


def candidates(reference: nn.Linear, shards: int) -> dict[str, nn.Module]:
    vocab, _ = reference.weight.shape
    out: dict[str, nn.Module] = {}
    for strategy in ("div", "mod"):
        out[f"ShardedLinear {strategy}"] = ShardedLinear.from_linear(reference, shards, strategy)
        layout = getattr(Layout, strategy)(vocab, shards)
        apart = [nn.Parameter(p.clone()) for p in layout.split(reference.weight.detach())]
        store = ShardStore(layout, reference.weight.shape, dict(enumerate(apart)), adopt=False)
        out[f"ShardedLinear {strategy}, separate shards"] = ShardedLinear(
            reference.in_features, vocab, reference.bias, weight=ShardedVariable.from_store(store)
        )
    for label, layout in (("div", Layout.div(vocab, shards)), ("axis 1", Layout.div(reference.in_features, 2, 1))):
        module = nn.Linear(reference.in_features, vocab)
        module.load_state_dict(reference.state_dict())
        shard_parameter(module, "weight", layout)
        out[f"shard_parameter {label}"] = module
    return out


def forward_backward(module: nn.Module, x: torch.Tensor) -> Callable[[], None]:
    def step() -> None:
        module.zero_grad(set_to_none=True)
        module(x).sum().backward()

    return step


def measure(fns: dict[str, Callable[[], object]], rounds: int, quick: bool) -> dict[str, list[float]]:
    """Seconds per call of each fn, one measurement per fn per round, the fns in alternation."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            timer = Timer(stmt="fn()", globals={"fn": fn}, num_threads=torch.get_num_threads())
            m = timer.timeit(3) if quick else timer.blocked_autorange(min_run_time=0.2)
            times[name].append(m.median)
    return times


def spread(values: list[float]) -> float:
    if len(values) < 2:
        return 0.0
    q = statistics.quantiles(values, n=4)
    return q[2] - q[0]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, default=16384)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="tiny sizes, few rounds: checks that it runs")
    args = parser.parse_args(argv)
    if args.quick:
        args.vocab, args.dim, args.tokens, args.rounds = 64, 8, 4, 2
    torch.manual_seed(0)
    reference = nn.Linear(args.dim, args.vocab)
    x = torch.randn(args.tokens, args.dim)
    modules = candidates(reference, args.shards)
    for name, module in modules.items():  # every candidate computes what nn.Linear computes
        torch.testing.assert_close(module(x), reference(x), msg=name)
    print(
        f"{args.tokens} x {args.dim} -> {args.vocab} float32, {args.shards} shards, "
        f"{torch.get_num_threads()} threads, {args.rounds} rounds\n"
    )
    rows = []
    for what, make in (("forward", lambda m: lambda: m(x)), ("forward+backward", lambda m: forward_backward(m, x))):
        fns = {"nn.Linear": make(reference)} | {name: make(m) for name, m in modules.items()}
        times = measure(fns, args.rounds, args.quick)
        base = statistics.median(times["nn.Linear"])
        for name, ts in times.items():
            med = statistics.median(ts)
            ratio = f"{med / base:.2f}x"
            rows.append([what, name, f"{med * 1e3:.3f}", f"{spread(ts) * 1e3:.3f}", ratio])
    print_table(["pass", "module", "median ms", "IQR ms", "vs nn.Linear"], rows)


if __name__ == "__main__":
    main()
