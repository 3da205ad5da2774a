"""shardvar.optim: the table optimizers against torch.optim on the unsharded table, and their state."""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import shardvar
from shardvar import optim as so
from shardvar.optim._base import _slab_grad

pytestmark = pytest.mark.filterwarnings("ignore:Sparse invariant checks:UserWarning")  # torch's Adagrad, sparse

ROWS, DIM = 120, 6

# name -> (ours, torch's, sparse, options)
PAIRS = {
    "SGD": (so.SGD, torch.optim.SGD, False, {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01}),
    "SGD-nesterov": (so.SGD, torch.optim.SGD, False, {"lr": 0.1, "momentum": 0.5, "nesterov": True}),
    "SGD-sparse": (so.SGD, torch.optim.SGD, True, {"lr": 0.1}),
    "Adagrad": (
        so.Adagrad,
        torch.optim.Adagrad,
        False,
        {"lr": 0.1, "lr_decay": 0.01, "initial_accumulator_value": 0.1},
    ),
    "Adagrad-sparse": (so.Adagrad, torch.optim.Adagrad, True, {"lr": 0.1, "initial_accumulator_value": 0.2}),
    "Adam": (so.Adam, torch.optim.Adam, False, {"lr": 0.01, "weight_decay": 0.01}),
    "Adam-sparse": (so.Adam, torch.optim.SparseAdam, True, {"lr": 0.01}),
}


def pair(sparse: bool, shards: int, strategy: str) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    weight = torch.randn(ROWS, DIM)
    ref = nn.Embedding.from_pretrained(weight.clone(), freeze=False, sparse=sparse)
    mine = shardvar.ShardedEmbedding.from_pretrained(
        weight.clone(), freeze=False, partitioner=shards, partition_strategy=strategy, sparse=sparse
    )
    return mine, ref


def train(module: nn.Module, opt: torch.optim.Optimizer, steps: int = 20, seed: int = 1, high: int = ROWS // 2) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        ids = torch.randint(0, high, (48,), generator=g)  # duplicates in every batch; upper rows untouched
        module(ids).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("name", list(PAIRS))
@pytest.mark.parametrize(("shards", "strategy"), [(1, "div"), (3, "mod"), (8, "div"), (8, "mod")])
def test_equals_torch_optim_on_the_unsharded_table(name, shards, strategy) -> None:
    ours, theirs, sparse, options = PAIRS[name]
    mine, ref = pair(sparse, shards, strategy)
    before = ref.weight.detach().clone()
    train(mine, ours(mine, **options))
    train(ref, theirs(list(ref.parameters()), **options))
    torch.testing.assert_close(mine.weight.to_tensor(), ref.weight.detach(), atol=1e-5, rtol=0)
    if sparse:  # rows never looked up keep their values
        assert torch.equal(mine.weight.to_tensor()[ROWS // 2 :], before[ROWS // 2 :])


def rowwise_reference(weight: torch.Tensor, steps: list[torch.Tensor], lr: float, eps: float) -> torch.Tensor:
    """DLRM's row-wise Adagrad, written out: one accumulator per row, the mean squared gradient."""
    w, acc = weight.clone(), torch.zeros(weight.shape[0])
    for ids in steps:
        g = torch.zeros_like(w).index_add_(0, ids, 2 * w[ids])  # d/dw of sum(w[ids]^2)
        touched = torch.unique(ids)
        acc[touched] += g[touched].pow(2).mean(1)
        w[touched] -= lr * g[touched] / (acc[touched].sqrt() + eps).unsqueeze(1)
    return w


@pytest.mark.parametrize("sparse", [True, False])
def test_row_wise_adagrad_follows_its_formula_and_keeps_one_value_per_row(sparse) -> None:
    mine, ref = pair(sparse, 4, "mod")
    opt = so.RowWiseAdagrad(mine, lr=0.1, eps=1e-8)
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, ROWS // 2, (48,), generator=g) for _ in range(10)]
    for ids in batches:
        mine(ids).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
    if sparse:
        want = rowwise_reference(ref.weight.detach(), batches, 0.1, 1e-8)
        torch.testing.assert_close(mine.weight.to_tensor(), want, atol=1e-5, rtol=0)
    assert opt.state_bytes == ROWS * 4  # one float per row: 1/dim of Adagrad's state


def test_row_wise_adam_follows_its_formula() -> None:
    mine, ref = pair(False, 3, "div")
    opt = so.RowWiseAdam(mine, lr=0.01)
    w, m, v = ref.weight.detach().clone(), torch.zeros(ROWS, DIM), torch.zeros(ROWS)
    g = torch.Generator().manual_seed(1)
    for t in range(1, 8):
        ids = torch.randint(0, ROWS, (48,), generator=g)
        mine(ids).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
        grad = torch.zeros_like(w).index_add_(0, ids, 2 * w[ids])
        m = 0.9 * m + 0.1 * grad
        v = 0.999 * v + 0.001 * grad.pow(2).mean(1)
        w = w - 0.01 / (1 - 0.9**t) * m / ((v / (1 - 0.999**t)).sqrt() + 1e-8).unsqueeze(1)
    torch.testing.assert_close(mine.weight.to_tensor(), w, atol=1e-5, rtol=0)


def test_bags_with_weights_and_plain_parameters_train_as_torch_does() -> None:
    torch.manual_seed(0)
    ref = nn.ModuleDict({"bag": nn.EmbeddingBag(ROWS, DIM, mode="sum"), "head": nn.Linear(DIM, 1)})
    mine = copy.deepcopy(ref)
    mine["bag"] = shardvar.ShardedEmbeddingBag.from_pretrained(
        ref["bag"].weight.detach().clone(), freeze=False, mode="sum", partitioner=5
    )
    ours, theirs = so.Adam(mine, lr=0.01), torch.optim.Adam(ref.parameters(), lr=0.01)
    assert sorted(t.name for t in ours.tables) == ["bag.weight", "head.bias", "head.weight"]
    g = torch.Generator().manual_seed(2)
    for _ in range(5):
        ids, psw = torch.randint(0, ROWS, (30,), generator=g), torch.rand(30, generator=g)
        offsets = torch.tensor([0, 7, 19])
        for m, o in ((mine, ours), (ref, theirs)):
            m["head"](m["bag"](ids, offsets, per_sample_weights=psw)).sum().backward()
            o.step()
            o.zero_grad()
    torch.testing.assert_close(mine["bag"].weight.to_tensor(), ref["bag"].weight.detach(), atol=1e-5, rtol=0)
    torch.testing.assert_close(mine["head"].weight, ref["head"].weight, atol=1e-5, rtol=0)


def test_lr_schedulers_and_param_groups_drive_the_updates() -> None:
    mine, ref = pair(False, 4, "div")
    head, ref_head = nn.Linear(DIM, 1), None
    ref_head = copy.deepcopy(head)
    ours = so.SGD([{"params": mine, "lr": 0.1}, {"params": [("head.weight", head.weight)], "lr": 0.01}])
    theirs = torch.optim.SGD([{"params": ref.parameters(), "lr": 0.1}, {"params": [ref_head.weight], "lr": 0.01}])
    scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5) for o in (ours, theirs)]
    g = torch.Generator().manual_seed(3)
    for _ in range(6):
        ids = torch.randint(0, ROWS, (16,), generator=g)
        for m, h, o in ((mine, head, ours), (ref, ref_head, theirs)):
            h(m(ids)).sum().backward()
            o.step()
            o.zero_grad()
        for s in scheds:
            s.step()
    assert ours.param_groups[0]["lr"] == theirs.param_groups[0]["lr"] == 0.0125
    torch.testing.assert_close(mine.weight.to_tensor(), ref.weight.detach(), atol=1e-6, rtol=0)
    torch.testing.assert_close(head.weight, ref_head.weight, atol=1e-6, rtol=0)


def test_one_update_per_slab_whatever_the_number_of_shards() -> None:
    counts = []
    for shards in (8, 1024):
        emb = shardvar.ShardedEmbedding(4096, 4, shards, "mod", sparse=True)
        opt = so.Adagrad(emb, lr=0.1)
        emb(torch.randint(0, 4096, (500,))).sum().backward()
        assert len(emb.store.groups) == 1
        with torch.profiler.profile() as prof:
            opt.step()
        counts.append(sum(e.count for e in prof.key_averages() if e.key.startswith("aten::index_copy_")))
    assert counts[0] == counts[1] == 2  # the weight's rows and the state's rows, once each


@settings(max_examples=25, deadline=None)
@given(
    shards=st.integers(1, 6),
    strategy=st.sampled_from(["div", "mod"]),
    sparse=st.booleans(),
    ids=st.lists(st.integers(0, 29), min_size=1, max_size=20),
)
def test_one_step_on_any_layout_equals_torch(shards, strategy, sparse, ids) -> None:
    weight = torch.randn(30, 3, generator=torch.Generator().manual_seed(len(ids)))
    ref = nn.Embedding.from_pretrained(weight.clone(), freeze=False, sparse=sparse)
    mine = shardvar.ShardedEmbedding.from_pretrained(
        weight.clone(), freeze=False, partitioner=shards, partition_strategy=strategy, sparse=sparse
    )
    ours, theirs = so.Adagrad(mine, lr=0.5), torch.optim.Adagrad(ref.parameters(), lr=0.5)
    for m, o in ((mine, ours), (ref, theirs)):
        m(torch.tensor(ids)).pow(3).sum().backward()
        o.step()
    torch.testing.assert_close(mine.weight.to_tensor(), ref.weight.detach(), atol=1e-5, rtol=0)


def test_state_dict_round_trip_and_deepcopy() -> None:
    mine, _ = pair(True, 3, "mod")
    opt = so.Adam(mine, lr=0.01)
    train(mine, opt, steps=3)
    saved = opt.state_dict()
    assert set(saved["state"]) == {"weight/exp_avg", "weight/exp_avg_sq", "weight/step"}
    other_model, _ = pair(True, 3, "mod")
    other = so.Adam(other_model, lr=0.5)
    other.load_state_dict(saved)
    assert other.param_groups[0]["lr"] == 0.01
    assert torch.equal(other.state_dict()["state"]["weight/exp_avg"], saved["state"]["weight/exp_avg"])
    clone = copy.deepcopy(opt)
    assert torch.equal(clone.state_dict()["state"]["weight/exp_avg_sq"], saved["state"]["weight/exp_avg_sq"])
    with pytest.raises(ValueError, match="this state dict holds"):
        so.SGD(other_model, lr=0.1, momentum=0.9).load_state_dict(saved)


@pytest.mark.parametrize(
    ("make", "error", "match"),
    [
        (lambda m: so.SGD(m, lr=-1), ValueError, "lr"),
        (lambda m: so.SGD(m, lr=0.1, nesterov=True), ValueError, "nesterov momentum needs momentum > 0"),
        (lambda m: so.Adam(m, betas=(0.9, 1.5)), ValueError, r"betas must be in \[0, 1\)"),
        (lambda m: so.Adam(m, betas=0.9), ValueError, "betas must be a pair"),
        (lambda m: so.Adagrad(m, eps=-1), ValueError, "eps"),
        (lambda m: so.SGD("emb", lr=0.1), TypeError, "cannot optimize a str"),
        (lambda m: so.SGD([], lr=0.1), ValueError, "got no tables"),
        (lambda m: so.SGD([m, m], lr=0.1), ValueError, "two tables are named"),
        (lambda m: so.SGD([{"lr": 0.1}]), ValueError, "has no 'params' entry"),
        (
            lambda m: so.RowWiseAdagrad(shardvar.ShardedVariable([torch.zeros(4, 2), torch.zeros(4, 2)], axis=1)),
            ValueError,
            "split along axis 1",
        ),
    ],
)
def test_bad_arguments_are_refused_with_clear_messages(make, error, match) -> None:
    mine, _ = pair(False, 2, "div")
    with pytest.raises(error, match=match):
        make(mine)


def test_every_table_is_checked_before_any_changes() -> None:
    a, _ = pair(False, 2, "div")
    b = shardvar.ShardedEmbedding(10, DIM, 2, sparse=True)
    opt = so.SGD([("a", a), ("b", b)], lr=0.1)
    a(torch.tensor([1])).sum().backward()
    before = a.weight.to_tensor().clone()
    b(torch.tensor([1])).sum().backward()
    bad = torch.sparse_coo_tensor(torch.tensor([[9]]), torch.ones(1, DIM), (5, DIM), check_invariants=False)
    b.weight.variables[0].grad = bad  # a row outside the shard: found while planning, before any update
    with pytest.raises(IndexError, match=r"shard 0 has a sparse gradient for rows 9\.\.9, outside its 5 rows"):
        opt.step()
    assert torch.equal(a.weight.to_tensor(), before) and int(opt.tables[0].step) == 0
    assert _slab_grad(opt.tables[0], 0)[1] is not None


def test_an_embedding_collection_trains_table_by_table_as_separate_bags() -> None:
    configs = {"a": shardvar.TableConfig(20, 3, 2, "mod"), "b": shardvar.TableConfig(9, 3, 3)}
    ebc = shardvar.EmbeddingBagCollection(configs, sparse=True)
    plain = {k: nn.EmbeddingBag(c.num_embeddings, 3, sparse=True) for k, c in configs.items()}
    for k, bag in plain.items():
        bag.load_state_dict(ebc.embedding_bags[k].state_dict())
    ours = so.RowWiseAdagrad(ebc, lr=0.1)
    assert [t.name for t in ours.tables] == ["embedding_bags.a.weight", "embedding_bags.b.weight"]
    theirs = {k: so.RowWiseAdagrad(b, lr=0.1) for k, b in plain.items()}
    g = torch.Generator().manual_seed(4)
    for _ in range(4):
        ids = {k: torch.randint(0, c.num_embeddings, (5, 2), generator=g) for k, c in configs.items()}
        sum(v.pow(2).sum() for v in ebc(ids).values()).backward()
        ours.step()
        ours.zero_grad()
        for k, bag in plain.items():
            bag(ids[k]).pow(2).sum().backward()
            theirs[k].step()
            theirs[k].zero_grad()
    for k, bag in plain.items():
        torch.testing.assert_close(ebc.embedding_bags[k].weight.to_tensor(), bag.weight.detach(), atol=1e-6, rtol=0)
