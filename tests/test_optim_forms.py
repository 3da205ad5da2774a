"""Table optimizers take every form torch.optim takes: parameters, named parameters, param groups with options."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
from torch import nn

import shardvar
import shardvar.optim as so

ROWS, DIM = 20, 3

FORMS = {  # each applied alike to our model and to the plain one
    "iterable of parameters": lambda e, h: itertools.chain(e.parameters(), h.parameters()),
    "list of parameters": lambda e, h: [*e.parameters(), *h.parameters()],
    "named parameters": lambda e, h: [*e.named_parameters(prefix="emb"), *h.named_parameters(prefix="head")],
    "param groups": lambda e, h: [
        {"params": e.parameters(), "lr": 0.2, "weight_decay": 0.01},
        {"params": h.parameters(), "lr": 0.05},
    ],
    "named param groups": lambda e, h: [{"params": e.named_parameters()}, {"params": h.named_parameters(), "lr": 0.05}],
}
OPTIMIZERS = {  # (ours, torch's, defaults, options of the first param group)
    "SGD": (so.SGD, torch.optim.SGD, {"lr": 0.1}, {"momentum": 0.9, "nesterov": True}),
    "Adagrad": (
        so.Adagrad,
        torch.optim.Adagrad,
        {"lr": 0.1},
        {"lr_decay": 0.1, "eps": 1e-3},
    ),  # torch ignores a group's initial sum
    "Adam": (so.Adam, torch.optim.Adam, {"lr": 0.05}, {"betas": (0.5, 0.9), "eps": 1e-6}),
}


def models() -> tuple[tuple[nn.Module, nn.Module], tuple[nn.Module, nn.Module]]:
    torch.manual_seed(0)
    emb, head = shardvar.ShardedEmbedding(ROWS, DIM, 2, "mod"), nn.Linear(DIM, 1)
    plain = nn.Embedding(ROWS, DIM)
    plain.load_state_dict(emb.state_dict())
    return (emb, head), (plain, copy.deepcopy(head))


def train(emb: nn.Module, head: nn.Module, opt: torch.optim.Optimizer) -> None:
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        head(emb(torch.randint(0, ROWS, (8,), generator=g))).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()


def with_options(params: object, options: dict) -> object:
    """The first param group gets ``options`` (a form without groups is made one group)."""
    groups = list(params)  # type: ignore[call-overload]
    if not isinstance(groups[0], dict):
        groups = [{"params": groups}]
    return [{**groups[0], **options}, *groups[1:]]


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("form", FORMS)
def test_every_torch_form_with_per_group_options_trains_as_torch_optim(form, optimizer) -> None:
    ours_cls, torch_cls, defaults, options = OPTIMIZERS[optimizer]
    (emb, head), (plain, plain_head) = models()
    ours = ours_cls(with_options(FORMS[form](emb, head), options), **defaults)
    theirs = torch_cls(with_options(FORMS[form](plain, plain_head), options), **defaults)
    train(emb, head, ours)
    train(plain, plain_head, theirs)
    torch.testing.assert_close(emb.weight.to_tensor(), plain.weight.detach(), atol=1e-6, rtol=0)
    torch.testing.assert_close(head.weight, plain_head.weight, atol=1e-6, rtol=0)
    names = [t.name for t in ours.tables]
    assert len(set(names)) == len(names) == 4  # two shards, weight, bias: each named once


@pytest.mark.parametrize("optimizer", [so.RowWiseAdagrad, so.RowWiseAdam])
def test_row_wise_optimizers_take_param_groups_and_train_as_with_named_tables(optimizer) -> None:
    (emb, head), _ = models()
    (named_emb, named_head), _ = models()
    groups = optimizer([{"params": emb.parameters(), "lr": 0.1}, {"params": head.parameters(), "lr": 0.01}])
    assert [t.name for t in groups.tables] == ["#0", "#1", "#2", "#3"]  # counted across the groups
    named = optimizer([{"params": [("emb", named_emb)], "lr": 0.1}, {"params": [("head", named_head)], "lr": 0.01}])
    assert [t.name for t in named.tables] == ["emb.weight", "head.weight", "head.bias"]
    train(emb, head, groups)
    train(named_emb, named_head, named)
    torch.testing.assert_close(emb.weight.to_tensor(), named_emb.weight.to_tensor(), atol=1e-6, rtol=0)
    torch.testing.assert_close(head.bias, named_head.bias, atol=1e-6, rtol=0)
    again = optimizer([{"params": emb.parameters(), "lr": 0.1}, {"params": head.parameters(), "lr": 0.01}])
    again.load_state_dict(groups.state_dict())  # the derived names are stable: the state finds its tables
    assert all(torch.equal(again.state_dict()["state"][k], v) for k, v in groups.state_dict()["state"].items())


def test_the_issue_form_with_two_collections() -> None:
    configs = {"u": shardvar.TableConfig(10, 4, 2), "i": shardvar.TableConfig(8, 4)}
    a, b = shardvar.EmbeddingBagCollection(configs), shardvar.EmbeddingBagCollection(configs)
    opt = so.RowWiseAdagrad([{"params": a.parameters(), "lr": 0.1}, {"params": b.parameters(), "lr": 0.01}])
    assert [g["lr"] for g in opt.param_groups] == [0.1, 0.01] and len(opt.tables) == 6


@pytest.mark.parametrize(
    ("make", "error", "match"),
    [
        (lambda p: so.Adam([{"params": p}, {"params": [], "betas": (0.9, 1.5)}]), ValueError, "param group 1: betas"),
        (lambda p: so.SGD([{"params": p, "nesterov": True}], lr=0.1), ValueError, "param group 0: nesterov momentum"),
        (lambda p: so.Adagrad([{"params": p, "lr": -1}]), ValueError, "param group 0: lr must be >= 0"),
        (lambda p: so.RowWiseAdagrad([{"params": p, "eps": "x"}]), TypeError, "param group 0: eps must be a number"),
        (lambda p: so.SGD({"params": p}, lr=0.1), TypeError, "cannot optimize a dict given as params"),
        (lambda p: so.SGD([{"params": "emb"}], lr=0.1), TypeError, "given as param group 0's 'params'"),
    ],
)
def test_bad_param_groups_are_refused_naming_the_group(make, error, match) -> None:
    (emb, _), _ = models()
    with pytest.raises(error, match=match):
        make(emb.parameters())


@pytest.mark.parametrize(
    "make",
    [
        lambda e, h: so.RowWiseAdagrad({*e.parameters(), *h.parameters()}),
        lambda e, h: so.Adam([{"params": set(e.parameters())}, {"params": h.parameters()}]),
        lambda e, h: so.SGD([{"params": frozenset(h.parameters())}], lr=0.1),
    ],
)
def test_sets_are_refused_their_order_would_name_the_tables(make) -> None:
    (emb, head), _ = models()  # "#0", "#1"...: a set's order changes between runs, the state would swap tables
    with pytest.raises(TypeError, match=r"ordered collections.*got a set") as caught:
        make(emb, head)
    assert isinstance(caught.value, shardvar.ShardvarError)


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_add_param_group_trains_the_added_tables_as_torch_optim(optimizer) -> None:
    ours_cls, torch_cls, defaults, options = OPTIMIZERS[optimizer]
    (emb, head), (plain, plain_head) = models()
    ours, theirs = ours_cls(emb.parameters(), **defaults), torch_cls(plain.parameters(), **defaults)
    ours.add_param_group({"params": head.parameters(), "lr": 0.05, **options})  # e.g. a layer unfrozen later
    theirs.add_param_group({"params": plain_head.parameters(), "lr": 0.05, **options})
    assert [t.name for t in ours.tables] == ["#0", "#1", "#2", "#3"]  # numbered on from the first group's
    train(emb, head, ours)
    train(plain, plain_head, theirs)
    torch.testing.assert_close(emb.weight.to_tensor(), plain.weight.detach(), atol=1e-6, rtol=0)
    torch.testing.assert_close(head.weight, plain_head.weight, atol=1e-6, rtol=0)
    again = ours_cls(emb.parameters(), **defaults)
    again.add_param_group({"params": head.parameters(), "lr": 0.05, **options})
    again.load_state_dict(ours.state_dict())
    assert all(torch.equal(again.state_dict()["state"][k], v) for k, v in ours.state_dict()["state"].items())


def test_add_param_group_refuses_a_table_already_optimized_or_a_bad_option_and_changes_nothing() -> None:
    (emb, head), _ = models()
    opt = so.RowWiseAdagrad(emb.parameters(), lr=0.1)
    bad = [
        ({"params": emb.parameters()}, ValueError, "shares a parameter with '#0'"),
        ({"params": head.parameters(), "eps": -1}, ValueError, "param group 1: eps must be >= 0"),
        ([head.weight], TypeError, "param_group must be a dict"),
    ]
    for group, error, match in bad:
        with pytest.raises(error, match=match) as caught:
            opt.add_param_group(group)
        assert isinstance(caught.value, shardvar.ShardvarError)
        assert len(opt.param_groups) == 1 and len(opt.tables) == 2
    opt.add_param_group({"params": head.parameters()})  # the names refused groups would have taken are free
    assert [t.name for t in opt.tables] == ["#0", "#1", "#2", "#3"]


def test_sgd_momentum_in_an_added_group_gives_every_table_its_buffer() -> None:
    (emb, head), (plain, plain_head) = models()
    ours, theirs = so.SGD(emb.parameters(), lr=0.1), torch.optim.SGD(plain.parameters(), lr=0.1)
    ours.add_param_group({"params": head.parameters(), "momentum": 0.9})
    theirs.add_param_group({"params": plain_head.parameters(), "momentum": 0.9})
    train(emb, head, ours)
    train(plain, plain_head, theirs)
    torch.testing.assert_close(head.weight, plain_head.weight, atol=1e-6, rtol=0)
    assert {k.split("/")[1] for k in ours.state_dict()["state"]} == {"momentum_buffer", "step"}


def test_a_fused_optimizer_updates_an_added_group_in_backward() -> None:
    (emb, head), (plain, plain_head) = models()
    ours, theirs = so.Adagrad(emb.parameters(), lr=0.1), torch.optim.Adagrad(plain.parameters(), lr=0.1)
    so.fuse(ours)
    ours.add_param_group({"params": head.parameters(), "lr": 0.05})
    theirs.add_param_group({"params": plain_head.parameters(), "lr": 0.05})
    train(emb, head, ours)
    train(plain, plain_head, theirs)
    assert head.weight.grad is None  # taken by the update inside backward
    torch.testing.assert_close(head.weight, plain_head.weight, atol=1e-6, rtol=0)
    torch.testing.assert_close(emb.weight.to_tensor(), plain.weight.detach(), atol=1e-6, rtol=0)
