"""Dynamic tables against a fixed nn.Embedding over the same ids remapped to 0..n-1.

    python benchmarks/bench_dynamic.py [--ids 1048576] [--rounds 5] [--quick]

Ids: Zipf(1.05) draws over ``--ids`` distinct random int64 values; the dynamic table's capacity
holds them all (it was trained on them once, so a lookup finds every id). Each row times the
dynamic table and the fixed table alternately (torch.utils.benchmark), and prints the median
ratio and its range over the rounds. Memory: bytes per row of capacity, rows and bookkeeping.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils import benchmark

sys.path.insert(0, str(Path(__file__).parent))
from _common import print_table, zipf_ids

from shardvar.dynamic import DynamicEmbedding


def _time(fn: object) -> float:
    return benchmark.Timer("fn()", globals={"fn": fn}).blocked_autorange(min_run_time=0.3).median * 1e3


def _pair(ours: object, base: object, rounds: int) -> tuple[float, float, list[float]]:
    a, b = [], []
    for _ in range(rounds):
        b.append(_time(base))
        a.append(_time(ours))
    return statistics.median(a), statistics.median(b), [x / y for x, y in zip(a, b, strict=True)]


def _cases(dim: int, n: int, shards: int) -> dict[str, tuple[object, object]]:
    g = torch.Generator().manual_seed(0)
    keys = torch.randint(-(2**63), 2**63 - 1, (n,), generator=g)
    ids = keys[zipf_ids(n, n)]
    dyn = DynamicEmbedding(dim, n + n // 4, shards, sparse=True)  # room for the shards' uneven shares
    dyn(keys)  # every id gets its row
    assert bool(dyn.contains(keys).all())
    remapped = torch.searchsorted(keys.sort().values, ids)
    fixed = torch.nn.Embedding(n, dim, sparse=True)

    def lookup() -> None:
        with torch.no_grad():
            dyn.eval()(ids)

    def fixed_lookup() -> None:
        with torch.no_grad():
            F.embedding(remapped, fixed.weight)

    def step() -> None:
        dyn.train()(ids).sum().backward()
        for p in dyn.parameters():
            p.grad = None

    def fixed_step() -> None:
        fixed(remapped).sum().backward()
        fixed.weight.grad = None

    return {
        f"lookup, dim {dim}": (lookup, fixed_lookup),
        f"train step (fwd+bwd, sparse), dim {dim}": (step, fixed_step),
    }


def _insert_ms(dim: int, n: int, shards: int) -> tuple[float, float]:
    """Time of the first training call with ``n`` new ids (admit, place, initialise), and of a fixed lookup."""
    keys = torch.randint(-(2**63), 2**63 - 1, (n,), generator=torch.Generator().manual_seed(1))
    dyn = DynamicEmbedding(dim, 2 * n, shards)
    start = time.perf_counter()
    dyn(keys)
    took = time.perf_counter() - start
    fixed = torch.nn.Embedding(2 * n, dim)
    return took * 1e3, _time(lambda: fixed(torch.arange(n)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ids", type=int, default=1 << 20)
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="small sizes, one round (a smoke test)")
    args = parser.parse_args()
    n, rounds = (1 << 14, 1) if args.quick else (args.ids, args.rounds)
    torch.set_num_threads(torch.get_num_threads())
    rows = []
    for dim in (16, 64):
        for name, (ours, base) in _cases(dim, n, args.shards).items():
            a, b, ratios = _pair(ours, base, rounds)
            rows.append(
                [
                    name,
                    f"{a:.1f}",
                    f"{b:.1f}",
                    f"{statistics.median(ratios):.2f}x",
                    f"{min(ratios):.2f}-{max(ratios):.2f}x",
                ]
            )
        took, base = _insert_ms(dim, n // 16, args.shards)
        rows.append([f"insert {n // 16} new ids, dim {dim}", f"{took:.1f}", f"{base:.1f}", f"{took / base:.1f}x", "-"])
    print(f"{n} Zipf(1.05) ids over {n} distinct int64 ids, {args.shards} shards, {torch.get_num_threads()} threads")
    print_table(["case", "dynamic ms", "fixed ms", "ratio", "range"], rows)
    probe = DynamicEmbedding(64, n, args.shards)
    book = sum(b.numel() * b.element_size() for name, b in probe.slots.named_buffers() if name in ("meta", "index"))
    print(f"\nmemory per row of capacity: rows {64 * 4} B (dim 64, float32) + ids and index {book / n:.0f} B")


if __name__ == "__main__":
    main()
