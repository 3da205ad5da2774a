"""``shardvar inspect`` of a tiered table's backing file: what it is and in which state, never a traceback."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import shardvar
from shardvar import optim
from shardvar.cli import main
from shardvar.tiered import RecordLayout, RowFile, describe
from shardvar.tiered._header import MAGIC, write_header


def _table(path, rows=300, dim=8):
    torch.manual_seed(0)
    storage = shardvar.Tiered(path, cache_bytes=4000)
    table = shardvar.ShardedEmbeddingBag(rows, dim, mode="sum", sparse=True, storage=storage)
    optim.fuse(optim.RowWiseAdam(table, lr=0.1))  # records of 8 values and 1 + 8 state values
    return table


def _fields(out: str) -> dict[str, str]:
    return {line.split()[0]: " ".join(line.split()[1:]) for line in out.splitlines()[3:] if line.strip()}


def test_inspect_describes_a_backing_file_in_use_then_closed(tmp_path, capsys) -> None:
    table = _table(tmp_path / "t.rows")
    assert main(["inspect", str(tmp_path / "t.rows")]) == 0
    out = capsys.readouterr().out
    fields = _fields(out)
    assert "backing file" in out.splitlines()[0]
    assert (fields["rows"], fields["dim"], fields["dtype"]) == ("300", "8", "float32")
    assert fields["record"].startswith("72 bytes: 32 of values") and fields["state"].startswith("9 float32 per row")
    assert fields["status"].startswith("in use")
    table.close()
    assert main(["inspect", str(tmp_path / "t.rows")]) == 0
    assert _fields(capsys.readouterr().out)["status"].startswith("closed cleanly")
    run = subprocess.run([sys.executable, "-m", "shardvar", "inspect", str(tmp_path / "t.rows")], capture_output=True)
    assert run.returncode == 0 and run.stderr == b""  # the program, in a pipe


@pytest.mark.parametrize("case", ["unclean", "truncated", "partial load"])
def test_inspect_says_what_is_wrong_with_a_backing_file(tmp_path, capsys, case) -> None:
    path = tmp_path / ("t.rows.loading" if case == "partial load" else "t.rows")
    layout = RecordLayout(20, 4, "float32", 1)
    RowFile.create(path, layout, lambda ids: (torch.zeros(ids.numel(), 4), torch.zeros(ids.numel(), 1))).close()
    fd = os.open(path, os.O_RDWR)
    if case == "unclean":
        write_header(fd, layout, clean=False)  # as a killed process leaves it
    elif case == "truncated":
        os.truncate(fd, os.fstat(fd).st_size - 5)
    os.close(fd)
    before = path.read_bytes()
    assert main(["inspect", str(path)]) == 0
    status = _fields(capsys.readouterr().out)["status"]
    expected = {"unclean": "not closed cleanly", "truncated": "truncated: 4571 bytes", "partial load": "incomplete"}
    assert status.startswith(expected[case])
    assert path.read_bytes() == before  # inspect changes nothing
    assert not describe(path).in_use


HEADER_FIELDS = {"rows": 20, "dim": 4, "dtype": "float32", "state_width": 1, "record_bytes": 24, "clean": True}


@settings(max_examples=60, deadline=None)
@given(
    field=st.sampled_from(sorted(HEADER_FIELDS)),
    value=st.one_of(st.none(), st.integers(-(2**70), 2**70), st.text(max_size=8), st.booleans(), st.lists(st.none())),
    drop=st.booleans(),
)
def test_a_damaged_header_is_one_line_never_a_traceback(tmp_path_factory, field, value, drop) -> None:
    path = tmp_path_factory.mktemp("hdr") / "t.rows"
    meta = dict(HEADER_FIELDS)
    if drop:
        del meta[field]
    else:
        meta[field] = value
    path.write_bytes((MAGIC + json.dumps(meta).encode()).ljust(4096 + 20 * 24, b" "))
    try:
        code = main(["inspect", str(path)])
    except SystemExit as e:
        assert str(e.code).startswith("shardvar inspect: backing file") and "damaged header" in str(e.code)
    else:
        assert code == 0 and describe(path).layout.rows >= 0
