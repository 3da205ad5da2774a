"""shardvar.tf reads TensorFlow's own checkpoints (written by tests/data/tf/make_checkpoints.py) as TF does."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import shardvar.tf
from shardvar import CheckpointError
from shardvar.tf import TFCheckpoint, _reader, list_variables, load_variable
from shardvar.tf._slices import _signed, slice_key
from tf_bundle import write_bundle

DATA = Path(__file__).parent / "data" / "tf"
KINDS = ["saver_v1", "checkpoint_v2_adam", "checkpoint_v2_adagrad", "dtypes_v2"]


def _equal(tensor: torch.Tensor, expected: np.ndarray) -> bool:
    if tensor.dtype == torch.bfloat16:  # numpy has no bfloat16: compare the bits
        return tensor.view(torch.int16).numpy().tobytes() == expected.tobytes()
    return tensor.numpy().dtype == expected.dtype and np.array_equal(tensor.numpy(), expected)


@pytest.mark.parametrize("kind", KINDS)
def test_every_variable_loads_as_tensorflow_reads_it(kind: str) -> None:
    expected = np.load(DATA / kind / "expected.npz")
    listed = dict(list_variables(DATA / kind))
    for name in expected.files:
        value = load_variable(DATA / kind, name)
        assert listed[name] == list(expected[name].shape) == list(value.shape), name
        assert _equal(value, expected[name]), name
    # what TensorFlow lists but cannot give as numbers: the object graph and string variables
    assert {n for n in listed if n not in expected.files} <= {
        "_CHECKPOINTABLE_OBJECT_GRAPH",
        "model/text/.ATTRIBUTES/VARIABLE_VALUE",
    }


def test_partitioned_variables_are_listed_once_with_their_full_shape() -> None:
    listed = dict(list_variables(DATA / "saver_v1"))
    assert listed["emb"] == [10, 4] and listed["big"] == [13, 3] and listed["cols"] == [5, 6]
    reader = TFCheckpoint(DATA / "saver_v1")
    assert [p.lengths for p in reader.variable("emb").pieces] == [(4, 4), (3, 4), (3, 4)]  # fixed_size_partitioner(3)
    assert [p.lengths for p in reader.variable("big").pieces] == [(4, 3), (3, 3), (3, 3), (3, 3)]
    assert [p.offsets for p in reader.variable("cols").pieces] == [(0, 0), (0, 3)]  # split on axis 1
    assert reader.bundle.num_shards == 4  # a sharded Saver: one data file per device, and the header's
    cols = np.load(DATA / "saver_v1" / "expected.npz")["cols"]
    got = reader.read_rows(reader.variable("cols"), 1, 5, 2)  # strided rows of column slices (a mod target shard)
    assert np.array_equal(got.numpy(), cols[1:5:2])


def test_sharded_variable_and_short_names() -> None:
    ckpt = DATA / "checkpoint_v2_adam"
    full = load_variable(ckpt, "model/emb/.ATTRIBUTES/VARIABLE_VALUE")
    assert torch.equal(load_variable(ckpt, "model/emb"), full)
    reader = TFCheckpoint(ckpt)
    assert [p.lengths[0] for p in reader.variable("model/emb").pieces] == [4, 3, 3]  # uneven ShardedVariable
    slots = {(s.variable, s.name): s.key for s in reader.slots()}
    assert (
        slots[("model/emb/.ATTRIBUTES/VARIABLE_VALUE", "m")]
        == "model/emb/.OPTIMIZER_SLOT/opt/m/.ATTRIBUTES/VARIABLE_VALUE"
    )
    assert len(slots) == 4


def test_paths_prefix_index_file_and_directory(tmp_path: Path) -> None:
    expected = load_variable(DATA / "saver_v1", "emb")
    for path in (DATA / "saver_v1" / "model.ckpt-3", DATA / "saver_v1" / "model.ckpt-3.index"):
        assert torch.equal(load_variable(path, "emb"), expected)
    # a moved directory whose state file still names the old absolute path
    moved = tmp_path / "moved"
    shutil.copytree(DATA / "saver_v1", moved)
    (moved / "checkpoint").write_text('model_checkpoint_path: "/gone/away/model.ckpt-3"\n')
    assert torch.equal(load_variable(moved, "emb"), expected)
    with pytest.raises(CheckpointError, match="without a 'checkpoint' state file"):
        list_variables(tmp_path)
    with pytest.raises(CheckpointError, match="does not exist"):
        list_variables(tmp_path / "nothing")


def test_every_dtype_and_strings_refused() -> None:
    ckpt = DATA / "dtypes_v2"
    dtypes = {n: load_variable(ckpt, f"model/{n}").dtype for n in ("f64", "bf16", "flag", "int8", "uint16", "uint64")}
    assert dtypes == {
        "f64": torch.float64, "bf16": torch.bfloat16, "flag": torch.bool,
        "int8": torch.int8, "uint16": torch.uint16, "uint64": torch.uint64,
    }  # fmt: skip
    assert load_variable(ckpt, "model/uint64")[-1].item() == 2**64 - 1
    with pytest.raises(CheckpointError, match=r"model/text.*string"):
        load_variable(ckpt, "model/text")
    with pytest.raises(CheckpointError, match=r"no variable 'model/flags'.*close"):
        load_variable(ckpt, "model/flags")


def test_test_writer_agrees_with_tensorflow(tmp_path: Path) -> None:
    """The spec-based writer other tests use makes what TensorFlow makes for the same variable."""
    emb = np.load(DATA / "saver_v1" / "expected.npz")["emb"]
    write_bundle(tmp_path / "ck", {"emb": emb}, {"emb": [4, 3, 3]})
    ours, theirs = TFCheckpoint(tmp_path / "ck").variable("emb"), TFCheckpoint(DATA / "saver_v1").variable("emb")
    assert [p.key for p in ours.pieces] == [p.key for p in theirs.pieces]
    assert [p.entry.crc32c for p in ours.pieces] == [p.entry.crc32c for p in theirs.pieces]
    assert torch.equal(load_variable(tmp_path / "ck", "emb"), torch.from_numpy(emb))


@given(st.integers(-(2**63), 2**63 - 1), st.integers(-(2**63), 2**63 - 1))
def test_slice_key_numbers_sort_as_the_numbers(a: int, b: int) -> None:
    """OrderedCode's signed encoding is order-preserving and prefix-free (what TensorFlow's table relies on)."""
    assert (_signed(a) < _signed(b)) == (a < b)
    assert len(_signed(a)) == ((~a if a < 0 else a).bit_length() // 7 + 1)


def test_slice_key_escapes_special_bytes() -> None:
    assert slice_key("a\x00b\xff", []) == b"\x00a\x00\xffb\xc3\xbf\x00\x01\x00"  # a name's UTF-8 bytes, 0 escaped
    key = slice_key("e", [(0, 4), (0, -1)])
    assert key == b"\x00e\x00\x01\x01\x02\x80\x84\x80\x7f"


def test_import_shardvar_reaches_tf_without_loading_protobuf() -> None:
    """``import shardvar`` then ``shardvar.tf.list_variables``: protobuf is loaded on that first use, not before."""
    script = (
        "import sys, shardvar\n"
        "assert 'google.protobuf' not in sys.modules and 'shardvar.tf' not in sys.modules, sorted(sys.modules)\n"
        "assert 'tf' in dir(shardvar)\n"
        f"names = shardvar.tf.list_variables({str(DATA / 'saver_v1')!r})\n"
        "assert ('emb', [10, 4]) in names and 'google.protobuf' in sys.modules, names\n"
        "assert shardvar.tf is sys.modules['shardvar.tf']\n"
        "try:\n    shardvar.no_such_name\nexcept AttributeError as e:\n    assert 'no_such_name' in str(e)\n"
        "else:\n    raise SystemExit('an unknown attribute resolved')\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def test_public_names() -> None:
    assert set(shardvar.tf.__all__) == {
        *("Conversion", "TFCheckpoint", "convert", "list_variables", "load_variable", "short_name", "slice_spec"),
    }
    assert all(hasattr(shardvar.tf, name) for name in shardvar.tf.__all__)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data())
def test_read_rows_equals_numpy_slicing(tmp_path_factory: pytest.TempPathFactory, data: st.DataObject) -> None:
    """Any rows start:stop:step of a variable in any row slices, read in chunks of any size, equal numpy's."""
    rows = data.draw(st.integers(0, 40))
    cols = data.draw(st.integers(0, 5))
    cuts = sorted(data.draw(st.lists(st.integers(0, rows), max_size=4)))
    sizes = [b - a for a, b in zip([0, *cuts], [*cuts, rows], strict=True)]
    table = np.arange(rows * cols, dtype=np.int64).reshape(rows, cols)
    prefix = tmp_path_factory.mktemp("rows") / "ck"
    write_bundle(prefix, {"t": table}, {"t": sizes})
    start = data.draw(st.integers(0, rows))
    stop = data.draw(st.integers(start, rows))
    step = data.draw(st.integers(1, 5))
    reader = TFCheckpoint(prefix)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(_reader, "CHUNK_BYTES", data.draw(st.integers(1, 200)))
        got = reader.read_rows(reader.variable("t"), start, stop, step)
        reader.verify(reader.variable("t"))
    assert np.array_equal(got.numpy(), table[start:stop:step])
    assert {p.key for p in reader.variable("t").pieces} == reader._verified  # every byte crc-checked
