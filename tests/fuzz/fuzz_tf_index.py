"""Coverage-guided fuzz target for the TensorFlow checkpoint reader (atheris); not run by CI.

    pip install atheris
    python tests/fuzz/fuzz_tf_index.py -atheris_runs=100000

Each input replaces the ``.index`` of a real TensorFlow checkpoint (tests/data/tf/saver_v1); the
reader must list and load the right values or raise CheckpointError, nothing else.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

import atheris

with atheris.instrument_imports():
    import shardvar.tf
    from shardvar import CheckpointError

ROOT = Path(tempfile.mkdtemp(prefix="shardvar-fuzz-tf-"))
shutil.copytree(Path(__file__).parent.parent / "data" / "tf" / "saver_v1", ROOT, dirs_exist_ok=True)
PREFIX = ROOT / "model.ckpt-3"


def test_one_input(data: bytes) -> None:
    Path(f"{PREFIX}.index").write_bytes(data)
    try:
        for name, _ in shardvar.tf.list_variables(PREFIX):
            shardvar.tf.load_variable(PREFIX, name)
    except CheckpointError:
        pass


if __name__ == "__main__":
    atheris.Setup(sys.argv, test_one_input)
    atheris.Fuzz()
