"""Coverage-guided fuzz target for the checkpoint loader (atheris); not run by CI.

    pip install atheris
    python tests/fuzz/fuzz_manifest.py -atheris_runs=100000

Each input replaces a valid checkpoint's manifest (re-signed half of the time, so the schema
validation is reached past the checksum); the loader must load the right values or raise
CheckpointError, nothing else.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import atheris

with atheris.instrument_imports():
    import torch

    import shardvar
    from shardvar.checkpoint._manifest import _checksum

ROOT = Path(tempfile.mkdtemp(prefix="shardvar-fuzz-"))
shardvar.save({"t": shardvar.shard_tensor(torch.arange(12.0).reshape(6, 2), shardvar.Layout.mod(6, 2))}, ROOT)
ORIGINAL = (ROOT / "manifest.json").read_bytes()


def one_input(data: bytes) -> None:
    fdp = atheris.FuzzedDataProvider(data)
    raw = fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 1 << 16))
    if fdp.ConsumeBool():
        try:
            manifest = json.loads(raw)
            if isinstance(manifest, dict):
                manifest["checksum"] = _checksum({k: v for k, v in manifest.items() if k != "checksum"})
                raw = json.dumps(manifest).encode()
        except (ValueError, RecursionError, TypeError):
            pass
    (ROOT / "manifest.json").write_bytes(raw)
    target = shardvar.shard_tensor(torch.zeros(6, 2), shardvar.Layout.div(6, 3))
    try:
        shardvar.load({"t": target}, ROOT)
    except shardvar.CheckpointError:
        return
    assert torch.equal(target.to_tensor(), torch.arange(12.0).reshape(6, 2))


if __name__ == "__main__":
    atheris.Setup(sys.argv, one_input)
    atheris.Fuzz()
