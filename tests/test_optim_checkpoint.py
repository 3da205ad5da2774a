"""Table optimizers' state in checkpoints: logical variables that reshard with their table."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import shardvar
from shardvar import optim as so
from shardvar.checkpoint import Manifest

ROWS, DIM = 90, 4


def model(shards: int | None, strategy: str = "div", seed: int = 0) -> nn.ModuleDict:
    torch.manual_seed(seed)
    weight = torch.randn(ROWS, DIM, generator=torch.Generator().manual_seed(7))
    emb = (
        nn.Embedding.from_pretrained(weight, freeze=False, sparse=True)
        if shards is None
        else shardvar.ShardedEmbedding.from_pretrained(
            weight, freeze=False, partitioner=shards, partition_strategy=strategy, sparse=True
        )
    )
    head = nn.Linear(DIM, 1)
    with torch.no_grad():
        head.weight.fill_(0.5)
        head.bias.zero_()
    return nn.ModuleDict({"emb": emb, "head": head})


def train(m: nn.ModuleDict, opt: torch.optim.Optimizer, steps: range) -> None:
    for step in steps:
        ids = torch.randint(0, ROWS, (20,), generator=torch.Generator().manual_seed(step))
        m["head"](m["emb"](ids)).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()


def weights(m: nn.ModuleDict) -> torch.Tensor:
    w = m["emb"].weight
    return w.to_tensor() if hasattr(w, "to_tensor") else w.detach()


@pytest.mark.parametrize("make", [so.RowWiseAdagrad, so.Adam, so.RowWiseAdam], ids=lambda c: c.__name__)
@pytest.mark.parametrize(
    ("first", "second"), [((3, "div"), (8, "mod")), ((8, "mod"), (None, "div")), ((None, "div"), (2, "div"))]
)
def test_training_resumed_in_another_layout_equals_uninterrupted_training(tmp_path, make, first, second) -> None:
    whole = model(*first)
    whole_opt = make(whole, lr=0.05)
    train(whole, whole_opt, range(8))
    part = model(*first)
    part_opt = make(part, lr=0.05)
    train(part, part_opt, range(4))
    shardvar.save({"model": part, "opt": part_opt}, tmp_path)
    resumed = model(*second, seed=99)
    resumed_opt = make(resumed, lr=0.05)
    shardvar.load({"model": resumed, "opt": resumed_opt}, tmp_path)
    train(resumed, resumed_opt, range(4, 8))
    torch.testing.assert_close(weights(resumed), weights(whole), atol=1e-5, rtol=0)


def test_row_wise_state_is_one_logical_variable_in_the_tables_layout(tmp_path) -> None:
    m = model(4, "mod")
    opt = so.RowWiseAdagrad(m, lr=0.1)
    train(m, opt, range(2))
    shardvar.save({"opt": opt}, tmp_path)
    entry = Manifest.read(tmp_path).variables["opt/emb.weight/sum"]
    assert entry.shape == (ROWS,) and entry.layout == m["emb"].layout
    sums = shardvar.read_shard(tmp_path, "opt/emb.weight/sum")
    assert torch.equal(
        sums, opt.tables[0].slot_variable("sum").layout.join(list(opt.tables[0].slot_variable("sum").shards.values()))
    )
    shardvar.reshard(tmp_path, tmp_path / "r", 3, "div")
    assert torch.equal(shardvar.read_shard(tmp_path / "r", "opt/emb.weight/sum"), sums)


def test_loading_into_another_optimizer_class_is_refused_before_anything_changes(tmp_path) -> None:
    m = model(2)
    opt = so.RowWiseAdagrad(m, lr=0.1)
    train(m, opt, range(2))
    shardvar.save({"opt": opt}, tmp_path)
    other = so.Adam(model(2), lr=0.1)
    before = other.state_dict()["state"]["emb.weight/exp_avg"].clone()
    with pytest.raises(shardvar.CheckpointError, match="not in the checkpoint"):
        shardvar.load({"opt": other}, tmp_path)
    assert torch.equal(other.state_dict()["state"]["emb.weight/exp_avg"], before)


def _groups(m: nn.ModuleDict, **first: object) -> list[dict]:
    return [{"params": [("emb", m["emb"])], **first}, {"params": [("head", m["head"])]}]


@pytest.mark.parametrize("make", [so.RowWiseAdam, so.SGD], ids=lambda c: c.__name__)
def test_each_param_groups_options_resume_from_a_checkpoint_as_torchs_load_state_dict(tmp_path, make) -> None:
    m = model(3)
    opt = make(_groups(m, lr=0.2, weight_decay=0.01), lr=0.05)
    opt.param_groups[1]["lr"] = 0.003  # as a learning-rate scheduler leaves it
    train(m, opt, range(2))
    shardvar.save({"model": m, "opt": opt}, tmp_path)
    resumed = model(2, "mod")
    resumed_opt = make(_groups(resumed), lr=0.05)
    shardvar.load({"model": resumed, "opt": resumed_opt}, tmp_path)
    mine = [{k: v for k, v in g.items() if k != "params"} for g in resumed_opt.param_groups]
    assert mine == [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    assert isinstance(mine[0].get("betas", ()), tuple)  # JSON has no tuples: restored as the optimizer's own
    train(m, opt, range(2, 4))
    train(resumed, resumed_opt, range(2, 4))
    torch.testing.assert_close(weights(resumed), weights(m), atol=1e-6, rtol=0)


def test_an_optimizer_with_other_param_groups_is_refused_before_anything_changes(tmp_path) -> None:
    m = model(3)
    opt = so.RowWiseAdagrad(_groups(m, lr=0.2), lr=0.05)
    train(m, opt, range(2))
    shardvar.save({"model": m, "opt": opt}, tmp_path)
    other = model(2)
    other_opt = so.RowWiseAdagrad(other, lr=0.05)  # one group
    before = weights(other).clone()
    with pytest.raises(shardvar.CheckpointError, match="optimizer 'opt' has 1 param groups; the checkpoint has 2"):
        shardvar.load({"model": other, "opt": other_opt}, tmp_path)
    assert torch.equal(weights(other), before) and other_opt.param_groups[0]["lr"] == 0.05
