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
        ("bench_tiered_io.py", ["first compile of the kernel", "read 1024", "write 256", "python / native"]),
        ("bench_tf_lookup.py", ["shardvar, switch on / F.embedding, switch off", "TensorFlow skipped: no --tf-python"]),
    ],
)
def test_benchmark_runs_quick(script: str, prints: list[str]) -> None:
    if script == "bench_tiered_io.py":  # it compares the kernel with the Python path: nothing to run without one
        from shardvar.tiered import _native

        if _native.kernel() is None:
            pytest.skip("no native record kernel here (no C compiler, or SHARDVAR_NATIVE=0)")
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


def test_the_tiered_capacity_run_reports_its_bound_floor_and_both_id_laws(tmp_path) -> None:
    # (--no-cgroup: a test never makes cgroups; as root with cgroup v1 the real run caps itself)
    record = tmp_path / "capacity.json"
    out = subprocess.run(
        [
            sys.executable,
            str(BENCHMARKS / "bench_tiered.py"),
            "--capacity",
            "--quick",
            "--no-cgroup",
            "--json",
            str(record),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    for line in ["memory cap skipped", "peak RSS / (cache + 512 MiB)", "disk, queue depth 1", "disk, queue depth 32",
                 "vs floor (<= 1.3x)", "zipf, prefetch off", "zipf, prefetch on", "uniform, prefetch on", "hit rate",
                 "misses / step", "disk MiB read / written per step"]:  # fmt: skip
        assert line in out.stdout, out.stdout
    got = json.loads(record.read_text())
    assert got["cgroup"] is None and got["config"]["rows"] == 1 << 14
    assert set(got["disk"]) == {"1", "32"} and all(d["reads_per_s"] > 0 for d in got["disk"].values())
    assert {(r["ids"], r["prefetch"]) for r in got["runs"]} == {
        (d, p) for d in ("zipf", "uniform") for p in (False, True)
    }
    for d in got["disk"].values():  # probed before and after the steps; the floor takes the faster
        assert d["reads_per_s"] == max(d["reads_per_s_before"], d["reads_per_s_after"]) > 0
    rate = got["disk"]["32"]["reads_per_s"]
    for r in got["runs"]:
        assert r["floor_s"] == pytest.approx(max(r["memory_step_s"], r["misses_per_step"] / rate))
        assert r["vs_floor"] == pytest.approx(r["step_s"] / r["floor_s"])
        assert 0 <= r["hit_rate"] <= 1 and r["misses_per_step"] > 0 and r["steps"] == 3  # (a chunk's first step untimed)


def test_the_tiered_speed_run_writes_its_record(tmp_path) -> None:
    record = tmp_path / "speed.json"
    out = subprocess.run(
        [sys.executable, str(BENCHMARKS / "bench_tiered.py"), "--quick", "--json", str(record)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    for line in ["tiered, prefetch", "hit rate", "bytes read", "equal the in-memory table's after training: True"]:
        assert line in out.stdout, out.stdout  # (its run in the quick list above would be this one again)
    got = json.loads(record.read_text())
    assert got["equal"] is True and got["goal"] == 1.5
    assert set(got["step_ms"]) == {"in memory", "tiered", "tiered, prefetch"}
    assert got["vs_memory"]["tiered"] == pytest.approx(got["step_ms"]["tiered"] / got["step_ms"]["in memory"])
    assert 0 <= got["hit_rate"] <= 1 and got["per_step"]["misses"] > 0


@pytest.mark.parametrize("exponent", [0.8, 1.05, 1.3])
@pytest.mark.parametrize("rows", [7, 100, 1000])
def test_the_capacity_runs_zipf_sampler_follows_the_law(rows: int, exponent: float) -> None:
    # (its own inverse-CDF sampler: torch.multinomial, under shardvar.workloads.zipf_ids, stops at 2**24 rows)
    sys.path.insert(0, str(BENCHMARKS))
    import _capacity
    import torch

    ids, order = _capacity.zipf(200_000, rows, exponent, seed=3)
    assert ids.min() >= 0 and ids.max() < rows and sorted(order.tolist()) == list(range(rows))
    pmf = torch.arange(1, rows + 1, dtype=torch.float64) ** -exponent
    pmf /= pmf.sum()
    shares = torch.bincount(ids, minlength=rows).double() / ids.numel()
    assert torch.allclose(shares[order[:5]], pmf[:5], atol=0.01)  # ``order``: the ids from the most likely down


@pytest.mark.parametrize("depth", [1, 4])
def test_the_disk_probe_reads_through_the_tables_file_and_leaves_it_open(tmp_path, depth: int) -> None:
    sys.path.insert(0, str(BENCHMARKS))
    import _tiered_child
    import torch

    from shardvar.tiered import RecordLayout, RowFile

    layout = RecordLayout(4096, 8, "float32", 1)
    with RowFile.create(
        tmp_path / "t.rows", layout, lambda ids: (ids[:, None].float().expand(-1, 8), ids[:, None].float())
    ) as file:
        got = _tiered_child.probe(file, 64, depth, seed=0)
        assert got["queue_depth"] == depth and 0 < got["reads"] <= 64 and got["reads_per_s"] > 0
        assert got["disk_bytes_per_read"] >= 0
        values, _ = layout.split(file.read(torch.tensor([5, 4000])))  # the table's file is still open and whole
        assert values[:, 0].tolist() == [5.0, 4000.0]


@pytest.mark.parametrize(("root", "enabled", "why"), [(False, True, "needs root"), (True, False, "--no-cgroup")])
def test_the_capacity_run_skips_its_cap_with_a_message(monkeypatch, capsys, root, enabled, why) -> None:
    sys.path.insert(0, str(BENCHMARKS))
    import _capacity

    monkeypatch.setattr(_capacity.os, "geteuid", lambda: 0 if root else 1000)
    with _capacity.capped(1 << 30, enabled) as group:
        assert group is None
    assert why in capsys.readouterr().out
