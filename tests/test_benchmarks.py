"""The benchmark scripts run (in their quick form): they are run by hand for figures, and must not rot."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).parent.parent / "benchmarks"


@pytest.mark.parametrize("script", ["bench_checkpoint_production.py"])
def test_benchmark_runs_quick(script: str) -> None:
    out = subprocess.run(
        [sys.executable, str(BENCHMARKS / script), "--quick"], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    assert "async blocked / sync" in out.stdout and "delta size / full size" in out.stdout
