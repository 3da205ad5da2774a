"""examples/gpt2_tied.py runs as documented: a tied GPT-2 partitioned, trained, and loaded into the stock model."""

from __future__ import annotations

import re
import runpy
import sys

import pytest

from conftest import ROOT

pytest.importorskip("transformers")


@pytest.mark.slow
def test_gpt2_tied_example_trains_and_round_trips_into_the_stock_model(tmp_path, monkeypatch, capsys) -> None:
    argv = ["gpt2_tied.py", "--steps", "6", "--shards", "3", "--out", str(tmp_path)]
    monkeypatch.setattr(sys, "argv", argv)
    monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", "1")  # the example sets it in this process; undone after the test
    runpy.run_path(str(ROOT / "examples" / "gpt2_tied.py"), run_name="__main__")
    out = capsys.readouterr().out
    first, last = map(float, re.search(r"training loss (\d+\.\d+) -> (\d+\.\d+)", out).groups())
    assert last < first, out
    for how in ("from_pretrained", "shardvar.load"):
        assert f"via {how}: max |logits diff| = 0.00e+00, lm_head tied to wte: True" in out, out
    assert (tmp_path / "hf" / "model.safetensors").exists() and (tmp_path / "shardvar" / "manifest.json").exists()
