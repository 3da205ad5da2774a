"""Delta checkpoints: only changed rows, a verified chain on load, compaction into one checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import shardvar
from shardvar import ShardedEmbedding
from shardvar.checkpoint import Manifest

pytestmark = pytest.mark.filterwarnings("ignore:Sparse invariant checks:UserWarning")  # torch.optim.Adagrad, sparse

ROWS, DIM = 20_000, 16


def size(path: Path) -> int:
    return sum(p.stat().st_size for p in Path(path).iterdir() if not p.name.startswith("spare-"))


def model(shards: int = 4, strategy: str = "mod", seed: int = 0) -> tuple[ShardedEmbedding, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    emb = ShardedEmbedding(ROWS, DIM, shards, strategy, sparse=True)
    return emb, torch.optim.Adagrad(emb.parameters(), lr=0.1)


def step(emb: ShardedEmbedding, opt: torch.optim.Optimizer, ids: torch.Tensor) -> None:
    emb(ids).pow(2).sum().backward()
    opt.step()
    opt.zero_grad()


def assert_same(a: tuple, b: tuple) -> None:
    assert torch.equal(a[0].weight.to_tensor(), b[0].weight.to_tensor())
    sums = [[s["sum"] for s in o.state.values()] for o in (a[1], b[1])]
    assert torch.equal(
        *(
            shardvar.ShardedVariable(x, partition_strategy=m[0].layout.strategy).to_tensor()
            for x, m in zip(sums, (a, b), strict=True)
        )
    )


def test_a_delta_of_one_percent_of_rows_is_at_most_two_percent_of_the_full_size(tmp_path) -> None:
    emb, opt = model()
    step(emb, opt, torch.arange(ROWS))  # every row has optimizer state
    shardvar.save({"m": emb, "o": opt}, tmp_path / "base")
    hot = torch.randperm(ROWS)[: ROWS // 100]
    for _ in range(3):
        step(emb, opt, hot[torch.randint(0, hot.numel(), (500,))])
    shardvar.save({"m": emb, "o": opt}, tmp_path / "delta", delta_of=tmp_path / "base")
    assert size(tmp_path / "delta") <= 0.02 * size(tmp_path / "base")
    rows = shardvar.read_shard(tmp_path / "delta", "m/weight#rows")
    assert set(rows.tolist()) <= set(hot.tolist())  # only rows that changed


def test_base_and_five_deltas_load_equal_to_a_full_save_in_any_layout(tmp_path) -> None:
    emb, opt = model()
    step(emb, opt, torch.arange(0, ROWS, 7))
    shardvar.save({"m": emb, "o": opt}, tmp_path / "d0")
    for k in range(1, 6):
        if k == 3:  # the training job restarts from the chain with another layout: deltas keep working
            emb, opt = model(3, "div", seed=9)
            shardvar.load({"m": emb, "o": opt}, tmp_path / f"d{k - 1}")
        step(emb, opt, torch.randint(0, ROWS, (300,)))
        shardvar.save({"m": emb, "o": opt}, tmp_path / f"d{k}", delta_of=tmp_path / f"d{k - 1}")
    shardvar.save({"m": emb, "o": opt}, tmp_path / "full")
    for shards, strategy in [(4, "mod"), (5, "div"), (1, "div")]:
        from_chain, from_full = model(shards, strategy, seed=1), model(shards, strategy, seed=2)
        shardvar.load({"m": from_chain[0], "o": from_chain[1]}, tmp_path / "d5")
        shardvar.load({"m": from_full[0], "o": from_full[1]}, tmp_path / "full")
        assert_same(from_chain, from_full)
        assert_same(from_chain, (emb, opt))
    plain = torch.nn.Embedding(ROWS, DIM)
    shardvar.load({"m": plain}, tmp_path / "d5")
    assert torch.equal(plain.weight, emb.weight.to_tensor())


def test_compact_folds_a_chain_into_one_checkpoint_that_needs_no_base(tmp_path) -> None:
    emb, opt = model()
    shardvar.save({"m": emb, "o": opt}, tmp_path / "base")
    step(emb, opt, torch.arange(50))
    shardvar.save({"m": emb, "o": opt}, tmp_path / "delta", delta_of=tmp_path / "base")
    shardvar.compact(tmp_path / "delta", tmp_path / "one")
    for p in (tmp_path / "base").iterdir():
        p.unlink()
    manifest = Manifest.read(tmp_path / "one")
    assert "delta" not in manifest.extra and not any("#" in n for n in manifest.variables)
    assert manifest.variables["m/weight"].layout == emb.layout  # layouts kept
    again = model(2, "div", seed=3)
    shardvar.load({"m": again[0], "o": again[1]}, tmp_path / "one")
    assert_same(again, (emb, opt))
    with pytest.raises(shardvar.CheckpointError, match="already holds a checkpoint"):
        shardvar.compact(tmp_path / "delta", tmp_path / "one")


def test_reads_and_reshards_follow_the_chain(tmp_path) -> None:
    emb, opt = model()
    shardvar.save({"m": emb}, tmp_path / "base")
    step(emb, opt, torch.arange(100, 200))
    shardvar.save({"m": emb}, tmp_path / "delta", delta_of=tmp_path / "base")
    want = emb.weight.to_tensor()
    assert torch.equal(shardvar.read_shard(tmp_path / "delta", "m/weight"), want)
    layout = shardvar.Layout.balanced("mod", ROWS, 3)
    assert torch.equal(shardvar.read_shard(tmp_path / "delta", "m/weight", layout, 1), want[1::3])
    shardvar.reshard(tmp_path / "delta", tmp_path / "re", 2, "div")
    assert torch.equal(shardvar.read_shard(tmp_path / "re", "m/weight"), want)


def chain(tmp_path: Path) -> tuple[Path, Path, ShardedEmbedding]:
    emb, opt = model()
    shardvar.save({"m": emb}, tmp_path / "base")
    step(emb, opt, torch.arange(10))
    shardvar.save({"m": emb}, tmp_path / "delta", delta_of=tmp_path / "base")
    return tmp_path / "base", tmp_path / "delta", emb


def test_a_base_saved_over_breaks_the_link_and_the_load_names_it(tmp_path) -> None:
    base, delta, emb = chain(tmp_path)
    shardvar.save({"m": emb}, base)  # someone saves over the base: the delta's rows no longer apply
    target, _ = model(2, "div", seed=5)
    before = target.weight.to_tensor().clone()
    with pytest.raises(shardvar.CheckpointError, match=r"this link of the chain is broken") as e:
        shardvar.load({"m": target}, delta)
    assert str(delta) in str(e.value) and str(base.resolve()) in str(e.value)
    assert torch.equal(target.weight.to_tensor(), before)


def test_a_missing_base_and_damaged_delta_bytes_are_refused(tmp_path) -> None:
    base, delta, _ = chain(tmp_path)
    values = Manifest.read(delta).variables["m/weight#values"].pieces[0]
    with open(delta / values.file, "r+b") as f:
        f.seek(values.begin + 3)
        byte = f.read(1)
        f.seek(values.begin + 3)
        f.write(bytes([byte[0] ^ 0xFF]))
    target, _ = model()
    with pytest.raises(shardvar.CheckpointError, match="checksum"):
        shardvar.load({"m": target}, delta)
    for p in base.iterdir():
        p.unlink()
    base.rmdir()
    with pytest.raises(shardvar.CheckpointError, match=r"names base .* which cannot be read"):
        shardvar.load({"m": target}, delta)


def test_a_delta_record_that_names_missing_variables_is_refused(tmp_path) -> None:
    _, delta, _ = chain(tmp_path)
    raw = json.loads((delta / "manifest.json").read_text())
    raw["extra"]["delta"]["rows"]["m/weight"]["rows"] = "nope"
    from shardvar.checkpoint._manifest import _checksum

    raw["checksum"] = _checksum({k: v for k, v in raw.items() if k != "checksum"})
    (delta / "manifest.json").write_text(json.dumps(raw))
    with pytest.raises(shardvar.CheckpointError, match="name variables it does not hold"):
        shardvar.load({"m": model()[0]}, delta)


def test_a_delta_into_its_own_chain_is_refused(tmp_path) -> None:
    base, delta, emb = chain(tmp_path)
    for target in (base, delta):
        with pytest.raises(shardvar.CheckpointError, match="part of its own chain"):
            shardvar.save({"m": emb}, target, delta_of=delta)
    with pytest.raises(shardvar.CheckpointError, match="delta_of must be the path"):
        shardvar.save({"m": emb}, tmp_path / "x", delta_of=3)
