"""Every path on a CUDA GPU against the unsharded torch op on the same GPU, measured interleaved.

    python benchmarks/bench_cuda.py [--rows-log2 22] [--dim 128] [--ids-log2 20] [--rounds 7] [--quick]

Rows (ratios of time, sharded / plain, median and range over the rounds; each round times both,
in turn, ``Timer.timeit(n)`` with ``n`` calls sized to ~20 ms, which synchronises the GPU):
- lookups and bags of Zipf ids in a 2^22 x 128 table (2 GiB) split in 8 div / 8 mod shards, and
  in 1024 mod shards a user made (moved into one slab);
- a scatter_add into the table;
- a training step of ``ShardedEmbeddingBag`` (dense gradient, Adagrad; sparse gradient, SparseAdam);
- the fused step of issue 25: 8 tables x 2^18 x 64, sum pooling, 20 ids per bag, batch 16384,
  ``EmbeddingBagCollection`` + fused ``RowWiseAdagrad`` against 8 ``nn.EmbeddingBag(sparse=True)``
  + ``torch.optim.Adagrad`` (which updates every element's state, not a row's: not the same math,
  the same job).
Skips with a message where there is no GPU.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.benchmark import Timer

sys.path.insert(0, str(Path(__file__).parent))
from _common import print_table, zipf_ids

import shardvar
import shardvar.optim as so
from shardvar import EmbeddingBagCollection, KeyedJagged, Layout, ShardedVariable, TableConfig

DEV = "cpu" if "--dry-run-on-cpu" in sys.argv else "cuda"


def interleaved(fn: Callable[[], object], base: Callable[[], object], rounds: int) -> tuple[list[float], float]:
    """Per round, the time of ``fn`` over the time of ``base``, each timed over ~20 ms of calls in turn."""
    fn(), base()
    once = Timer("f()", globals={"f": base}).timeit(3).median
    n = max(1, int(0.02 / max(once, 1e-6)))
    ratios, base_ms = [], []
    for _ in range(rounds):
        b = Timer("f()", globals={"f": base}).timeit(n).median
        m = Timer("f()", globals={"f": fn}).timeit(n).median
        ratios.append(m / b)
        base_ms.append(b * 1e3)
    return ratios, statistics.median(base_ms)


def row(name: str, fn: Callable[[], object], base: Callable[[], object], rounds: int) -> list[object]:
    ratios, base_ms = interleaved(fn, base, rounds)
    print(f"  {name}: {statistics.median(ratios):.2f}x", flush=True)
    return [name, f"{statistics.median(ratios):.2f}x", f"{min(ratios):.2f}-{max(ratios):.2f}", f"{base_ms:.3f}"]


def lookup_rows(args: argparse.Namespace) -> list[list[object]]:
    rows = 1 << args.rows_log2
    table = torch.randn(rows, args.dim, device=DEV)
    ids = zipf_ids(1 << args.ids_log2, rows).to(DEV)
    offsets = torch.arange(0, ids.numel(), 32, device=DEV)
    out = []
    bag = shardvar.variables.functional.embedding_bag
    for strategy in ("div", "mod"):
        v = shardvar.shard_tensor(table, Layout.balanced(strategy, rows, 8))
        out.append(row(f"embedding_lookup, 8 {strategy}", lambda v=v: shardvar.embedding_lookup(v, ids),
                       lambda: F.embedding(ids, table), args.rounds))  # fmt: skip
        out.append(row(f"embedding_bag sum, 8 {strategy}", lambda v=v: bag(v.store, ids, offsets, mode="sum"),
                       lambda: F.embedding_bag(ids, table, offsets, mode="sum"), args.rounds))  # fmt: skip
    users = ShardedVariable([c.clone() for c in shardvar.shard_tensor(table, Layout.mod(rows, 1024)).variables],
                            partition_strategy="mod")  # fmt: skip
    out.append(row("embedding_lookup, 1024 user mod shards", lambda u=users: shardvar.embedding_lookup(u, ids),
                   lambda: F.embedding(ids, table), args.rounds))  # fmt: skip
    v = shardvar.shard_tensor(table.clone(), Layout.balanced("mod", rows, 8))
    upd = torch.randn(ids.numel(), args.dim, device=DEV)
    target = table.clone()
    out.append(row("scatter_add, 8 mod", lambda: v.scatter_add(ids, upd), lambda: target.index_add_(0, ids, upd),
                   args.rounds))  # fmt: skip
    return out


def step_of(module: nn.Module, opt: torch.optim.Optimizer, call: Callable[[nn.Module], torch.Tensor]) -> Callable:
    def go() -> None:
        call(module).sum().backward()
        opt.step()
        opt.zero_grad()

    return go


def train_rows(args: argparse.Namespace) -> list[list[object]]:
    rows = 1 << (args.rows_log2 - 2)
    ids = zipf_ids(1 << args.ids_log2, rows).to(DEV)
    offsets = torch.arange(0, ids.numel(), 32, device=DEV)
    call = lambda m: m(ids, offsets)  # noqa: E731
    out = []
    for sparse, make in ((False, torch.optim.Adagrad), (True, torch.optim.SparseAdam)):
        plain = nn.EmbeddingBag(rows, args.dim, mode="sum", sparse=sparse, device=DEV)
        mine = shardvar.ShardedEmbeddingBag.from_pretrained(
            plain.weight.detach().clone(), freeze=False, partitioner=8, partition_strategy="mod", sparse=sparse,
            mode="sum",
        )  # fmt: skip
        name = f"training step, ShardedEmbeddingBag 8 mod, {'sparse + SparseAdam' if sparse else 'dense + Adagrad'}"
        out.append(row(name, step_of(mine, make(mine.parameters(), lr=0.01), call),
                       step_of(plain, make(plain.parameters(), lr=0.01), call), args.rounds))  # fmt: skip
    return out


def fused_rows(args: argparse.Namespace) -> list[list[object]]:
    names, rows, batch, per_bag = [f"t{i}" for i in range(8)], 1 << 18, args.batch, 20
    ids = {k: zipf_ids(batch * per_bag, rows, seed=i).to(DEV) for i, k in enumerate(names)}
    offsets = torch.arange(batch, device=DEV) * per_bag
    lengths = torch.full((len(names), batch), per_bag, device=DEV)
    kjt = KeyedJagged(tuple(names), torch.cat([ids[k] for k in names]), lengths)
    plain = nn.ModuleDict({k: nn.EmbeddingBag(rows, 64, mode="sum", sparse=True, device=DEV) for k in names})
    plain_opt = torch.optim.Adagrad(plain.parameters(), lr=0.01)

    def plain_step() -> None:
        sum(plain[k](ids[k], offsets).sum() for k in names).backward()
        plain_opt.step()
        plain_opt.zero_grad()

    out = []
    for shards in (1, 8):
        ebc = EmbeddingBagCollection({k: TableConfig(rows, 64, shards, "mod") for k in names}, sparse=True).to(DEV)
        so.fuse(so.RowWiseAdagrad(ebc, lr=0.01))
        with torch.no_grad():
            out.append(row(f"collection forward, 8 tables, {shards} mod shard(s)", lambda e=ebc: e(kjt),
                           lambda: [plain[k](ids[k], offsets) for k in names], args.rounds))  # fmt: skip
        out.append(row(f"collection step, fused RowWiseAdagrad, {shards} mod shard(s)",
                       lambda e=ebc: sum(v.sum() for v in e(kjt).values()).backward(), plain_step,
                       args.rounds))  # fmt: skip
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows-log2", type=int, default=22)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--ids-log2", type=int, default=20)
    p.add_argument("--batch", type=int, default=16384)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--quick", action="store_true", help="small sizes, 3 rounds: a smoke run")
    p.add_argument("--dry-run-on-cpu", action="store_true", help="run the code on the CPU: a check of the script")
    args = p.parse_args()
    if DEV == "cuda" and not torch.cuda.is_available():
        print("bench_cuda: no CUDA GPU on this machine; nothing to measure")
        return
    if args.quick:
        args.rows_log2, args.ids_log2, args.batch, args.rounds = 16, 14, 1024, 3
    print(f"{torch.cuda.get_device_name() if DEV == 'cuda' else 'CPU'}, torch {torch.__version__}", flush=True)
    table = [*lookup_rows(args), *train_rows(args), *fused_rows(args)]
    title = "shardvar on the GPU / plain torch on the same GPU (time ratios; median, range over rounds)"
    print_table(["path", "ratio", "range", "plain ms"], table, title=title)


if __name__ == "__main__":
    main()
