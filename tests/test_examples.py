"""The examples run as documented."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from conftest import ROOT
from distributed import free_port


def test_recsys_example_trains_on_two_processes(tmp_path) -> None:
    # Launched as torchrun would: the README's torchrun command for this script runs in test_readme.py.
    script = [str(ROOT / "examples" / "recsys_ddp.py"), "--steps", "60", "--users", "3000", "--items", "800",
              "--save", str(tmp_path / "ck")]  # fmt: skip
    procs = _ranks(2, script)
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, out + err
    out = outs[0][0]
    first, last = map(float, re.search(r"loss (\d\.\d+) -> (\d\.\d+)", out).groups())
    assert last < first, out
    assert "rank 0 holds" in out and (tmp_path / "ck" / "manifest.json").exists()


def _ranks(world: int, script: list[str]) -> list[subprocess.Popen]:
    """An example on ``world`` processes, launched as torchrun would (with the environment it sets): a
    launcher interpreter less per run. torchrun itself runs the examples in test_readme.py and
    test_dlrm_long_run.py."""
    port, procs = free_port(), []
    for rank in range(world):
        ranks = {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world)}
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), **ranks}
        procs.append(subprocess.Popen([sys.executable, *script], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))  # fmt: skip
    return procs


def test_dlrm_example_trains_the_unsharded_model_on_one_two_and_three_processes(tmp_path, monkeypatch, capsys) -> None:
    import runpy

    import torch

    import shardvar
    from shardvar.workloads import build_dlrm, criteo_tables, plain_dlrm, train_dlrm

    steps, size = 8, 96  # the batch divides by 1, 2 and 3; the scale keeps every kind of auto placement
    # 1, 2 and 3 processes, each placement once (auto on 3 mixes row, table and replicated tables):
    # every extra launch is a few seconds of torch starting up on each of its ranks
    cases = (("w1", 1, "row"), ("w2", 2, "table"), ("auto3", 3, "auto"))

    def script(label: str, placement: str) -> list[str]:
        return [str(ROOT / "examples" / "dlrm.py"), "--steps", str(steps), "--batch", str(size), "--scale", "0.01",
                "--placement", placement, "--save", str(tmp_path / label)]  # fmt: skip

    launched = {label: _ranks(world, script(label, placement)) for label, world, placement in cases if world > 1}
    # One process: run here, while the others start (the same main, without another start of torch).
    monkeypatch.setattr(sys, "argv", script("w1", "row"))
    monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", "1")  # what the example sets; undone after the test
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
        runs = {"w1": re.search(r"loss (\d\.\d+) -> (\d\.\d+)", capsys.readouterr().out).groups()}
        for label, procs in launched.items():
            outs = [p.communicate(timeout=300) for p in procs]
            for p, (out, err) in zip(procs, outs, strict=True):
                assert p.returncode == 0, label + out + err
            runs[label] = re.search(r"loss (\d\.\d+) -> (\d\.\d+)", outs[0][0]).groups()
    finally:  # a failure above leaves no run behind
        for p in (p for procs in launched.values() for p in procs):
            p.kill()
            p.communicate()
    assert len(set(runs.values())) == 1, runs  # row-wise, table-wise, replicated and mixed placements alike
    configs = criteo_tables(0.01)
    plain = plain_dlrm(build_dlrm(configs, 1), configs)  # one nn.EmbeddingBag per table, the same initial values
    train_dlrm(plain, configs, steps, size, 0.1)
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


@pytest.mark.slow
def test_sequence_model_example_trains_on_two_processes_and_restores_into_one(tmp_path) -> None:
    # Its torchrun mode: the table a DistributedEmbeddingCollection (fused RowWiseAdagrad), the dense layers DDP.
    import torch
    from torch import nn

    import shardvar

    script = [str(ROOT / "examples" / "sequence_model.py"), "--steps", "60", "--save", str(tmp_path / "ck")]
    procs = _ranks(2, script)
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, out + err
    first, last = map(float, re.search(r"2 process\(es\), 60 steps: loss (\d\.\d+) -> (\d\.\d+)", outs[0][0]).groups())
    assert last < first - 0.05, outs[0][0]
    plain = nn.ModuleDict({"embeddings": nn.ModuleDict({"item": nn.Embedding(400, 16)})})
    shardvar.load({"model": plain}, tmp_path / "ck")  # the table trained over two ranks, as one plain nn.Embedding
    assert torch.isfinite(plain["embeddings"]["item"].weight).all()


def _run_example(name: str, args: list[str], monkeypatch) -> None:
    """``examples/<name> ARGS`` in this process, as one process (no torchrun environment)."""
    import runpy

    monkeypatch.setattr(sys, "argv", [str(ROOT / "examples" / name), *args])
    monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", "1")  # what the examples set; undone after the test
    for key in ("WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    runpy.run_path(sys.argv[0], run_name="__main__")


@pytest.mark.parametrize(
    ("name", "flag", "value"),
    [
        ("dlrm.py", "--steps", "0"),
        ("dlrm.py", "--steps", "-1"),
        ("dlrm.py", "--batch", "0"),
        ("dlrm.py", "--checkpoint-every", "0"),
        ("dlrm.py", "--lr", "nan"),
        ("sequence_model.py", "--steps", "0"),
        ("sequence_model.py", "--checkpoint-every", "0"),
        ("recsys_ddp.py", "--batch", "0"),
    ],
)
def test_examples_refuse_bad_flags_before_anything_starts(name, flag, value, monkeypatch, capsys) -> None:
    with pytest.raises(SystemExit, match=r"^2$"):
        _run_example(name, [f"{flag}={value}"], monkeypatch)
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1].startswith(f"{name}: error: argument {flag}: must be "), err
    assert "Traceback" not in err


def test_dlrm_example_relaunched_after_it_finished_says_so(tmp_path, monkeypatch, capsys) -> None:
    args = ["--steps", "2", "--batch", "16", "--checkpoint-dir", str(tmp_path / "ck"), "--checkpoint-every", "2"]
    _run_example("dlrm.py", args, monkeypatch)
    assert "2 steps: loss" in capsys.readouterr().out
    _run_example("dlrm.py", args, monkeypatch)  # returns: exit status 0
    out = capsys.readouterr().out
    assert f"the run in {tmp_path / 'ck'} has finished: step-00000002 holds 2 of 2 steps" in out, out


def test_sequence_model_example_checkpoints_and_resumes_the_whole_model(tmp_path, monkeypatch, capsys) -> None:
    import torch

    import shardvar

    periodic = ["--checkpoint-dir", str(tmp_path / "ck"), "--checkpoint-every", "2", "--batch", "8"]
    _run_example(
        "sequence_model.py", ["--steps", "6", "--batch", "8", "--save", str(tmp_path / "straight")], monkeypatch
    )
    _run_example("sequence_model.py", ["--steps", "4", *periodic], monkeypatch)  # stopped after 4 steps
    _run_example("sequence_model.py", ["--steps", "6", *periodic, "--save", str(tmp_path / "resumed")], monkeypatch)
    out = capsys.readouterr().out
    assert f"resuming from {tmp_path / 'ck' / 'step-00000004'}" in out, out
    names = shardvar.checkpoint.Manifest.read(tmp_path / "straight").variables
    assert {n.split("/")[0] for n in names} == {"model", "dense", "table_opt", "dense_opt"}  # all of it
    for name in names:  # the resumed run went on exactly as the uninterrupted one
        assert torch.equal(
            shardvar.read_shard(tmp_path / "resumed", name), shardvar.read_shard(tmp_path / "straight", name)
        ), name
    _run_example("sequence_model.py", ["--steps", "6", *periodic], monkeypatch)
    assert "has finished (6 of 6 steps)" in capsys.readouterr().out


def test_recsys_example_without_torchrun_says_how_to_launch_it(monkeypatch) -> None:
    with pytest.raises(
        SystemExit, match=r"^recsys_ddp\.py runs one process per rank under torchrun .*: torchrun --nproc"
    ):
        _run_example("recsys_ddp.py", ["--steps", "1"], monkeypatch)
