"""A load fills a destination it cannot read into directly a bounded window of rows at a time.

Such destinations (non-contiguous views: a tiered table's file, a transposed tensor) were staged a
whole shard at a time; now ``checkpoint/_window.py`` restores one window of at most
``WINDOW_BYTES`` into a buffer and copies it in, whatever the stored and target layouts.
"""

from __future__ import annotations

import itertools

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import shardvar
from shardvar import Layout
from shardvar.checkpoint import _window


@st.composite
def _layouts(draw, rows: int, axis: int):
    kind = draw(st.sampled_from(["div", "mod", "explicit"]))
    if kind == "explicit":
        cuts = sorted(draw(st.lists(st.integers(0, rows), max_size=3)))
        return Layout.explicit([b - a for a, b in itertools.pairwise([0, *cuts, rows])], axis)
    return getattr(Layout, kind)(rows, draw(st.integers(1, 4)), axis)


@given(st.data())
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_windows_fill_strided_destinations_from_any_layout(tmp_path, monkeypatch, data) -> None:
    shape = [data.draw(st.integers(0, 13)), data.draw(st.integers(1, 4)), 2]
    full = torch.randn(shape)
    src_axis = data.draw(st.integers(0, 1))
    directory = tmp_path / f"ck{data.draw(st.integers(0, 10**9))}"
    shardvar.save({"v": shardvar.shard_tensor(full, data.draw(_layouts(shape[src_axis], src_axis)))}, directory)
    window = data.draw(st.integers(1, 64))
    monkeypatch.setattr(_window, "WINDOW_BYTES", window)
    staged: list[int] = []
    restore_into = _window.restore_into

    def counted(files, entry, target, outs, verify):
        staged.extend(o.nbytes for o in outs.values())
        return restore_into(files, entry, target, outs, verify)

    monkeypatch.setattr(_window, "restore_into", counted)
    strided = torch.zeros(shape[::-1]).permute(2, 1, 0)  # the same shape, not contiguous: no direct read
    shardvar.load({"v": strided}, directory, staging_bytes=0)
    assert torch.equal(strided, full)
    row = 4 * shape[0] * shape[1] * shape[2] // max(shape[src_axis], 1)  # windows run along the stored axis
    assert all(n <= max(window, row) for n in staged)
