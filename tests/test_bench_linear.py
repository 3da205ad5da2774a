"""benchmarks/bench_linear.py runs (--quick) and reports every candidate against nn.Linear."""

from __future__ import annotations

import importlib.util

from conftest import ROOT


def test_bench_linear_quick_reports_ratios(capsys) -> None:
    spec = importlib.util.spec_from_file_location("bench_linear", ROOT / "benchmarks" / "bench_linear.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    bench.main(["--quick"])  # also checks that every candidate's output equals nn.Linear's
    out = capsys.readouterr().out
    for name in ("ShardedLinear mod, separate shards", "shard_parameter axis 1"):
        assert out.count(name) == 2, out  # forward, and forward+backward
    assert "1.00x" in out
