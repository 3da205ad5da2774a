"""Quantized serving tables: bytes, bag forward time against fp32 nn.EmbeddingBag, and correctness.

    python benchmarks/bench_quantized.py [--rows 1000000] [--dim 64] [--batch 4096] [--bag 20] [--repeats 15]
        [--distinct]

Goals (issue 24): bytes int8 <= 0.30x of fp32 at dim 64, int4 <= 0.16x (scale and bias counted);
bag forward (sum, ``[batch, bag]`` ids, uniform and Zipf) int8 >= 1.2x faster than fp32 ``nn.EmbeddingBag`` in
the same run, with 1 and 8 shards; int4 reported. Each repetition times every candidate in turn
(interleaved, ``torch.utils.benchmark``); the table gives medians and the min-max spread over the
repetitions. Correctness: every quantized forward equals ``F.embedding_bag`` over the dequantized
table to fp32 rounding, and every element is within half a quantization step of the float table.

``--distinct`` adds the other way to look up an int8 table (issue 36): dequantize only the batch's
distinct rows (one ``torch.unique`` of the ids), then an fp32 bag over them with the remapped ids.
With Zipf ids the distinct rows are few, but finding them (a sort of every id) costs more than
the whole fp32 bag over cached hot rows, so it is a row to compare, not the module's path.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.benchmark import Timer

sys.path.insert(0, str(Path(__file__).parent))
from _common import print_table, zipf_ids

import shardvar
from shardvar import ShardedEmbeddingBag
from shardvar.quantized import row_format

DTYPES = {"int8": torch.quint8, "int4": torch.quint4x2}
BASELINE = "fp32 nn.EmbeddingBag"


class _DistinctRows(torch.nn.Module):
    """An int8 table looked up by dequantizing the batch's distinct rows, then an fp32 bag over them."""

    def __init__(self, q: torch.nn.Module) -> None:
        super().__init__()
        self.q, self.format, self.store = q, q.format, q.store  # 1 shard: the slab is in logical row order
        self.nbytes = q.nbytes

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        unique, inverse = torch.unique(ids, return_inverse=True)
        rows = self.format.unpack(self.store.full_slab.index_select(0, unique))
        return F.embedding_bag(inverse, rows, mode="sum")

    def dequantize(self) -> torch.Tensor:
        return self.q.dequantize()


def _candidates(table: torch.Tensor, shard_counts: list[int], distinct: bool) -> dict[str, torch.nn.Module]:
    """The fp32 baseline, then each quantized table for each shard count (mod shards: ids are mapped)."""
    out: dict[str, torch.nn.Module] = {BASELINE: torch.nn.EmbeddingBag.from_pretrained(table, mode="sum")}
    for shards in shard_counts:
        bag = ShardedEmbeddingBag.from_pretrained(table, partitioner=shards, partition_strategy="mod", mode="sum")
        for name, dtype in DTYPES.items():
            out[f"{name}, {shards} shard{'s' * (shards > 1)}"] = shardvar.quantize(bag, dtype)
        del bag
    if distinct:
        out["int8 distinct rows, 1 shard"] = _DistinctRows(out["int8, 1 shard"])
    return out


def _check(table: torch.Tensor, q: torch.nn.Module, ids: torch.Tensor) -> float:
    """Max |quantized bag - fp32 bag over the dequantized table|; raises if an element is off by > half a step."""
    deq = q.dequantize()
    fmt = q.format
    step = fmt.step(q.store.full_slab)[q.store.slab_rows(torch.arange(table.shape[0]))]
    slack = 1e-6 if fmt.name == "quint8" else 2e-3 * table.abs().amax(1)  # 4-bit: scale and bias are float16
    over = (deq - table).abs() - (step / 2 + slack).unsqueeze(1)
    if bool((over > 1e-6).any()):
        raise AssertionError(f"{fmt.name}: an element is {float(over.max()):.2e} beyond half a quantization step")
    with torch.inference_mode():
        return float((q(ids) - F.embedding_bag(ids, deq, mode="sum")).abs().max())


def _time(
    candidates: dict[str, torch.nn.Module], ids: torch.Tensor, repeats: int, min_run_time: float
) -> dict[str, list[float]]:
    """Per candidate, one median time (ms) per repetition; the candidates take turns within each."""
    times: dict[str, list[float]] = {name: [] for name in candidates}
    with torch.inference_mode():
        for _ in range(repeats):
            for name, module in candidates.items():
                m = Timer("module(ids)", globals={"module": module, "ids": ids}).blocked_autorange(
                    min_run_time=min_run_time
                )
                times[name].append(m.median * 1e3)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--batch", type=int, default=4096)
    parser.add_argument("--bag", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--quick", action="store_true", help="a small table, few repetitions (a smoke test)")
    parser.add_argument("--distinct", action="store_true", help="also time int8 by distinct rows (unique + fp32 bag)")
    args = parser.parse_args()
    if args.quick:
        args.rows, args.batch, args.repeats = 20_000, 512, 1
    torch.manual_seed(0)
    table = torch.randn(args.rows, args.dim)
    print(
        f"table {args.rows} x {args.dim} float32, batch {args.batch} x {args.bag} ids, sum bags, "
        f"{torch.get_num_threads()} threads, {args.repeats} interleaved repetitions\n"
    )
    print_table(
        ["dtype", "bytes per row", "table bytes / fp32", "goal"],
        [
            [n, row_format(d).row_bytes(args.dim), f"{row_format(d).row_bytes(args.dim) / (args.dim * 4):.3f}x", g]
            for (n, d), g in zip(DTYPES.items(), ["<= 0.30x", "<= 0.16x"], strict=True)
        ],
    )
    candidates = _candidates(table, [1, 8], args.distinct)
    for label, ids in _id_sets(args).items():
        errors = {name: _check(table, q, ids) for name, q in candidates.items() if name != BASELINE}
        times = _time(candidates, ids, args.repeats, 0.01 if args.quick else 0.2)
        print(f"\n{label} ids:")
        print_table(
            ["bag forward", "ms median (min-max)", "fp32 / this (min-max)", "bytes / fp32", "max |err|"],
            [_row(name, t, times[BASELINE], candidates, errors, table) for name, t in times.items()],
        )
    print("\nmax |err|: against F.embedding_bag over the dequantized table (fp32 rounding); goal int8 >= 1.2x")


def _id_sets(args: argparse.Namespace) -> dict[str, torch.Tensor]:
    n = args.batch * args.bag
    g = torch.Generator().manual_seed(1)
    return {
        "uniform": torch.randint(0, args.rows, (n,), generator=g).reshape(args.batch, args.bag),
        "Zipf(1.05)": zipf_ids(n, args.rows).reshape(args.batch, args.bag),  # hot rows stay in cache: fp32 gains
    }


def _row(name: str, t: list[float], base: list[float], candidates: dict, errors: dict, table: torch.Tensor) -> list:
    speedups = [b / x for b, x in zip(base, t, strict=True)]
    fp32_bytes = table.numel() * table.element_size()
    nbytes = fp32_bytes if name == BASELINE else candidates[name].nbytes
    return [
        name,
        f"{statistics.median(t):.2f} ({min(t):.2f}-{max(t):.2f})",
        f"{statistics.median(speedups):.2f}x ({min(speedups):.2f}-{max(speedups):.2f})",
        f"{nbytes / fp32_bytes:.3f}x",
        "-" if name == BASELINE else f"{errors[name]:.1e}",
    ]


if __name__ == "__main__":
    main()
