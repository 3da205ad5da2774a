"""EmbeddingCollection (sequence features: every id's row) against separate nn.Embedding tables."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardvar
import shardvar.optim as so
from shardvar import EmbeddingCollection, JaggedRows, KeyedJagged, TableConfig
from shardvar.nn import EmbeddingBagDict

WIDTHS = {"grouped": (4, 4, 4), "apart": (4, 5, 6)}
ROWS = {"history": 40, "item": 25, "ctx": 9}
SERVES = {"history": ("clicks", "views"), "item": None, "ctx": None}


def tables(grouping: str, shards: int = 3, strategy: str = "mod") -> dict[str, TableConfig]:
    return {
        t: TableConfig(ROWS[t], w, shards, strategy, feature_names=SERVES[t])
        for t, w in zip(ROWS, WIDTHS[grouping], strict=True)
    }


def twins(grouping: str, sparse: bool = False) -> tuple[EmbeddingCollection, nn.ModuleDict]:
    torch.manual_seed(0)
    ec = EmbeddingCollection(tables(grouping), sparse=sparse)
    plain = nn.ModuleDict(
        {t: nn.Embedding(e.num_embeddings, e.embedding_dim, sparse=sparse) for t, e in ec.embeddings.items()}
    )
    plain.load_state_dict({k.removeprefix("embeddings."): v for k, v in ec.state_dict().items()})
    return ec, plain


def jagged(seed: int = 0) -> KeyedJagged:
    g = torch.Generator().manual_seed(seed)
    keys, rows = ("views", "item", "clicks", "ctx"), (40, 25, 40, 9)
    lengths = torch.randint(0, 4, (4, 3), generator=g)
    values = torch.cat([torch.randint(0, r, (int(n),), generator=g) for r, n in zip(rows, lengths.sum(1), strict=True)])
    return KeyedJagged(keys, values, lengths)


@pytest.mark.parametrize("sparse", [False, True])
@pytest.mark.parametrize("grouping", WIDTHS)
def test_rows_and_gradients_equal_separate_embeddings(grouping, sparse) -> None:
    ec, plain = twins(grouping, sparse)
    batch = jagged()
    with torch.profiler.profile() as prof:
        out = ec(batch)
    kernels = sum(e.count for e in prof.key_averages() if e.key == "aten::embedding")
    assert kernels == (1 if grouping == "grouped" else 3)  # one per group, a table's two features included
    ids, offsets, _ = batch.split()
    assert list(out) == list(batch.keys)
    loss = 0
    for i, (f, rows) in enumerate(out.items()):
        assert isinstance(rows, JaggedRows) and torch.equal(rows.lengths, batch.lengths[i])
        want = plain[ec.feature_tables[f]](ids[f])
        torch.testing.assert_close(rows.values, want, atol=0, rtol=0)
        assert torch.equal(rows.offsets(), offsets[f])
        loss = loss + (rows.values * (i + 1)).pow(2).sum()
        (want * (i + 1)).pow(2).sum().backward()
    loss.backward()
    for t, emb in ec.embeddings.items():
        got = shardvar.ShardedVariable(
            [p.grad.to_dense() if sparse else p.grad for p in emb.weight.variables],
            partition_strategy=emb.layout.strategy,
        ).to_tensor()
        want = plain[t].weight.grad
        torch.testing.assert_close(got, want.to_dense() if sparse else want, atol=1e-5, rtol=0)


def test_two_d_ids_offsets_and_padding() -> None:
    ec, plain = twins("grouped")
    out = ec(
        {"item": torch.tensor([[1, 2, 3], [4, 5, 6]]), "ctx": torch.tensor([1, 2, 8])}, {"ctx": torch.tensor([0, 0, 1])}
    )
    assert out["item"].lengths.tolist() == [3, 3] and out["ctx"].lengths.tolist() == [0, 1, 2]
    padded = out["ctx"].to_padded(padding_value=-1.0)
    assert padded.shape == (3, 2, 4) and bool((padded[0] == -1).all()) and bool((padded[1, 1] == -1).all())
    torch.testing.assert_close(padded[2], plain["ctx"](torch.tensor([2, 8])), atol=0, rtol=0)
    padded.sum().backward()  # the padding is differentiable through the values


def test_moved_table_is_looked_up_by_its_own_forward() -> None:
    ec, plain = twins("grouped")
    ec.embeddings["history"].double().float()
    ids, _, _ = jagged(1).split()
    out = ec(jagged(1))
    for f in ("clicks", "views", "item"):
        torch.testing.assert_close(out[f].values, plain[ec.feature_tables[f]](ids[f]), atol=0, rtol=0)


@pytest.mark.parametrize("grouping", WIDTHS)
def test_fused_row_wise_adagrad_trains_and_the_state_reshards_through_a_checkpoint(tmp_path, grouping) -> None:
    ec, plain = twins(grouping, sparse=True)
    ours, theirs = so.RowWiseAdagrad(ec, lr=0.1), so.RowWiseAdagrad([("embeddings", plain)], lr=0.1)
    so.fuse(ours)
    for step in range(3):
        batch = jagged(step)
        ids, _, _ = batch.split()
        sum(rows.values.pow(2).sum() for rows in ec(batch).values()).backward()
        ours.step()
        sum(plain[ec.feature_tables[f]](x).pow(2).sum() for f, x in ids.items()).backward()
        theirs.step()
        theirs.zero_grad()
    for t, emb in ec.embeddings.items():
        torch.testing.assert_close(emb.weight.to_tensor(), plain[t].weight.detach(), atol=1e-6, rtol=0)
    shardvar.save({"model": ec, "opt": ours}, tmp_path)
    other = EmbeddingCollection(tables(grouping, 2, "div"), sparse=True)
    other_opt = so.RowWiseAdagrad(other, lr=0.1)
    shardvar.load({"model": other, "opt": other_opt}, tmp_path)
    stock = nn.ModuleDict(
        {
            "embeddings": nn.ModuleDict(
                {t: nn.Embedding(n, w) for (t, n), w in zip(ROWS.items(), WIDTHS[grouping], strict=True)}
            )
        }
    )
    shardvar.load({"model": stock}, tmp_path)
    for t, emb in ec.embeddings.items():
        assert torch.equal(other.embeddings[t].weight.to_tensor(), emb.weight.to_tensor())
        assert torch.equal(stock["embeddings"][t].weight, emb.weight.to_tensor())
        want = ours.state_dict()["state"][f"embeddings.{t}.weight/sum"]
        assert torch.equal(other_opt.state_dict()["state"][f"embeddings.{t}.weight/sum"], want)


def row_wise_step(kind: str, table: torch.Tensor, state: dict, grad: torch.Tensor, step: int, lr: float) -> None:
    """The row-wise rule in plain torch: one accumulator per row (the mean squared gradient of the row);
    a sparse gradient touches its rows only, a dense one every row."""
    rows = grad.coalesce().indices()[0] if grad.is_sparse else torch.arange(table.shape[0])
    g = grad.to_dense()[rows]
    if kind == "RowWiseAdagrad":
        state["sum"][rows] += g.pow(2).mean(1)
        table[rows] -= lr * g / (state["sum"][rows].sqrt() + 1e-10)[:, None]
        return
    state["m"][rows] = 0.9 * state["m"][rows] + 0.1 * g
    state["v"][rows] = 0.999 * state["v"][rows] + 0.001 * g.pow(2).mean(1)
    denom = state["v"][rows].sqrt() / (1 - 0.999**step) ** 0.5 + 1e-8
    table[rows] -= lr / (1 - 0.9**step) * state["m"][rows] / denom[:, None]


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("kind", ["RowWiseAdagrad", "RowWiseAdam"])
@pytest.mark.parametrize("sparse", [False, True])
@pytest.mark.parametrize("grouping", WIDTHS)
def test_row_wise_optimizers_fused_or_not_follow_the_row_wise_rule(grouping, sparse, kind, fused) -> None:
    ec, _ = twins(grouping, sparse)
    tables = {t: e.weight.to_tensor().detach().clone() for t, e in ec.embeddings.items()}
    state = {t: {"sum": torch.zeros(n), "m": torch.zeros_like(tables[t]), "v": torch.zeros(n)} for t, n in ROWS.items()}
    opt = getattr(so, kind)(ec, lr=0.1)
    if fused:
        so.fuse(opt)  # the rows change inside backward
    for step in range(1, 4):
        batch = jagged(step)
        sum((rows.values * (i + 1)).pow(2).sum() for i, rows in enumerate(ec(batch).values())).backward()
        if not fused:
            opt.step()
            opt.zero_grad()
        ids, _, _ = batch.split()
        leaves = {t: w.clone().requires_grad_() for t, w in tables.items()}
        features = enumerate(batch.keys)  # a table's two features: their gradients summed, one update
        sum(
            (F.embedding(ids[f], leaves[ec.feature_tables[f]], sparse=sparse) * (i + 1)).pow(2).sum()
            for i, f in features
        ).backward()
        for t, leaf in leaves.items():
            row_wise_step(kind, tables[t], state[t], leaf.grad, step, 0.1)
    for t, emb in ec.embeddings.items():
        torch.testing.assert_close(emb.weight.to_tensor(), tables[t], atol=1e-5, rtol=0)


@pytest.mark.parametrize("grouping", WIDTHS)
def test_row_wise_adam_state_reshards_and_training_goes_on_as_before(tmp_path, grouping) -> None:
    ec, _ = twins(grouping, sparse=True)
    opt = so.RowWiseAdam(ec, lr=0.05)
    for step in range(2):
        sum(rows.values.pow(2).sum() for rows in ec(jagged(step)).values()).backward()
        opt.step()
        opt.zero_grad()
    shardvar.save({"model": ec, "opt": opt}, tmp_path)
    other = EmbeddingCollection(tables(grouping, 2, "div"), sparse=True)  # 3 mod shards -> 2 div shards
    other_opt = so.RowWiseAdam(other, lr=0.05)
    shardvar.load({"model": other, "opt": other_opt}, tmp_path)
    for module, optimizer in ((ec, opt), (other, other_opt)):  # moments and step counts came along: the same steps
        for step in range(2, 4):
            sum(rows.values.pow(2).sum() for rows in module(jagged(step)).values()).backward()
            optimizer.step()
            optimizer.zero_grad()
    for t, emb in ec.embeddings.items():
        torch.testing.assert_close(other.embeddings[t].weight.to_tensor(), emb.weight.to_tensor(), atol=1e-6, rtol=0)


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda: EmbeddingCollection({"a": TableConfig(5, 2, mode="mean")}), ValueError, "does not pool"),
        (
            lambda: EmbeddingCollection(tables("grouped"))({"history": torch.tensor([[1]])}),
            ValueError,
            "no feature named",
        ),
        (
            lambda: EmbeddingCollection(tables("grouped"))(
                KeyedJagged(("item",), torch.tensor([1]), torch.tensor([[1]]), torch.ones(1))
            ),
            ValueError,
            "is not pooled .* takes no weights",
        ),
        (lambda: EmbeddingCollection(tables("grouped"))({"item": torch.tensor([[25]])}), IndexError, "25"),
    ],
)
def test_bad_input_is_refused(call, error, match) -> None:
    with pytest.raises(error, match=match):
        call()


def test_partition_model_makes_a_models_dict_of_embeddings_a_sequence_collection() -> None:
    model = nn.Module()
    model.tables = nn.ModuleDict(
        {"clicks": nn.Embedding(40, 6), "item": nn.Embedding(30, 6), "bag": nn.EmbeddingBag(9, 6)}
    )
    stock = copy.deepcopy(model)
    part = shardvar.partition_model(model, {"tables.clicks.weight": 4}, collections=["tables"])
    assert isinstance(model.tables, EmbeddingBagDict) and model.tables["clicks"].layout.num_shards == 4
    assert list(model.state_dict()) == list(stock.state_dict()) and "tables.clicks.weight" in part.parameters
    batch = KeyedJagged(
        ("clicks", "item", "bag"), torch.tensor([1, 39, 5, 2, 29, 8]), torch.tensor([[2, 1], [1, 1], [0, 1]])
    )
    with torch.profiler.profile() as prof:
        out = model.tables(batch)
    assert sum(e.count for e in prof.key_averages() if e.key == "aten::embedding") == 1  # both embeddings, one kernel
    assert torch.equal(out["clicks"].values, stock.tables.clicks(torch.tensor([1, 39, 5])))
    assert out["clicks"].lengths.tolist() == [2, 1] and torch.equal(
        out["item"].values, stock.tables.item(torch.tensor([2, 29]))
    )
    torch.testing.assert_close(out["bag"], stock.tables.bag(torch.tensor([8]), torch.tensor([0, 0])))


def test_a_plan_partitions_a_models_dict_of_embeddings_into_a_sequence_collection() -> None:
    from shardvar.transform import plan

    model = nn.Module()
    model.tables = nn.ModuleDict(
        {"clicks": nn.Embedding(4000, 16), "item": nn.Embedding(3000, 16), "ctx": nn.Embedding(50, 8)}
    )
    stock = copy.deepcopy(model)
    p = plan(model, {"cpu:0": 300_000, "cpu:1": 200_000}, min_split_bytes=0)  # too big for one device: split
    shardvar.partition_model(model, p, collections=["tables"])
    for name in ("clicks", "item"):
        assert model.tables[name].layout.sizes == p.strategy[f"tables.{name}.weight"].partitioner.sizes
    assert len(model.tables._groups) == 2 and model.tables._groups[0][0] == ["clicks", "item"]  # by width
    batch = KeyedJagged(("clicks", "ctx"), torch.tensor([1, 3999, 5, 49]), torch.tensor([[2, 1], [0, 1]]))
    out = model.tables(batch)
    assert torch.equal(out["clicks"].values, stock.tables.clicks(torch.tensor([1, 3999, 5])))
    assert torch.equal(out["ctx"].values, stock.tables.ctx(torch.tensor([49])))
    assert out["ctx"].lengths.tolist() == [0, 1]
    assert list(model.state_dict()) == list(stock.state_dict())
