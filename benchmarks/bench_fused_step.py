"""The fused training step of a collection against plain torch (issue 25, part 6), measured interleaved.

    python benchmarks/bench_fused_step.py [--tables 8] [--rows-log2 16] [--dim 64] [--batch 2048] [--shards 1]
                                          [--rounds 5] [--quick]

Three steps (forward, backward, row-wise Adagrad update), each round timing every one in turn:
- ``plain``: ``--tables`` ``nn.EmbeddingBag(sparse=True)`` and ``torch.optim.Adagrad`` (the baseline);
- ``shardvar``: ``EmbeddingBagCollection(sparse=True)`` with the fused ``RowWiseAdagrad``, whose
  backward sums each distinct row's gradient over its bags at once (a sparse product);
- ``per-id``: the same with torch's ``embedding_bag`` backward (a gradient row per id, summed later),
  the path before the sparse product.
Ratios are to ``plain`` in the same round: median and range (min-max) over the rounds. Ids are
Zipf (exponent 1.05), ~``--ids`` per bag, as in the issue (8 x 2^18 x 64, batch 4096, 20 ids: use
``--rows-log2 18 --batch 4096``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn
from torch.utils import benchmark

sys.path.insert(0, str(Path(__file__).parent))
from _common import print_table, zipf_ids

import shardvar.nn._collection as collection
import shardvar.optim as so
from shardvar import EmbeddingBagCollection, TableConfig


def per_id_bag(
    rows: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor, mode: str, psw: torch.Tensor | None
) -> torch.Tensor:
    """The backward before the sparse product (torch's: a gradient row per id), for comparison."""
    return nn.functional.embedding_bag(rows, weight, offsets, mode=mode, sparse=True, per_sample_weights=psw)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tables", type=int, default=8)
    parser.add_argument("--rows-log2", type=int, default=16)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--batch", type=int, default=2048)
    parser.add_argument("--ids", type=int, default=20, help="ids per bag")
    parser.add_argument("--shards", type=int, default=1, help="mod shards per table")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="tiny sizes, one round (a check that it runs)")
    args = parser.parse_args()
    if args.quick:
        args.tables, args.rows_log2, args.batch, args.rounds = 2, 10, 64, 1
    rows, n = 1 << args.rows_log2, args.batch * args.ids
    names = [f"t{i}" for i in range(args.tables)]
    ids = {k: zipf_ids(n, rows, seed=i) for i, k in enumerate(names)}
    offsets = torch.arange(args.batch) * args.ids
    grad = torch.randn(args.batch, args.dim)

    torch.manual_seed(0)
    plain = nn.ModuleDict({k: nn.EmbeddingBag(rows, args.dim, mode="sum", sparse=True) for k in names})
    plain_opt = torch.optim.Adagrad(plain.parameters(), lr=0.01)
    ebc = EmbeddingBagCollection({k: TableConfig(rows, args.dim, args.shards, "mod") for k in names}, sparse=True)
    so.fuse(so.RowWiseAdagrad(ebc, lr=0.01))

    def plain_step() -> None:
        sum((plain[k](ids[k], offsets) * grad).sum() for k in names).backward()
        plain_opt.step()
        plain_opt.zero_grad()

    def ours_step() -> None:
        sum((v * grad).sum() for v in ebc(ids, dict.fromkeys(names, offsets)).values()).backward()

    def per_id_step() -> None:
        collection.sparse_bag, kept = per_id_bag, collection.sparse_bag
        try:
            ours_step()
        finally:
            collection.sparse_bag = kept

    steps: dict[str, Callable[[], None]] = {"plain": plain_step, "shardvar": ours_step, "per-id": per_id_step}
    times: dict[str, list[float]] = {k: [] for k in steps}
    for _ in range(args.rounds):  # interleaved: each round times every step once more
        for label, fn in steps.items():
            times[label].append(benchmark.Timer("fn()", globals={"fn": fn}).timeit(3).median * 1e3)
    table = []
    for label in steps:
        ratios = [t / p for t, p in zip(times[label], times["plain"], strict=True)]
        table.append([label, f"{statistics.median(times[label]):.1f}", f"{statistics.median(ratios):.2f}",
                      f"{min(ratios):.2f}-{max(ratios):.2f}"])  # fmt: skip
    print(f"{args.tables} tables x 2^{args.rows_log2} x {args.dim}, batch {args.batch}, {args.ids} Zipf ids per bag, "
          f"{args.shards} shard(s) per table, {args.rounds} rounds, {torch.get_num_threads()} thread(s)")  # fmt: skip
    print_table(["step", "median ms", "ratio to plain", "range"], table)


if __name__ == "__main__":
    main()
