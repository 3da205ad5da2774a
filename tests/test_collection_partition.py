"""partition_model(collections=...): a model's own list or dict of nn.EmbeddingBag becomes a collection."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import shardvar
from shardvar import ShardvarValueError
from shardvar.nn import EmbeddingBagDict, EmbeddingBagList

SIZES = [(50, 8, "sum"), (7, 8, "sum"), (120, 8, "mean"), (33, 4, "sum"), (9, 8, "max")]


class DLRMish(nn.Module):
    """DLRM's shape: ``emb_l`` indexed table by table, a bottom MLP and a dot interaction."""

    def __init__(self) -> None:
        super().__init__()
        self.emb_l = nn.ModuleList([nn.EmbeddingBag(n, d, mode=m) for n, d, m in SIZES])
        for bag in self.emb_l:  # DLRM's initialisation: small rows keep the dot products tame
            nn.init.uniform_(bag.weight, -(bag.num_embeddings**-0.5), bag.num_embeddings**-0.5)
        self.bot = nn.Linear(3, 8)
        self.top = nn.Linear(25 + 4 + 8, 1)

    def forward(self, dense: torch.Tensor, ids: list[torch.Tensor], offsets: list[torch.Tensor]) -> torch.Tensor:
        x = self.bot(dense)
        pooled = [self.emb_l[k](ids[k], offsets[k]) for k in range(len(self.emb_l))]  # the stock loop
        same = [p for p in pooled if p.shape[1] == 8]
        z = torch.stack([x, *same], 1)
        dots = torch.bmm(z, z.transpose(1, 2)).flatten(1)
        return self.top(torch.cat([dots, pooled[3], x], 1))


def _batch(step: int) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(step)
    ids = [torch.randint(0, n, (12,), generator=g) for n, _, _ in SIZES]
    offsets = [torch.tensor([0, 3, 3, 7]) for _ in SIZES]
    return torch.randn(4, 3, generator=g), ids, offsets


def test_a_partitioned_list_trains_as_the_stock_model() -> None:
    torch.manual_seed(0)
    stock = DLRMish()
    model = copy.deepcopy(stock)
    part = shardvar.partition_model(
        model, {"emb_l.0.weight": 3, "emb_l.2.weight": shardvar.Layout.mod(120, 4)}, collections=["emb_l"]
    )
    assert isinstance(model.emb_l, EmbeddingBagList) and len(model.emb_l) == 5
    assert [b.layout.num_shards for b in model.emb_l] == [3, 1, 4, 1, 1]
    assert list(model.state_dict()) == list(stock.state_dict())
    assert set(part.parameters) == {f"emb_l.{k}.weight" for k in range(5)}
    opts = [torch.optim.SGD(m.parameters(), lr=0.01) for m in (stock, model)]
    for step in range(5):
        dense, ids, offsets = _batch(step)
        outs = []
        for m, opt in zip((stock, model), opts, strict=True):
            opt.zero_grad()
            out = m(dense, ids, offsets)
            out.pow(2).mean().backward()
            opt.step()
            outs.append(out)
        torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=1e-5)
    for k, v in stock.state_dict().items():
        torch.testing.assert_close(model.state_dict()[k], v, atol=1e-5, rtol=1e-5)
    # one call looks every table up (one kernel per group of alike tables), as the loop does
    dense, ids, offsets = _batch(9)
    together = model.emb_l(ids, offsets)
    for k in range(5):
        torch.testing.assert_close(together[k], model.emb_l[k](ids[k], offsets[k]))
    assert len(model.emb_l._grouped()) == 4  # (8, sum) x2 in one allocation, then mean, (4, sum), max
    back = DLRMish()
    back.load_state_dict(model.state_dict())
    model.load_state_dict(stock.state_dict())
    torch.testing.assert_close(back(dense, ids, offsets), model(dense, ids, offsets))


def test_a_dict_of_bags_and_keyed_jagged() -> None:
    model = nn.Module()
    model.tables = nn.ModuleDict(
        {"user": nn.EmbeddingBag(40, 6, mode="sum"), "item": nn.EmbeddingBag(30, 6, mode="sum")}
    )
    stock = copy.deepcopy(model)
    shardvar.partition_model(model, {"tables.user.weight": 4}, collections=["tables"])
    assert isinstance(model.tables, EmbeddingBagDict)
    jagged = shardvar.KeyedJagged(("user", "item"), torch.tensor([1, 39, 5, 2, 29]), torch.tensor([[2, 1], [1, 1]]))
    out = model.tables(jagged)
    assert torch.allclose(out["user"], stock.tables.user(torch.tensor([1, 39, 5]), torch.tensor([0, 2])))
    assert torch.allclose(out["item"], stock.tables.item(torch.tensor([2, 29]), torch.tensor([0, 1])))


def test_bad_collections_raise_and_change_nothing() -> None:
    model = DLRMish()
    model.other = nn.ModuleList([nn.EmbeddingBag(4, 2), nn.Linear(2, 2)])
    before = {k: v.clone() for k, v in model.state_dict().items()}
    for names, match in (
        (["nope"], "no such submodule"),
        (["bot"], "not a non-empty nn.ModuleList"),
        (["other"], r"entries \['1'\] are not nn.EmbeddingBag"),
    ):
        with pytest.raises(ShardvarValueError, match=match):
            shardvar.partition_model(model, {"emb_l.0.weight": 2}, collections=["emb_l", *names])
    with pytest.raises(shardvar.ShardvarTypeError, match="list of submodule names"):
        shardvar.partition_model(model, {}, collections="emb_l")
    assert type(model.emb_l) is nn.ModuleList and all(torch.equal(model.state_dict()[k], v) for k, v in before.items())


def test_plan_collection_replicates_tiny_splits_large_and_balances_the_rest() -> None:
    from shardvar.distributed import plan_collection

    tables = {
        f"t{i}": shardvar.TableConfig(rows, 16) for i, rows in enumerate([10, 3, 20_000, 30_000, 25_000, 400_000])
    }
    placement = plan_collection(tables, world=3, replicate_bytes=1 << 12)
    assert placement == {"t0": "replicate", "t1": "replicate", "t2": 2, "t3": 0, "t4": 1, "t5": "row"}
    assert plan_collection(tables, world=3, replicate_bytes=1 << 12) == placement  # the same on every rank
    assert set(plan_collection(tables, world=1).values()) <= {"replicate", 0}
    with pytest.raises(shardvar.ShardvarTypeError, match="TableConfig"):
        plan_collection({"a": (3, 4)}, world=2)


def test_auto_placement_in_a_process_group(tmp_path) -> None:
    from distributed import run_ranks

    (result,) = run_ranks(1, "dist_collection_workers:auto_placement", tmp_path)
    assert result["replicated"] == ["a", "b", "c", "d", "e", "f", "g"]  # all tiny: every table replicated
    assert result["groups"] == 0 and result["shapes"]["d"] == (3, 6)
    assert result["sequence_replicated"] == result["replicated"] and result["sequence_shapes"]["d"] == (6, 6)
