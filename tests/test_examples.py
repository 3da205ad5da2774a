"""The examples run as documented."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from conftest import ROOT
from distributed import free_port


def test_recsys_example_trains_under_torchrun(tmp_path) -> None:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
        str(ROOT / "examples" / "recsys_ddp.py"), "--steps", "60", "--users", "3000", "--items", "800",
        "--save", str(tmp_path / "ck"),
    ]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    first, last = map(float, re.search(r"loss (\d\.\d+) -> (\d\.\d+)", out.stdout).groups())
    assert last < first, out.stdout
    assert "rank 0 holds" in out.stdout and (tmp_path / "ck" / "manifest.json").exists()


def test_dlrm_example_trains_the_unsharded_model_on_one_two_and_three_processes(tmp_path) -> None:
    import torch

    import shardvar
    from shardvar.cli._demo_tables import _plain
    from shardvar.cli.dlrm import build, tables, train

    runs = {}
    cases = (("w1", 1, "row"), ("w2", 2, "row"), ("w3", 3, "table"), ("auto2", 2, "auto"), ("auto3", 3, "auto"))
    for label, world, placement in cases:
        script = [str(ROOT / "examples" / "dlrm.py"), "--steps", "20", "--batch", "240", "--scale", "0.01",
                  "--placement", placement, "--save", str(tmp_path / label)]  # fmt: skip
        launcher = (
            []
            if world == 1
            else ["-m", "torch.distributed.run", "--nproc-per-node", str(world), "--master-port", str(free_port())]
        )
        out = subprocess.run(
            [sys.executable, *launcher, *script],
            capture_output=True,
            text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
            timeout=300,
        )
        assert out.returncode == 0, out.stdout + out.stderr
        runs[label] = re.search(r"loss (\d\.\d+) -> (\d\.\d+)", out.stdout).groups()
    assert len(set(runs.values())) == 1, runs  # row-wise, table-wise, replicated and mixed placements alike
    configs = tables(0.01)
    plain = _plain(build(configs, 1), configs)  # one nn.EmbeddingBag per table, the same initial values
    train(plain, configs, 20, 240, 0.1)
    names = shardvar.checkpoint.Manifest.read(tmp_path / "w1").variables
    assert sum(".embedding_bags." in n for n in names) == 26
    for name in names:
        want = plain.state_dict()[name.removeprefix("model/")]
        for label, _, _ in cases:
            torch.testing.assert_close(shardvar.read_shard(tmp_path / label, name), want, atol=1e-5, rtol=0)


def test_sequence_model_example_learns_and_its_table_restores_into_a_plain_embedding(tmp_path) -> None:
    import torch
    from torch import nn

    import shardvar

    script = [str(ROOT / "examples" / "sequence_model.py"), "--steps", "60", "--save", str(tmp_path / "ck")]
    out = subprocess.run(
        [sys.executable, *script],
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    first, last = map(float, re.search(r"loss (\d\.\d+) -> (\d\.\d+)", out.stdout).groups())
    assert last < first - 0.05, out.stdout
    plain = nn.ModuleDict({"embeddings": nn.ModuleDict({"item": nn.Embedding(400, 16)})})
    shardvar.load({"model": plain}, tmp_path / "ck")  # the sharded, trained table as a plain nn.Embedding
    other = shardvar.EmbeddingCollection({"item": shardvar.TableConfig(400, 16, 3, "div", feature_names=["history"])})
    shardvar.load({"model": other}, tmp_path / "ck")  # and into another layout
    assert torch.equal(other.embeddings["item"].weight.to_tensor(), plain["embeddings"]["item"].weight)
