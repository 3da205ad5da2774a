"""Shared test helpers: where the conformance cases live."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# the atheris targets run by hand (see tests/fuzz/fuzz_manifest.py); data/tf/make_checkpoints.py needs TensorFlow
collect_ignore = ["fuzz", "data"]
CONFORMANCE = ROOT.parent / "shared" / "conformance"
ERRORS = {"ValueError": ValueError, "TypeError": TypeError, "IndexError": IndexError}


def conformance_cases(name: str, keep=lambda case: True) -> list:
    """The reference cases in ``../shared/conformance/<name>`` as pytest params, one per case.

    When that folder is absent the list holds one skipped param that says so.
    """
    path = CONFORMANCE / name
    if not path.is_file():
        return [pytest.param(None, marks=pytest.mark.skip(reason=f"conformance cases not found: {path} is absent"))]
    cases = json.loads(path.read_text())
    return [pytest.param(c, id=f"{name.removesuffix('.json')}-{i}") for i, c in enumerate(cases) if keep(c)]


@pytest.fixture
def one_rank():
    """A default process group of one rank (gloo, in this process), removed afterwards."""
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture
def unmapped_files(monkeypatch):
    """Backing files read and written by system calls only, never through a mapping (``tiered/_mapped.py``): a test
    of what reading ahead or the log does (a file the page cache holds is not read ahead, and its rows go back to
    their own places) would otherwise depend on whether the kernel kept the file's pages."""
    monkeypatch.setenv("SHARDVAR_MAP_FILES", "0")
