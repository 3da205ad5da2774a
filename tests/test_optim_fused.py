"""Optimizers fused into backward: the same result as step(), with no gradient kept."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import shardvar
from shardvar import optim as so

ROWS, DIM = 100, 5

SETUPS = {
    "SGD": lambda m: so.SGD(m, lr=0.1),
    "SGD-momentum": lambda m: so.SGD(m, lr=0.1, momentum=0.9, weight_decay=0.01),
    "Adagrad": lambda m: so.Adagrad(m, lr=0.1),
    "RowWiseAdagrad": lambda m: so.RowWiseAdagrad(m, lr=0.1),
    "Adam": lambda m: so.Adam(m, lr=0.01),
    "RowWiseAdam": lambda m: so.RowWiseAdam(m, lr=0.01),
}


def table(sparse: bool, shards: int = 4, strategy: str = "mod") -> nn.Module:
    weight = torch.randn(ROWS, DIM, generator=torch.Generator().manual_seed(0))
    return shardvar.ShardedEmbedding.from_pretrained(
        weight, freeze=False, partitioner=shards, partition_strategy=strategy, sparse=sparse
    )


def batches(n: int = 6) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, ROWS // 2, (40,), generator=g) for _ in range(n)]


@pytest.mark.parametrize("name", list(SETUPS))
@pytest.mark.parametrize("sparse", [True, False])
def test_fused_updates_equal_step(name, sparse) -> None:
    plain, fused = table(sparse), table(sparse)
    opt, fused_opt = SETUPS[name](plain), SETUPS[name](fused)
    handle = so.fuse(fused_opt)
    for ids in batches():
        plain(ids).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
        fused(ids).pow(2).sum().backward()  # updated during backward
        assert all(p.grad is None for p in fused.weight.variables)  # no gradient is kept
        fused_opt.step()  # nothing left to do
    torch.testing.assert_close(fused.weight.to_tensor(), plain.weight.to_tensor(), atol=1e-6, rtol=0)
    assert int(fused_opt.tables[0].step) == int(opt.tables[0].step) == 6
    handle.remove()


def test_fused_adam_equals_sparse_adam_and_schedulers_drive_it() -> None:
    mine = table(True, 3, "div")
    ref = nn.Embedding.from_pretrained(mine.weight.to_tensor().clone(), freeze=False, sparse=True)
    ours, theirs = so.Adam(mine, lr=0.02), torch.optim.SparseAdam(list(ref.parameters()), lr=0.02)
    so.fuse(ours)
    scheds = [torch.optim.lr_scheduler.ExponentialLR(o, 0.7) for o in (ours, theirs)]
    for ids in batches():
        mine(ids).pow(2).sum().backward()
        ours.step()  # nothing left to do, but the schedulers see a step, as they expect
        ref(ids).pow(2).sum().backward()
        theirs.step()
        theirs.zero_grad()
        for s in scheds:
            s.step()
    torch.testing.assert_close(mine.weight.to_tensor(), ref.weight.detach(), atol=1e-5, rtol=0)


def test_a_table_read_twice_in_one_pass_is_updated_once_with_the_summed_gradient() -> None:
    plain, fused = table(True), table(True)
    opt, fused_opt = so.Adagrad(plain, lr=0.1), so.Adagrad(fused, lr=0.1)
    so.fuse(fused_opt)
    for ids in batches(3):
        for m in (plain, fused):
            (m(ids).sum() + m(ids.flip(0)).pow(2).sum()).backward()
        opt.step()
        opt.zero_grad()
    torch.testing.assert_close(fused.weight.to_tensor(), plain.weight.to_tensor(), atol=1e-6, rtol=0)


def test_fusing_twice_is_refused_and_remove_restores_step() -> None:
    m = table(True)
    opt = so.SGD(m, lr=0.1)
    handle = so.fuse(opt)
    with pytest.raises(ValueError, match="already fused"):
        so.fuse(opt)
    with pytest.raises(ValueError, match=r"needs a shardvar\.optim optimizer"):
        so.fuse(torch.optim.SGD(m.parameters(), lr=0.1))
    handle.remove()
    m(torch.tensor([1])).sum().backward()
    assert m.weight.variables[1].grad is not None  # kept again until step()
    before = m.weight.to_tensor().clone()
    opt.step()
    assert not torch.equal(m.weight.to_tensor(), before)


@pytest.mark.parametrize("sparse", [True, False])
@pytest.mark.parametrize("width", [4, 6])  # the trained table grouped with the frozen one, or apart
def test_a_frozen_table_is_left_alone_by_a_fused_optimizer_as_by_step(sparse, width) -> None:
    def run(fused: bool) -> shardvar.EmbeddingBagCollection:
        torch.manual_seed(0)
        configs = {"frozen": shardvar.TableConfig(10, 4, 2, "mod"), "trained": shardvar.TableConfig(7, width, 3)}
        ebc = shardvar.EmbeddingBagCollection(configs, sparse=sparse)
        ebc.embedding_bags["frozen"].requires_grad_(False)  # e.g. pretrained; the optimizer is given the model
        opt = so.RowWiseAdagrad(ebc, lr=0.1)
        if fused:
            so.fuse(opt)
        for step in range(2):
            ids = {"frozen": torch.tensor([[1, 2], [3, 1]]), "trained": torch.tensor([[step, 4], [5, 5]])}
            sum(v.pow(2).sum() for v in ebc(ids).values()).backward()
            opt.step()
            opt.zero_grad()
        return ebc

    plain, fused = run(False), run(True)
    for name in ("frozen", "trained"):
        want = plain.embedding_bags[name].weight.to_tensor()
        torch.testing.assert_close(fused.embedding_bags[name].weight.to_tensor(), want, atol=1e-6, rtol=0)
    torch.manual_seed(0)
    assert torch.equal(plain.embedding_bags["frozen"].weight.to_tensor(), torch.randn(10, 4))  # never updated
