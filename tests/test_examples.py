"""The examples run as documented."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from conftest import ROOT
from distributed import free_port


def test_recsys_example_trains_under_torchrun(tmp_path) -> None:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
        str(ROOT / "examples" / "recsys_ddp.py"), "--steps", "60", "--users", "3000", "--items", "800",
        "--save", str(tmp_path / "ck"),
    ]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    first, last = map(float, re.search(r"loss (\d\.\d+) -> (\d\.\d+)", out.stdout).groups())
    assert last < first, out.stdout
    assert "rank 0 holds" in out.stdout and (tmp_path / "ck" / "manifest.json").exists()
