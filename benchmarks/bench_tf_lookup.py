"""Issue 28's lookup goal: shardvar against F.embedding and TensorFlow, under both huge-page settings.

    python benchmarks/bench_tf_lookup.py --tf-python /work/tfvenv/bin/python [--rounds 3] [--quick]

A 2^20 x 64 float32 table, 2^20 Zipf(1.05) ids. Round by round, interleaved: one torch child per
setting of ``THP_MEM_ALLOC_ENABLE`` (off, then on; torch reads it once per process) times
``ShardedEmbedding`` (8 div shards) and ``F.embedding`` alternately; then a TensorFlow child
times ``tf.nn.embedding_lookup`` on one variable, on 8 variables (div, TF 2's only strategy) and
on 8 variables with ``tf.compat.v1``'s ``partition_strategy="mod"``, each inside ``tf.function``,
alternately, on the same ids (handed over as a .npy file) and a table of the same shape.
TensorFlow runs in an interpreter of its own, never this one's environment::

    python -m venv /work/tfvenv && /work/tfvenv/bin/pip install tensorflow-cpu

Without ``--tf-python`` the TensorFlow columns are skipped (said so). Printed: milliseconds, and
the ratios of the goal, each the median over the rounds [min-max] of per-round ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from _common import compare, print_table, zipf_ids

import shardvar
from shardvar._pages import SWITCH, huge_pages_mode

SETTINGS = {"off": "0", "on": "1"}
TF_LOOKUPS = ("tf unsharded", "tf 8 shards, div", "tf 8 shards, mod")
TF = """
import json, sys, time
import numpy as np, tensorflow as tf
ids_path, rows, dim, repeats = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
ids = tf.constant(np.load(ids_path))
table = tf.Variable(tf.random.normal([rows, dim]))
shards = [tf.Variable(tf.random.normal([rows // 8 + (k < rows % 8), dim])) for k in range(8)]  # div and mod sizes
lookups = {
    "tf unsharded": tf.function(lambda: tf.nn.embedding_lookup(table, ids)),
    "tf 8 shards, div": tf.function(lambda: tf.nn.embedding_lookup(shards, ids)),
    "tf 8 shards, mod": tf.function(lambda: tf.compat.v1.nn.embedding_lookup(shards, ids, partition_strategy="mod")),
}
times = {name: [] for name in lookups}
for f in lookups.values():
    f(); f()  # trace, then warm
for _ in range(repeats):
    for name, f in lookups.items():
        start = time.perf_counter()
        f().shape  # eager CPU execution is synchronous: the rows are gathered when the call returns
        times[name].append(time.perf_counter() - start)
print(json.dumps({name: sorted(t)[len(t) // 2] * 1e3 for name, t in times.items()}))
"""


def torch_child(args: argparse.Namespace) -> dict[str, float]:
    """Medians (ms) of the sharded lookup and ``F.embedding`` under this process's setting."""
    warnings.filterwarnings("ignore", "Sparse invariant checks")
    torch.manual_seed(0)
    ids = torch.from_numpy(np.load(args.ids_path))
    table = torch.randn(args.rows, args.dim)
    emb = shardvar.ShardedEmbedding.from_pretrained(table, partitioner=8)
    with torch.no_grad():
        assert torch.equal(emb(ids), F.embedding(ids, table))
        mine, base = compare(lambda: emb(ids), lambda: F.embedding(ids, table), repeats=args.repeats)
    return {"shardvar": mine, "F.embedding": base}


def tf_times(python: str, ids_path: str, rows: int, dim: int, repeats: int) -> dict[str, float]:
    """TensorFlow's lookups of the ids in ``ids_path`` (median ms each), run by ``python``."""
    cmd = [python, "-c", TF, ids_path, str(rows), str(dim), str(repeats)]
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if out.returncode != 0:
        raise SystemExit(f"{python} could not run the TensorFlow lookups:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _cell(values: list[float], fmt: str) -> str:
    return f"{statistics.median(values):{fmt}} [{min(values):{fmt}}-{max(values):{fmt}}]"


def report(runs: dict[str, list[dict]], tf: list[dict]) -> None:
    """Milliseconds per setting, then each goal ratio per round (paired within the round)."""
    rows = [[f"shardvar ShardedEmbedding (8 div), switch {s}", _cell([r["shardvar"] for r in runs[s]], ".0f")]
            for s in SETTINGS]  # fmt: skip
    rows += [[f"F.embedding, switch {s}", _cell([r["F.embedding"] for r in runs[s]], ".0f")] for s in SETTINGS]
    rows += [[name, _cell([t[name] for t in tf], ".0f")] for name in (TF_LOOKUPS if tf else ())]
    print_table(["lookup", "ms, median [min-max]"], rows)
    ratios = []
    for s in SETTINGS:
        mine = [r["shardvar"] for r in runs[s]]
        pairs = [("F.embedding, switch off", [r["F.embedding"] for r in runs["off"]], "<= 0.4x")]
        if s != "off":
            pairs.append((f"F.embedding, switch {s}", [r["F.embedding"] for r in runs[s]], ""))
        for name in TF_LOOKUPS if tf else ():
            pairs.append((name, [t[name] for t in tf], "<= 0.5x" if name == TF_LOOKUPS[0] else ""))
        for name, theirs, goal in pairs:
            per_round = [m / t for m, t in zip(mine, theirs, strict=True)]
            ratios.append([f"shardvar, switch {s} / {name}", _cell(per_round, ".2f"), goal])
    print()
    print_table(["ratio of times", "median [min-max]", "goal"], ratios)
    if not tf:
        print("\nTensorFlow skipped: no --tf-python (an interpreter with tensorflow-cpu, in a venv of its own)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--repeats", type=int, default=7, help="timed calls of each lookup per round and process")
    p.add_argument("--quick", action="store_true", help="small sizes, 1 round (a smoke test)")
    p.add_argument("--tf-python", metavar="PYTHON", help="a Python with tensorflow: also time TensorFlow's lookups")
    p.add_argument("--child", nargs=2, metavar=("IDS", "OUT"), help=argparse.SUPPRESS)
    args = p.parse_args()
    args.rows, args.dim, args.ids = (1 << 12, 16, 1 << 12) if args.quick else (1 << 20, 64, 1 << 20)
    if args.child:
        args.ids_path = args.child[0]
        Path(args.child[1]).write_text(json.dumps(torch_child(args)))
        return
    rounds = 1 if args.quick else args.rounds
    runs: dict[str, list[dict]] = {s: [] for s in SETTINGS}
    tf: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="bench-tf-") as tmp:
        ids_path, out = str(Path(tmp) / "ids.npy"), Path(tmp) / "out.json"
        np.save(ids_path, zipf_ids(args.ids, args.rows).numpy())
        for _ in range(rounds):
            for s, value in SETTINGS.items():
                cmd = [sys.executable, __file__, "--child", ids_path, str(out), "--repeats", str(args.repeats)]
                subprocess.run(cmd + ["--quick"] * args.quick, check=True, env={**os.environ, SWITCH: value})
                runs[s].append(json.loads(out.read_text()))
            if args.tf_python:
                tf.append(tf_times(args.tf_python, ids_path, args.rows, args.dim, args.repeats))
    print(f"table {args.rows} x {args.dim}, {args.ids} Zipf(1.05) ids; {torch.get_num_threads()} torch threads; "
          f"THP {huge_pages_mode()}; {rounds} round(s), settings and TensorFlow interleaved\n")  # fmt: skip
    report(runs, tf)


if __name__ == "__main__":
    main()
