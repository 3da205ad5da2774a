"""The benchmark scripts run (in their quick form): they are run by hand for figures, and must not rot."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).parent.parent / "benchmarks"


@pytest.mark.parametrize(
    ("script", "prints"),
    [
        ("bench_checkpoint_production.py", ["async blocked / sync", "delta size / full size"]),
        ("bench_paths.py", ["user's shards, 1024 mod", "ShardedEmbeddingBag forward+backward, max", "sparse SGD"]),
        ("bench_collection.py", ["all_to_all calls per step", "collection step vs 26 ShardedEmbeddingBags"]),
        ("bench_dynamic.py", ["lookup, dim 16", "insert", "memory per row of capacity"]),
        ("bench_quantized.py", ["int8, 8 shards", "fp32 / this", "Zipf(1.05) ids"]),
        ("bench_optim.py", ["RowWiseAdagrad vs SparseAdam", "RowWiseAdagrad state / table", "peak of 3 steps"]),
        ("bench_fused_step.py", ["step ratio", "build peak / tables", "adam, 8 shard(s)"]),
        ("bench_distributed.py", ["2 ranks, dense", "2 ranks, dtensor", "one process, sparse", "x the bound"]),
        (
            "bench_tiered.py",
            ["tiered, prefetch", "hit rate", "bytes read", "equal the in-memory table's after training: True"],
        ),
        ("bench_tf_lookup.py", ["shardvar, switch on / F.embedding, switch off", "TensorFlow skipped: no --tf-python"]),
    ],
)
def test_benchmark_runs_quick(script: str, prints: list[str]) -> None:
    out = subprocess.run(
        [sys.executable, str(BENCHMARKS / script), "--quick"], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    assert all(p in out.stdout for p in prints), out.stdout


def test_the_weak_scaling_benchmark_reports_every_path_against_its_baselines() -> None:
    # Small sizes, 2 repetitions; the ranks are forks of the script (no second import of torch): ~6 s.
    out = subprocess.run(
        [sys.executable, str(BENCHMARKS / "bench_weak_scaling.py"), "--quick", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    paths = json.loads(out.stdout)["paths"]
    assert sorted(paths) == ["dense", "fused", "sparse"]
    for stats in paths.values():
        assert all(len(stats[k]) == 2 and min(stats[k]) > 0 for k in ("step", "one process", "a2a", "raw", "cpu"))
        assert stats["calls"] == 4  # split sizes with the verdicts, ids, rows; gradients in backward
        assert 1 <= stats["sent"] / stats["bound"] < 1.2  # each remote row out and back, and the ids


def test_the_guard_has_a_committed_baseline_for_every_path() -> None:
    sys.path.insert(0, str(BENCHMARKS))
    import guard

    committed = json.loads((BENCHMARKS / "baseline.json").read_text())
    assert 0 < committed["tolerance"] < 1
    rows = [name for name, _ in guard.CASES] + [name + guard.ON for name in guard.HUGE_PAGES]
    assert rows == list(committed["ratios"])
    assert set(guard.HUGE_PAGES) <= set(dict(guard.CASES))
    assert all(r > 0 for r in committed["ratios"].values())


def test_the_tiered_capacity_run_reports_its_bound_and_says_when_uncapped() -> None:
    # (--no-cgroup: a test never makes cgroups; as root with cgroup v1 the real run caps itself)
    out = subprocess.run(
        [sys.executable, str(BENCHMARKS / "bench_tiered.py"), "--capacity", "--quick", "--no-cgroup"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    for line in ["memory cap skipped", "peak RSS / (cache + 512 MiB)", "hit rate", "misses per step", "bytes read"]:
        assert line in out.stdout, out.stdout


@pytest.mark.parametrize(("root", "enabled", "why"), [(False, True, "needs root"), (True, False, "--no-cgroup")])
def test_the_capacity_run_skips_its_cap_with_a_message(monkeypatch, capsys, root, enabled, why) -> None:
    sys.path.insert(0, str(BENCHMARKS))
    import _capacity

    monkeypatch.setattr(_capacity.os, "geteuid", lambda: 0 if root else 1000)
    with _capacity.capped(1 << 30, enabled) as group:
        assert group is None
    assert why in capsys.readouterr().out
