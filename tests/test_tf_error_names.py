"""Every error about a slice of a TensorFlow variable names the variable and the slice's rows, never its encoded key."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shardvar import CheckpointError
from shardvar.tf import TFCheckpoint, convert, list_variables, load_variable
from shardvar.tf._proto import BundleEntryProto
from shardvar.tf._slices import describe_key, parse_slice_key, slice_key
from shardvar.tf._table import TableError, read_table
from tf_bundle import table_bytes, write_table

DATA = Path(__file__).parent / "data" / "tf"
SLICE = slice_key("emb", [(4, 3), (0, 4)])  # rows 4:7 of emb, in data file 1 with the other slices
NAMED = r"rows 4:7 of 'emb' \(slice 4,3:0,4\)"


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    shutil.copytree(DATA / "saver_v1", tmp_path / "ck")
    return tmp_path / "ck" / "model.ckpt-3"


def _index(prefix: Path) -> dict[bytes, bytes]:
    path = Path(f"{prefix}.index")
    return read_table(path.read_bytes(), str(path))


def _set_entry(prefix: Path, key: bytes, change: Callable[[BundleEntryProto], None] | bytes) -> None:
    items = _index(prefix)
    if isinstance(change, bytes):
        items[key] = change
    else:
        entry = BundleEntryProto.FromString(items[key])
        change(entry)
        items[key] = entry.SerializeToString()
    write_table(Path(f"{prefix}.index"), sorted(items.items()))


def _flip_slice_byte(prefix: Path) -> None:
    entry = BundleEntryProto.FromString(_index(prefix)[SLICE])
    data = Path(f"{prefix}.data-{entry.shard_id:05d}-of-00004")
    raw = bytearray(data.read_bytes())
    raw[entry.offset + 5] ^= 0x10
    data.write_bytes(bytes(raw))


def _truncate_slice_file(prefix: Path) -> None:
    entry = BundleEntryProto.FromString(_index(prefix)[SLICE])
    data = Path(f"{prefix}.data-{entry.shard_id:05d}-of-00004")
    data.write_bytes(data.read_bytes()[: entry.offset + 3])


def _verify_after_a_partial_read(prefix: Path) -> None:
    reader = TFCheckpoint(prefix)
    v = reader.variable("emb")
    reader.read_rows(v, 0, 1)  # the damaged slice is not read: verify() reads and checks it
    reader.verify(v)


DAMAGE: dict[str, tuple[Callable[[Path], None], Callable[[Path], object], str]] = {
    "crc, load_variable": (_flip_slice_byte, lambda p: load_variable(p, "emb"), "fails its crc32c check"),
    "crc, verify": (_flip_slice_byte, _verify_after_a_partial_read, "fails its crc32c check"),
    "crc, convert div": (_flip_slice_byte, lambda p: convert(p, p.parent / "o", {"emb": "e"}, partitioner=2), "crc32c"),
    "crc, convert mod": (
        _flip_slice_byte,
        lambda p: convert(p, p.parent / "o", {"emb": "e"}, partitioner=3, partition_strategy="mod"),
        "crc32c",
    ),
    "truncated data file": (_truncate_slice_file, lambda p: load_variable(p, "emb"), "ends at byte"),
    "entry not a record": (
        lambda p: _set_entry(p, SLICE, b"\xff\xff\xff"),
        list_variables,
        "is not a valid BundleEntryProto",
    ),
    "entry of another dtype": (
        lambda p: _set_entry(p, SLICE, lambda e: setattr(e, "dtype", 2)),
        lambda p: load_variable(p, "emb"),
        "another dtype or shape",
    ),
    "entry of another size": (
        lambda p: _set_entry(p, SLICE, lambda e: setattr(e, "size", e.size - 4)),
        lambda p: load_variable(p, "emb"),
        "holds 44 bytes",
    ),
    "entry in another data file": (
        lambda p: _set_entry(p, SLICE, lambda e: setattr(e, "shard_id", 7)),
        lambda p: load_variable(p, "emb"),
        "points at data file 7",
    ),
    "entry missing": (
        lambda p: write_table(Path(f"{p}.index"), sorted((k, v) for k, v in _index(p).items() if k != SLICE)),
        list_variables,
        "is missing from",
    ),
}


@pytest.mark.parametrize("case", sorted(DAMAGE))
def test_errors_about_a_slice_name_its_variable_and_rows(ckpt: Path, case: str) -> None:
    damage, read, says = DAMAGE[case]
    damage(ckpt)
    with pytest.raises(CheckpointError, match=f"{NAMED}.*{says}|{says}.*{NAMED}") as raised:
        read(ckpt)
    assert "\\x00" not in str(raised.value) and "\x00" not in str(raised.value)


def test_a_table_whose_slice_keys_are_out_of_order_names_the_slice() -> None:
    items = [(slice_key("emb", [(4, 3), (0, 4)]), b""), (slice_key("emb", [(0, 4), (0, 4)]), b"")]
    with pytest.raises(TableError, match=r"out of order at rows 0:4 of 'emb' \(slice 0,4:0,4\)$"):
        read_table(table_bytes(items), "t.index")


names = st.text(st.characters(codec="utf-8"), max_size=12)
extents = st.lists(st.tuples(st.integers(-(2**63), 2**63 - 1), st.integers(-(2**63), 2**63 - 1)), max_size=5)


@given(names, extents)
def test_slice_keys_parse_back(name: str, axes: list[tuple[int, int]]) -> None:
    assert parse_slice_key(slice_key(name, axes)) == (name, axes)
    assert "\x00" not in describe_key(slice_key(name, axes)).replace(name, "")


@given(st.binary(max_size=40))
def test_any_bytes_parse_as_the_key_that_makes_them_or_not_at_all(key: bytes) -> None:
    parsed = parse_slice_key(b"\x00" + key)
    assert parsed is None or slice_key(*parsed) == b"\x00" + key
    assert "\x00" not in describe_key(b"\x00" + key) or parsed is not None
