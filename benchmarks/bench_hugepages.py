"""Every path under both huge-page settings: torch's THP_MEM_ALLOC_ENABLE off and on.

    python benchmarks/bench_hugepages.py [--rounds 3] [--rows-log2 19] [--quick]
                                         [--only goal|paths|train|checkpoint|demo]

torch reads its switch once per process, so every round runs one child process per setting,
off then on, interleaved round by round. Each child times every sharded path and its unsharded
baseline alternately (``benchmarks/bench_paths.py``'s paths, the lookup of issue 28's goal,
checkpoint save and restore); the demo is timed whole, as a program. The table gives, per
setting, the median over the rounds and the range (min-max): ratios against the unsharded op
under the same setting, and milliseconds. The goal's comparison with TensorFlow, at the same
size and ids, is ``benchmarks/bench_tf_lookup.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils import benchmark

sys.path.insert(0, str(Path(__file__).parent))
from _common import print_table, zipf_ids

from shardvar._pages import huge_pages_mode

SWITCH = "THP_MEM_ALLOC_ENABLE"
SETTINGS = {"off": "0", "on": "1"}
GOAL = "lookup 2^20 x 64, 2^20 ids: ShardedEmbedding (8 div)"


def _timed(fn, baseline, min_s: float, out: list) -> list[float]:
    """bench_paths' ratio for one round, keeping both times (seconds) in ``out``."""
    base = benchmark.Timer("f()", globals={"f": baseline}).blocked_autorange(min_run_time=min_s).median
    mine = benchmark.Timer("f()", globals={"f": fn}).blocked_autorange(min_run_time=min_s).median
    out.append((mine, base))
    return [mine / base]


def _paths(args: argparse.Namespace, only: list[str]) -> dict[str, tuple[float, float]]:
    import bench_paths

    from shardvar.workloads import BenchSettings, bench_checkpoint

    times: list = []
    r = lambda fn, base: _timed(fn, base, args.min_s, times)  # noqa: E731
    results: dict[str, tuple[float, float]] = {}
    if "goal" in only:
        import shardvar

        table, ids = torch.randn(args.goal_rows, args.dim), zipf_ids(args.goal_rows, args.goal_rows)
        emb = shardvar.ShardedEmbedding.from_pretrained(table, partitioner=8)
        with torch.no_grad():
            r(lambda: emb(ids), lambda: F.embedding(ids, table))
        results[GOAL] = times.pop()
    groups = {"paths": [bench_paths.lookup_rows, bench_paths.bag_rows], "train": [bench_paths.train_rows]}
    for name, fns in groups.items():
        if name in only:
            for fn in fns:
                rows = fn(args, r)
                results.update({row[0]: t for row, t in zip(rows, times, strict=True)})
                times.clear()
    if "checkpoint" in only:
        ck = BenchSettings(checkpoint_mib=args.checkpoint_mib, dim=args.dim, shards=8, repeats=4)
        results.update({x["benchmark"]: (x["sharded_ms"] / 1e3, x["baseline_ms"] / 1e3) for x in bench_checkpoint(ck)})
    return results


def _demo_seconds(setting: str, quick: bool, steps: int) -> float:
    steps = ["--steps", "100", "--users", "5000", "--items", "1000"] if quick else ["--steps", str(steps)]
    cmd = [sys.executable, "-m", "shardvar", "demo", "--no-progress", *steps]
    start = time.perf_counter()
    subprocess.run(cmd, check=True, capture_output=True, env={**os.environ, SWITCH: SETTINGS[setting]})
    return time.perf_counter() - start


def _child(args: argparse.Namespace) -> None:
    warnings.filterwarnings("ignore", "Sparse invariant checks")
    torch.manual_seed(0)
    Path(args.child).write_text(json.dumps(_paths(args, args.only)))


def _cell(values: list[float], fmt: str) -> str:
    return f"{statistics.median(values):{fmt}} [{min(values):{fmt}}-{max(values):{fmt}}]"


def _report(runs: dict[str, list[dict]], demo: dict[str, list[float]]) -> None:
    rows = []
    for name in runs["off"][0]:
        cells = [name]
        for s in SETTINGS:
            mine, base = ([r[name][k] * 1e3 for r in runs[s]] for k in (0, 1))
            cells += [
                _cell([m / b for m, b in zip(mine, base, strict=True)], ".2f"),
                _cell(mine, ".0f"),
                _cell(base, ".0f"),
            ]
        rows.append(cells)
    print_table(["path", "off: ratio", "off: ms", "off: base ms", "on: ratio", "on: ms", "on: base ms"], rows)
    if GOAL in runs["off"][0]:
        base_off = statistics.median(r[GOAL][1] for r in runs["off"])
        for s in SETTINGS:
            mine = statistics.median(r[GOAL][0] for r in runs[s])
            print(f"\ngoal: shardvar lookup, switch {s}, / F.embedding, switch off = {mine / base_off:.2f}x (<= 0.4x)")
    for s, seconds in demo.items():
        print(f"shardvar demo (whole program), switch {s}: {_cell(seconds, '.1f')} s")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="small sizes, 1 round (a smoke test)")
    p.add_argument("--only", action="append", choices=["goal", "paths", "train", "checkpoint", "demo"])
    p.add_argument("--demo-steps", type=int, default=100, help="training steps of the timed demo")
    p.add_argument("--rows-log2", type=int, default=19, help="2^N table rows of the paths (the goal's: 2^20)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    args.only = args.only or ["goal", "paths", "train", "checkpoint", "demo"]
    big = not args.quick
    n = args.rows_log2 if big else 12
    args.goal_rows, args.dim = (1 << 20, 64) if big else (1 << 12, 16)
    args.rows, args.ids, args.bag_rows, args.bag_ids, args.bags = 1 << n, 1 << n, 1 << n, 1 << (n - 1), 1 << (n - 5)
    args.train_ids, args.min_s, args.checkpoint_mib = (1 << 16, 0.1, 256.0) if big else (1 << 10, 0.01, 1.0)
    if args.child:
        _child(args)
        return
    rounds = args.rounds if big else 1
    runs: dict[str, list[dict]] = {s: [] for s in SETTINGS}
    demo: dict[str, list[float]] = {s: [] for s in SETTINGS}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(rounds):
            for s, value in SETTINGS.items():
                out = Path(tmp) / f"{s}.json"
                cmd = [sys.executable, __file__, "--child", str(out), "--rows-log2", str(args.rows_log2)]
                cmd += ["--quick"] if args.quick else []
                cmd += [x for o in args.only for x in ("--only", o)]
                subprocess.run(cmd, check=True, env={**os.environ, SWITCH: value})
                runs[s].append(json.loads(out.read_text()))
                if "demo" in args.only:
                    demo[s].append(_demo_seconds(s, args.quick, args.demo_steps))
    print(f"{torch.get_num_threads()} threads; THP {huge_pages_mode()}; {rounds} round(s), settings interleaved; "
          f"paths: 2^{n} x {args.dim} tables, training steps {args.train_ids} ids\n")  # fmt: skip
    _report(runs, {s: d for s, d in demo.items() if d})


if __name__ == "__main__":
    main()
