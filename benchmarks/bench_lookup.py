"""Sharded lookup and scatter_add against the unsharded torch ops, measured in the same run.

    python benchmarks/bench_lookup.py [--rows 1048576] [--dim 64] [--ids 1048576] [--shards 8]

Goal (issue 3): sharded time <= 1.1x unsharded for embedding_lookup (div and mod) and
scatter_add. Rows marked "separate shards" use shards allocated one by one (no shared slab):
the generic path every other ShardedVariable takes.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from _common import compare, print_table, zipf_ids

import shardvar
from shardvar import Layout, ShardedVariable


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1 << 20)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--ids", type=int, default=1 << 20)
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.manual_seed(0)
    table = torch.randn(args.rows, args.dim)
    ids = zipf_ids(args.ids, args.rows)
    updates = torch.randn(args.ids, args.dim)
    print(
        f"table {args.rows} x {args.dim} float32, {args.ids} Zipf(1.05) ids ({ids.unique().numel()} distinct), "
        f"{args.shards} shards, {torch.get_num_threads()} threads\n"
    )
    rows = []
    for strategy in ("div", "mod"):
        layout = getattr(Layout, strategy)(args.rows, args.shards)
        slab = shardvar.shard_tensor(table, layout)
        separate = ShardedVariable([s.clone() for s in slab.variables], partition_strategy=strategy)
        for label, v in ((strategy, slab), (f"{strategy}, separate shards", separate)):
            expected = F.embedding(ids, table)
            assert torch.equal(shardvar.embedding_lookup(v, ids), expected)
            t, base = compare(
                lambda v=v: shardvar.embedding_lookup(v, ids), lambda: F.embedding(ids, table), args.repeats
            )
            rows.append(["embedding_lookup", label, f"{t:.1f}", f"{base:.1f}", f"{t / base:.2f}x"])
            target = table.clone()
            t, base = compare(
                lambda v=v: v.scatter_add(ids, updates),
                lambda target=target: target.index_add_(0, ids, updates),
                args.repeats,
            )
            rows.append(["scatter_add", label, f"{t:.1f}", f"{base:.1f}", f"{t / base:.2f}x"])
    print_table(["op", "layout", "sharded ms", "unsharded ms", "ratio"], rows)
    print("\nunsharded baselines: torch.nn.functional.embedding and Tensor.index_add_ on one table")


if __name__ == "__main__":
    main()
