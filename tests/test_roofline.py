"""The roofline benchmark: its byte model on hand-counted inputs and by law, and the script end to end.

No timing is asserted: the figures depend on the machine; the bytes and the run's shape do not.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardvar.cli import main
from shardvar.cli._roofline import chart
from shardvar.quantized import row_format
from shardvar.workloads._roofline import (
    Traffic,
    backward_bytes,
    checkpoint_bytes,
    gather_bytes,
    scatter_bytes,
    update_bytes,
)
from shardvar.workloads._roofline_probes import disk_rate

SCRIPT = Path(__file__).parent.parent / "benchmarks" / "bench_roofline.py"
IDS = torch.tensor([0, 1, 1])  # 3 int64 ids (8 bytes each), 2 distinct
ROW = 4 * 4  # a width-4 float32 row

PATHS = [
    "large lookup",
    "scatter_add",
    "forward",
    "forward+backward (sparse)",
    "fused RowWiseAdagrad step",
    "fused RowWiseAdam step",
    "quantized bag int8",
    "quantized bag int4",
    "save",
    "restore",
]


@pytest.mark.parametrize(
    ("traffic", "expected", "total"),
    [
        (gather_bytes(IDS, ROW, 3 * ROW), Traffic(ids=24, gathered=48, written=48), 120),  # lookup
        (gather_bytes(IDS.int(), ROW, 3 * ROW), Traffic(ids=12, gathered=48, written=48), 108),  # int32 ids
        (gather_bytes(IDS, ROW, ROW, torch.tensor([0])), Traffic(ids=32, gathered=48, written=16), 96),  # one bag
        (gather_bytes(IDS, row_format(torch.quint8).row_bytes(4), ROW), Traffic(24, 36, 16), 76),  # 4 + 8 bytes a row
        (gather_bytes(IDS, row_format(torch.quint4x2).row_bytes(4), ROW), Traffic(24, 18, 16), 58),  # 2 + 4
        (backward_bytes(IDS, ROW), Traffic(gathered=48, written=32), 80),  # a gradient row per distinct id
        (backward_bytes(IDS, ROW, fused=True), Traffic(gathered=48), 48),  # straight into the update
        (update_bytes(IDS, ROW), Traffic(update=64), 64),
        (update_bytes(IDS, ROW, 4), Traffic(update=80), 80),  # row-wise Adagrad: a float per row
        (update_bytes(IDS, ROW, ROW + 4), Traffic(update=144), 144),  # row-wise Adam: a row and a float
        (scatter_bytes(IDS, ROW), Traffic(ids=24, gathered=48, update=64), 136),
        (checkpoint_bytes(1000), Traffic(disk=1000), 1000),
        (gather_bytes(IDS, ROW, ROW) + update_bytes(IDS, ROW), Traffic(24, 48, 16, 64), 152),
    ],
)
def test_the_byte_model_on_hand_counted_inputs(traffic: Traffic, expected: Traffic, total: int) -> None:
    assert traffic == expected
    assert traffic.total == total


@settings(max_examples=50, deadline=None)
@given(
    ids=st.lists(st.integers(0, 40), min_size=1, max_size=120),
    dim=st.integers(1, 96),
    state=st.integers(0, 400),
    dtype=st.sampled_from([torch.int64, torch.int32]),
)
def test_the_byte_model_counts_ids_once_rows_per_id_and_updates_per_distinct_row(
    ids: list[int], dim: int, state: int, dtype: torch.dtype
) -> None:
    t, row = torch.tensor(ids, dtype=dtype), dim * 4
    n, distinct, id_bytes = len(ids), len(set(ids)), len(ids) * dtype.itemsize
    assert gather_bytes(t, row, n * row).total == id_bytes + 2 * n * row
    assert backward_bytes(t, row).total == (n + distinct) * row
    assert update_bytes(t, row, state).total == 2 * distinct * (row + state)
    assert scatter_bytes(t, row).total == id_bytes + n * row + 2 * distinct * row
    twice = torch.cat([t, t])  # hot rows read again count again; an update still touches each row once
    assert gather_bytes(twice, row, 0).gathered == 2 * n * row
    assert update_bytes(twice, row, state) == update_bytes(t, row, state)


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--view", "roofline", "--rows", "10"], r"--rows does not apply to --view roofline"),
        (["--view", "roofline", "--no-progress"], r"--no-progress does not apply to --view roofline"),
        (["--rounds", "3", "--quick"], r"--rounds, --quick do not apply to --view ratios"),
    ],
)
def test_a_flag_the_view_would_ignore_is_refused(argv: list[str], match: str, capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["bench", *argv])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "Traceback" not in err
    assert re.search(match, err), err


def test_the_chart_says_what_it_needs(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    with pytest.raises(SystemExit, match=r"--png needs matplotlib"):
        chart({"paths": []}, str(tmp_path / "out.png"))


def test_the_disk_probe_measures_every_round_and_leaves_nothing(tmp_path: Path) -> None:
    rates = disk_rate(tmp_path, (1 << 20) + 3, rounds=2)  # not a whole number of chunks
    assert [len(rates["write"]), len(rates["read"])] == [2, 2]
    assert all(r > 0 for r in rates["write"] + rates["read"])
    assert list(tmp_path.iterdir()) == []


def test_the_script_runs_every_path_and_writes_json(tmp_path: Path) -> None:
    out = tmp_path / "roofline.json"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--json", str(out), "--dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    r = json.loads(out.read_text())
    names = [p["path"] for p in r["paths"]]
    assert len(names) == len(PATHS)
    for label in PATHS:
        assert sum(_matches(label, n) for n in names) == 1, (label, names)
    for p in r["paths"]:
        kinds = {k: v for k, v in p["bytes"].items() if k != "total"}
        assert p["bytes"]["total"] == sum(kinds.values()) > 0
        assert p["fraction"] > 0 and len(p["ms"]) == 1
        assert p["bound"] in r["denominators"]
        assert p["path"] in done.stdout
    lookup = next(p for p in r["paths"] if p["path"].startswith("large lookup"))
    assert lookup["bytes"]["total"] == 4096 * 8 + 2 * 4096 * 16 * 4  # the quick lookup: 4096 ids, dim 16
    assert r["denominators"]["memory"] == max(r["bandwidth"]["on"]["copy"])
    if sys.platform.startswith("linux"):  # torch applies its switch on Linux: each child used its setting
        assert [r["bandwidth"][s]["huge_pages"] for s in ("off", "on")] == [False, True]
    assert "verdict" in done.stdout and "huge pages on best" in done.stdout
    assert sorted(x.name for x in tmp_path.iterdir()) == ["roofline.json"]  # probes and checkpoint cleaned up


def _matches(label: str, name: str) -> bool:
    if label == "forward":
        return name.endswith(": forward")
    return label in name
