"""Tables and features decoupled: a table serves the features it lists, looked up once for all of them."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import shardvar
from shardvar import EmbeddingBagCollection, KeyedJagged, TableConfig

WIDTHS = {"grouped": (4, 4, 4), "apart": (4, 5, 6)}
ROWS = {"user": 30, "item": 20, "ctx": 9}
SERVES = {"user": ("query_user", "candidate_user"), "item": None, "ctx": ("ctx",)}  # None: the table's own name


def tables(grouping: str) -> dict[str, TableConfig]:
    return {
        name: TableConfig(ROWS[name], width, 3, "mod", feature_names=SERVES[name])
        for name, width in zip(ROWS, WIDTHS[grouping], strict=True)
    }


def batch(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    rows = {"query_user": 30, "item": 20, "candidate_user": 30, "ctx": 9}
    return {f: torch.randint(0, n, (4, 3), generator=g) for f, n in rows.items()}


@pytest.mark.parametrize("sparse", [False, True])
@pytest.mark.parametrize("grouping", WIDTHS)
def test_a_table_serves_its_features_as_one_bag_per_feature_over_its_rows(grouping, sparse) -> None:
    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(tables(grouping), sparse=sparse)
    assert ebc.feature_tables == {"query_user": "user", "candidate_user": "user", "item": "item", "ctx": "ctx"}
    assert list(ebc.state_dict()) == [f"embedding_bags.{t}.weight" for t in ROWS]  # checkpoints stay by table
    plain = {
        t: nn.EmbeddingBag.from_pretrained(b.weight.to_tensor().clone(), freeze=False, mode="sum")
        for t, b in ebc.embedding_bags.items()
    }
    ids = batch()
    weights = {"candidate_user": torch.rand(4, 3)}  # one feature of the table weighted, the other not
    with torch.profiler.profile() as prof:
        out = ebc(ids, per_sample_weights=weights)
    lookups = ("aten::_embedding_bag", "aten::_embedding_bag_forward_only")  # a sparse table's forward: the latter
    kernels = sum(e.count for e in prof.key_averages() if e.key in lookups)
    # A table's two features: one lookup of its rows (a sparse group looks each table up in its own
    # kernel over its rows, nothing shifted or joined; a dense group packs them into one).
    assert kernels == (1 if grouping == "grouped" and not sparse else 3)
    assert list(out) == list(ids)  # keyed by feature, in the input's order
    for f, x in ids.items():
        table = ebc.feature_tables[f]
        psw = weights.get(f)
        want = plain[table](x, per_sample_weights=psw)
        torch.testing.assert_close(out[f], want, atol=1e-6, rtol=0)
    sum((v * (i + 1)).sum() for i, v in enumerate(out.values())).backward()
    for i, (f, x) in enumerate(ids.items()):
        bags = plain[ebc.feature_tables[f]](x, per_sample_weights=weights.get(f))
        (bags * (i + 1)).sum().backward()
    for t, bag in ebc.embedding_bags.items():
        grads = [p.grad.to_dense() if sparse else p.grad for p in bag.weight.variables]
        got = shardvar.ShardedVariable(grads, partition_strategy=bag.layout.strategy).to_tensor()
        torch.testing.assert_close(got, plain[t].weight.grad, atol=1e-5, rtol=0)


def test_features_of_a_moved_table_are_looked_up_in_one_call_of_its_own() -> None:
    ebc = EmbeddingBagCollection(tables("grouped"))
    want = ebc(batch(1))
    ebc.embedding_bags["user"].double().float()  # new memory for one table: looked up by its own forward
    calls = []
    hook = ebc.embedding_bags["user"].register_forward_hook(lambda *a: calls.append(1))
    got = ebc(batch(1))
    hook.remove()
    assert calls == [1]
    for f in want:
        torch.testing.assert_close(got[f], want[f], atol=1e-6, rtol=0)


def test_a_keyed_jagged_batch_is_keyed_by_feature() -> None:
    ebc = EmbeddingBagCollection(tables("grouped"))
    jagged = KeyedJagged(("candidate_user", "query_user"), torch.tensor([1, 2, 3, 1, 2, 3]), torch.tensor([[3], [3]]))
    out = ebc(jagged)
    assert list(out) == ["candidate_user", "query_user"] and torch.equal(out["candidate_user"], out["query_user"])


@pytest.mark.parametrize(
    ("make", "error", "match"),
    [
        (lambda: TableConfig(5, 2, feature_names=()), ValueError, "feature_names is empty"),
        (lambda: TableConfig(5, 2, feature_names="user"), TypeError, "feature_names must be a tuple or list"),
        (lambda: TableConfig(5, 2, feature_names=("a", 3)), TypeError, r"got 3 \(int\) at 1"),
        (lambda: TableConfig(5, 2, feature_names=("a", "a")), ValueError, "'a' is given 2 times"),
        (  # feature "u" of both tables is output as "u@v", the name of another feature
            lambda: EmbeddingBagCollection(
                {"u": TableConfig(5, 2), "v": TableConfig(5, 2, feature_names=["u", "u@v"])}
            ),
            ValueError,
            "feature 'u' of table 'v' and feature 'u@v' of table 'v' are both output as 'u@v'",
        ),
        (
            lambda: EmbeddingBagCollection(tables("grouped"))({"user": torch.tensor([[1]])}),
            ValueError,
            "no feature named",
        ),
    ],
)
def test_bad_feature_names_are_refused(make, error, match) -> None:
    with pytest.raises(error, match=match):
        make()
