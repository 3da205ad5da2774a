"""Damaged TensorFlow checkpoints are refused with a CheckpointError naming the file and the key."""

from __future__ import annotations

import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardvar import CheckpointError
from shardvar.tf import TFCheckpoint, convert, list_variables, load_variable
from shardvar.tf._proto import BundleEntryProto, BundleHeaderProto
from shardvar.tf._slices import slice_key
from shardvar.tf._table import TableError, read_table
from tf_bundle import table_bytes, write_bundle, write_table

DATA = Path(__file__).parent / "data" / "tf"


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    shutil.copytree(DATA / "saver_v1", tmp_path / "ck")
    return tmp_path / "ck" / "model.ckpt-3"


def _read_all(prefix: Path) -> None:
    reader = TFCheckpoint(prefix)
    for name, v in reader.variables.items():
        if v.dtype_name != "string":
            reader.load(name)


def test_a_flipped_data_byte_fails_the_crc_of_its_tensor(ckpt: Path) -> None:
    data = Path(f"{ckpt}.data-00001-of-00004")  # emb and its slots
    raw = bytearray(data.read_bytes())
    raw[70] ^= 0x10
    data.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match=r"rows \d+:\d+ of 'emb' \(slice [\d,:]+\).*crc32c.*data-00001-of-00004"):
        load_variable(ckpt, "emb")
    assert load_variable(ckpt, "big").shape == (13, 3)  # other files are sound


def test_truncated_or_missing_files(ckpt: Path) -> None:
    index = Path(f"{ckpt}.index")
    whole = index.read_bytes()
    for size in (0, 10, 47, len(whole) // 2, len(whole) - 1):
        index.write_bytes(whole[:size])
        with pytest.raises(CheckpointError, match=str(index)):
            list_variables(ckpt)
    index.write_bytes(whole)
    data = Path(f"{ckpt}.data-00002-of-00004")
    data.write_bytes(data.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=r"'big'.*ends at byte \d+ of .*data-00002-of-00004"):
        load_variable(ckpt, "big")
    data.unlink()
    with pytest.raises(CheckpointError, match="data-00002-of-00004, which is missing"):
        load_variable(ckpt, "big")
    with pytest.raises(CheckpointError, match="data-00002-of-00004, which is missing"):
        convert(ckpt, ckpt.parent / "out", {"big": "b"})
    assert not (ckpt.parent / "out").exists()


def _rewrite(prefix: Path, change: dict[bytes, bytes | None]) -> None:
    """Rewrite the index with some entries replaced (None: removed)."""
    index = Path(f"{prefix}.index")
    items = read_table(index.read_bytes(), str(index))
    for key, value in change.items():
        if value is None:
            items.pop(key)
        else:
            items[key] = value
    write_table(Path(f"{prefix}.index"), sorted(items.items()))


def _entry(prefix: Path, key: bytes) -> BundleEntryProto:
    index = Path(f"{prefix}.index")
    return BundleEntryProto.FromString(read_table(index.read_bytes(), str(index))[key])


def test_slices_must_exist_and_tile_the_variable(ckpt: Path) -> None:
    last = slice_key("emb", [(7, 3), (0, 4)])
    _rewrite(ckpt, {last: None})
    with pytest.raises(CheckpointError, match=r"rows 7:10 of 'emb' \(slice 7,3:0,4\) is missing"):
        list_variables(ckpt)
    full = _entry(ckpt, b"big")
    full.slices[1].extent[0].start = 3  # overlaps the first slice, leaves row 6 uncovered
    _rewrite(ckpt, {last: _entry(DATA / "saver_v1" / "model.ckpt-3", last).SerializeToString(),
                    b"big": full.SerializeToString(),
                    slice_key("big", [(3, 3), (0, 3)]): _entry(ckpt, slice_key("big", [(4, 3), (0, 3)])).SerializeToString()})  # fmt: skip
    with pytest.raises(CheckpointError, match=r"slices of 'big' .* do not cover \[13, 3\] exactly"):
        load_variable(ckpt, "big")


def test_absurd_shapes_and_handles(ckpt: Path) -> None:
    entry = _entry(ckpt, b"counts")
    entry.shape.dim[0].size = 1 << 60
    _rewrite(ckpt, {b"counts": entry.SerializeToString()})
    with pytest.raises(CheckpointError, match=r"'counts'.*holds 24 bytes; its dtype and shape need"):
        load_variable(ckpt, "counts")
    entry.shape.dim[0].size = -3
    _rewrite(ckpt, {b"counts": entry.SerializeToString()})
    with pytest.raises(CheckpointError, match=r"'counts'.*absurd shape \[-3\]"):
        list_variables(ckpt)
    entry.shape.dim[0].size, entry.shard_id = 3, 9
    _rewrite(ckpt, {b"counts": entry.SerializeToString()})
    with pytest.raises(CheckpointError, match="points at data file 9"):
        load_variable(ckpt, "counts")
    entry.shard_id, entry.dtype = 3, 11  # qint8
    _rewrite(ckpt, {b"counts": entry.SerializeToString()})
    with pytest.raises(CheckpointError, match=r"'counts'.*qint8"):
        load_variable(ckpt, "counts")


def test_bad_block_handle_and_block_crc(tmp_path: Path) -> None:
    write_bundle(tmp_path / "ck", {"a": np.arange(3, dtype=np.int64)})
    index = tmp_path / "ck.index"
    raw = bytearray(index.read_bytes())
    footer = raw[-48:]
    bad = raw[:-48] + bytes([0x80 | 0x7F] * 3 + [0x01]) + bytes(footer[4:])  # metaindex offset past the end
    index.write_bytes(bytes(bad[: len(raw) - 48]) + bytes(footer[:2]) + b"\xff\xff\x7f\x05" + bytes(footer[6:]))
    with pytest.raises(TableError, match="block handle"):
        list_variables(tmp_path / "ck")
    raw[5] ^= 1  # inside the first data block
    index.write_bytes(bytes(raw))
    with pytest.raises(TableError, match="crc32c"):
        list_variables(tmp_path / "ck")
    index.write_bytes(bytes(raw[:-8]) + struct.pack("<Q", 12345))
    with pytest.raises(TableError, match="magic"):
        list_variables(tmp_path / "ck")


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data())
def test_fuzz_damaged_index_and_data(tmp_path_factory: pytest.TempPathFactory, data: st.DataObject) -> None:
    """Any damage to a real checkpoint's files gives CheckpointError or the right values, never another error."""
    directory = tmp_path_factory.mktemp("fuzz")
    shutil.copytree(DATA / "saver_v1", directory, dirs_exist_ok=True)
    name = data.draw(st.sampled_from(["model.ckpt-3.index", "model.ckpt-3.data-00001-of-00004"]))
    path = directory / name
    raw = bytearray(path.read_bytes())
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(0, len(raw) - 1))
        raw[at] = data.draw(st.integers(0, 255))
    if data.draw(st.booleans()):
        raw = raw[: data.draw(st.integers(0, len(raw)))]
    path.write_bytes(bytes(raw))
    try:
        _read_all(directory / "model.ckpt-3")
    except CheckpointError as e:
        assert "\x00" not in str(e) and "\\x00" not in str(e)  # a slice is named, never its encoded key
        return
    expected = np.load(DATA / "saver_v1" / "expected.npz")
    for key in expected.files:  # undamaged in effect (a changed byte set back, or the crc's own padding)
        assert np.array_equal(load_variable(directory, key).numpy(), expected[key])


@settings(max_examples=80, deadline=None)
@given(st.lists(st.binary(min_size=1, max_size=12), min_size=1, max_size=30, unique=True), st.data())
def test_fuzz_table_blocks_past_their_checksums(keys: list[bytes], data: st.DataObject) -> None:
    """Damage inside blocks whose crc is recomputed reaches the entry parser: TableError or the table, nothing else."""
    items = sorted((k, k[::-1]) for k in keys)

    def mutate(block: bytes) -> bytes:
        raw = bytearray(block)
        for _ in range(data.draw(st.integers(0, 3))):
            if raw:
                raw[data.draw(st.integers(0, len(raw) - 1))] = data.draw(st.integers(0, 255))
        return bytes(raw[: data.draw(st.integers(0, len(raw)))] if data.draw(st.booleans()) else raw)

    try:
        table = read_table(table_bytes(items, data.draw(st.integers(1, 9)), mutate), "fuzz.index")
    except TableError:
        return
    assert all(isinstance(k, bytes) and isinstance(v, bytes) for k, v in table.items())
    assert list(table) == sorted(table)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.binary(max_size=64))
def test_fuzz_entry_records(tmp_path_factory: pytest.TempPathFactory, record: bytes) -> None:
    """Any bytes as a tensor's BundleEntryProto: a CheckpointError naming it, or a tensor, nothing else."""
    prefix = tmp_path_factory.mktemp("entry") / "ck"
    Path(f"{prefix}.data-00000-of-00001").write_bytes(bytes(range(256)))
    header = BundleHeaderProto(num_shards=1).SerializeToString()
    write_table(Path(f"{prefix}.index"), [(b"", header), (b"x", record)])
    try:
        value = load_variable(prefix, "x")
    except CheckpointError:
        return
    entry = BundleEntryProto.FromString(record)  # it loaded: it said where its bytes are, and their crc held
    assert value.numel() * value.element_size() == entry.size
