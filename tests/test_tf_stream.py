"""``convert``'s one pass per table: every shard fed from one sequential read, read ahead in a thread."""

from __future__ import annotations

import io
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import shardvar
import shardvar.checkpoint._safetensors as safetensors
import shardvar.tf._stream as stream
from shardvar import CheckpointError
from shardvar.checkpoint._safetensors import FileWriter
from shardvar.tf import TFCheckpoint, convert
from tf_bundle import write_bundle


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data())
def test_every_shard_of_one_pass_equals_numpy(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch, data: st.DataObject
) -> None:
    """Any table in any row slices, into div or mod shards, read and checksummed in chunks of any size."""
    rows, cols = data.draw(st.integers(0, 60)), data.draw(st.integers(1, 4))
    cuts = sorted(data.draw(st.lists(st.integers(0, rows), max_size=3)))
    sizes = [b - a for a, b in zip([0, *cuts], [*cuts, rows], strict=True)]
    table = np.arange(rows * cols, dtype=np.int32).reshape(rows, cols)
    root = tmp_path_factory.mktemp("pass")
    write_bundle(root / "ck", {"t": table}, {"t": sizes})
    row_bytes = cols * 4
    monkeypatch.setattr(stream, "CHUNK_BYTES", row_bytes * data.draw(st.integers(1, 9)))  # read chunks
    monkeypatch.setattr(safetensors, "CHUNK_BYTES", row_bytes * data.draw(st.integers(1, 7)))  # checksum chunks
    n, strategy = data.draw(st.integers(1, 6)), data.draw(st.sampled_from(["div", "mod"]))
    convert(root / "ck", root / "out", {"t": "t"}, partitioner=n, partition_strategy=strategy)
    layout = shardvar.Layout.balanced(strategy, rows, min(n, max(rows, 1)))
    assert shardvar.checkpoint.Manifest.read(root / "out").variables["t"].layout == layout
    for s in range(layout.num_shards):
        start, step, count = layout.shard_progression(s)
        got = shardvar.checkpoint.read_shard(root / "out", "t", layout, s)  # checks every chunk's checksum
        np.testing.assert_array_equal(got.numpy(), table[start : start + step * count : step])


def _header() -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    return [("a", (7, 3), torch.float32), ("b", (5, 3), torch.float32), ("c", (0, 3), torch.float32)]


def test_streamed_pieces_write_the_same_file_as_whole_tensors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(safetensors, "CHUNK_BYTES", 2 * 12)  # two rows a checksum chunk: pieces straddle them
    a, b = torch.randn(7, 3), torch.randn(5, 3)
    whole = io.BytesIO()
    plain = FileWriter(whole, _header())
    expected = [plain.write("a", a), plain.write("b", b), plain.write("c", torch.empty(0, 3))]
    done: list[int] = []
    with open(tmp_path / "f", "w+b") as f:
        w = FileWriter(f, _header())
        pieces = [(0, 0, a[:3]), (1, 0, b[:1]), (0, 3, a[3:4]), (1, 1, b[1:]), (0, 4, a[4:])]
        got = w.write_stream(["a", "b", "c"], pieces, done.append)
        w.close()
    assert got == expected and sum(done) == (7 + 5) * 12
    assert (tmp_path / "f").read_bytes() == whole.getvalue()


@pytest.mark.parametrize(
    "pieces",
    [
        [(0, 1, torch.zeros(2, 3))],
        [(0, 0, torch.zeros(2, 2))],
        [(0, 0, torch.zeros(8, 3))],
        [(0, 0, torch.zeros(6, 3))],
    ],
    ids=["out of order", "other width", "too many rows", "too few rows"],
)
def test_a_piece_that_does_not_come_next_is_refused(tmp_path: Path, pieces: list) -> None:
    with open(tmp_path / "f", "w+b") as f:
        w = FileWriter(f, _header()[:1])
        with pytest.raises(ValueError, match="'a'"):
            w.write_stream(["a"], pieces, lambda n: None)


def test_reading_stays_at_most_two_chunks_ahead_and_stops_when_closed() -> None:
    filled: list[int] = []
    buffers = [torch.empty(1) for _ in range(stream.AHEAD + 1)]

    def fill(job: object, buffer: torch.Tensor) -> torch.Tensor:
        filled.append(job)  # type: ignore[arg-type]
        return buffer

    it = stream.ahead(fill, range(100), buffers)
    assert next(it)[0] == 0
    for _ in range(200):  # up to 10 s on a busy machine for the thread to fill the other two buffers
        if len(filled) == 3:
            break
        time.sleep(0.05)
    time.sleep(0.1)
    assert filled == [0, 1, 2]  # the consumer holds one buffer: the thread fills the other two and waits
    it.close()  # type: ignore[attr-defined]
    assert len(filled) <= 4 and not any(t.name == "shardvar-tf-read" for t in threading.enumerate())


def test_an_error_while_reading_ahead_is_raised_by_the_writer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stream, "CHUNK_BYTES", 8 * 16)  # chunks of 6 rows (a multiple of 3): many pieces written first
    table = np.arange(64 * 4, dtype=np.float32).reshape(64, 4)
    write_bundle(tmp_path / "ck", {"t": table}, {"t": [32, 32]})
    data = tmp_path / "ck.data-00000-of-00001"
    raw = bytearray(data.read_bytes())
    raw[-3] ^= 1  # in the second slice: found after the first chunks were written
    data.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match="crc32c"):
        convert(tmp_path / "ck", tmp_path / "out", {"t": "t"}, partitioner=3, partition_strategy="mod")
    assert not (tmp_path / "out").exists()
    assert not any(t.name == "shardvar-tf-read" for t in threading.enumerate())
    assert TFCheckpoint(tmp_path / "ck").variable("t").shape == (64, 4)


def test_a_table_written_in_one_pass_stays_in_one_data_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Files roll over between tables, never between the shards one pass feeds together."""
    monkeypatch.setattr(shardvar.checkpoint._write, "FILE_BYTES", 1000)
    tables = {"a": np.ones((40, 4), np.float32), "b": np.zeros((30, 4), np.float32)}  # 640 and 480 bytes
    write_bundle(tmp_path / "ck", tables)
    convert(tmp_path / "ck", tmp_path / "out", partitioner=3, partition_strategy="mod")
    variables = shardvar.checkpoint.Manifest.read(tmp_path / "out").variables
    files = {name: {p.file for p in v.pieces} for name, v in variables.items()}
    assert len(files["a"]) == len(files["b"]) == 1 and files["a"] != files["b"]
    for name, table in tables.items():
        np.testing.assert_array_equal(shardvar.checkpoint.read_shard(tmp_path / "out", name).numpy(), table)
