"""``shardvar convert-tf`` and ``shardvar inspect`` of TensorFlow checkpoints."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

import shardvar
from shardvar import ShardedEmbedding
from shardvar.cli import main
from tf_bundle import write_bundle

DATA = Path(__file__).parent / "data" / "tf"


def test_inspect_lists_name_shape_dtype_and_slices(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", str(DATA / "saver_v1")]) == 0
    out = capsys.readouterr().out
    assert "model.ckpt-3" in out and "13 variables in 4 data file(s)" in out
    emb = next(line for line in out.splitlines() if line.startswith("emb "))  # plain table in a pipe
    assert "10x4" in emb and "float32" in emb and "3: 0,4:0,4" in emb
    assert main(["inspect", str(DATA / "checkpoint_v2_adam" / "ckpt-1")]) == 0
    out = capsys.readouterr().out
    assert "model/emb" in out and "slot m of" in out


def test_inspect_still_lists_shardvar_checkpoints(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    shardvar.save({"v": torch.zeros(3)}, tmp_path)
    assert main(["inspect", str(tmp_path)]) == 0
    assert "1 variables" in capsys.readouterr().out


def test_convert_tf_with_a_map_shards_and_strategy(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    mapping = tmp_path / "map.json"
    mapping.write_text(json.dumps({"emb": "model/weight"}))
    out = tmp_path / "out"
    argv = ["convert-tf", str(DATA / "saver_v1"), str(out), "--shards", "3", "--strategy", "mod", "--map", str(mapping)]
    assert main([*argv, "--optimizer", "adam"]) == 0
    printed = capsys.readouterr().out
    assert "opt/model/weight/exp_avg" in printed and "step count: 3" in printed and "not converted: big" in printed
    model = ShardedEmbedding(10, 4, partitioner=2)
    adam = torch.optim.Adam(model.parameters())
    shardvar.load({"model": model, "opt": adam}, out)
    assert np.array_equal(model.weight.to_tensor().detach().numpy(), np.load(DATA / "saver_v1" / "expected.npz")["emb"])
    with pytest.raises(SystemExit, match="already holds a checkpoint"):
        main(argv)
    assert main([*argv, "--force"]) == 0


def test_convert_tf_refuses_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit, match=r"shardvar convert-tf: .*no variable 'nope'"):
        (tmp_path / "m.json").write_text('{"nope": "x"}')
        main(["convert-tf", str(DATA / "saver_v1"), str(tmp_path / "o"), "--map", str(tmp_path / "m.json")])
    for text, why in (("[1]", "must hold a JSON object"), ("{", "not JSON")):  # read where parsed: status 2
        (tmp_path / "m.json").write_text(text)
        with pytest.raises(SystemExit, match=r"^2$"):
            main(["convert-tf", str(DATA / "saver_v1"), str(tmp_path / "o"), "--map", str(tmp_path / "m.json")])
        assert f"argument --map: {why}" in capsys.readouterr().err
    with pytest.raises(SystemExit, match=r"shardvar inspect: .*magic"):
        (tmp_path / "bad.index").write_bytes(b"\0" * 64)
        main(["inspect", str(tmp_path / "bad")])
    assert not (tmp_path / "o").exists()


def test_inspect_escapes_control_characters_in_names(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_bundle(tmp_path / "ck", {"evil\x1b[2J[red]x": np.zeros(2, np.float32)})
    assert main(["inspect", str(tmp_path / "ck")]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "evil\\x1b[2J[red]x" in out
