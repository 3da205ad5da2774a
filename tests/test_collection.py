"""EmbeddingBagCollection against separate nn.EmbeddingBag tables: outputs, gradients, checkpoints, kernels."""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import shardvar
from shardvar import EmbeddingBagCollection, KeyedJagged, TableConfig

WIDTHS = {"grouped": (4, 4, 4, 4), "apart": (3, 4, 6, 5)}  # one kernel for all tables, or one per table
CONFIGS = {
    "user": TableConfig(40, 4, 3, "mod"),
    "item": TableConfig(25, 4, 2, "div"),
    "query": TableConfig(17, 6, 1),
    "city": TableConfig(9, 4, 4, "div"),
}


@pytest.fixture(params=list(WIDTHS))
def grouping(request: pytest.FixtureRequest) -> str:
    """Every collection behaviour runs with tables that share one kernel and with tables that do not."""
    return request.param


def configs(grouping: str, mode: str = "sum") -> dict[str, TableConfig]:
    return {
        k: TableConfig(c.num_embeddings, width, c.partitioner, c.partition_strategy, mode)
        for (k, c), width in zip(CONFIGS.items(), WIDTHS[grouping], strict=True)
    }


def twins(
    mode: str = "sum", sparse: bool = False, grouping: str = "grouped"
) -> tuple[EmbeddingBagCollection, dict[str, nn.EmbeddingBag]]:
    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(configs(grouping, mode), sparse=sparse)
    assert len(ebc._groups) == (1 if grouping == "grouped" else len(CONFIGS))
    plain = {}
    for name, bag in ebc.embedding_bags.items():
        plain[name] = nn.EmbeddingBag(bag.num_embeddings, bag.embedding_dim, mode=mode, sparse=sparse)
        plain[name].load_state_dict(bag.state_dict())
    return ebc, plain


def features(seed: int = 1) -> tuple[dict, dict]:
    g = torch.Generator().manual_seed(seed)
    ids, offsets = {}, {}
    for name, cfg in CONFIGS.items():
        n = int(torch.randint(3, 12, (1,), generator=g))
        ids[name] = torch.randint(0, cfg.num_embeddings, (n,), generator=g)
        offsets[name] = torch.tensor([0, 1, n // 2])
    return ids, offsets


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
@pytest.mark.parametrize("sparse", [False, True])
def test_outputs_and_gradients_equal_separate_embedding_bags(mode, sparse, grouping) -> None:
    if mode == "max" and sparse:
        with pytest.raises(ValueError, match="mode 'max' has no sparse gradient"):
            twins(mode, sparse, grouping)
        return
    ebc, plain = twins(mode, sparse, grouping)
    ids, offsets = features()
    out = ebc(ids, offsets)
    assert list(out) == list(ids)
    loss = sum((v * torch.arange(v.numel()).reshape(v.shape)).sum() for v in out.values())
    loss.backward()
    for name, bag in plain.items():
        want = bag(ids[name], offsets[name])
        torch.testing.assert_close(out[name], want, atol=1e-6, rtol=0)
        (want * torch.arange(want.numel()).reshape(want.shape)).sum().backward()
        got = shardvar.ShardedVariable(
            [p.grad.to_dense() if sparse else p.grad for p in ebc.embedding_bags[name].weight.variables],
            partition_strategy=ebc.embedding_bags[name].layout.strategy,
        ).to_tensor()
        grad = bag.weight.grad.to_dense() if sparse else bag.weight.grad
        torch.testing.assert_close(got, grad, atol=1e-6, rtol=0)


def test_weights_two_d_ids_jagged_input_and_concat(grouping) -> None:
    ebc, plain = twins("sum", grouping=grouping)
    g = torch.Generator().manual_seed(3)
    keys = ("user", "item", "city")
    lengths = torch.tensor([[2, 0, 3], [1, 1, 1], [4, 2, 0]])
    values = torch.cat(
        [
            torch.randint(0, CONFIGS[k].num_embeddings, (int(n),), generator=g)
            for k, n in zip(keys, lengths.sum(1), strict=True)
        ]
    )
    weights = torch.rand(values.numel(), generator=g)
    out = ebc(KeyedJagged(keys, values, lengths, weights))
    ids, offsets, psw = KeyedJagged(keys, values, lengths, weights).split()
    for k in keys:
        torch.testing.assert_close(out[k], plain[k](ids[k], offsets[k], per_sample_weights=psw[k]), atol=1e-6, rtol=0)
    two_d = {"user": torch.tensor([[1, 2], [3, 39]]), "query": torch.tensor([[0, 16], [5, 5]])}
    out = ebc(two_d)
    torch.testing.assert_close(out["query"], plain["query"](two_d["query"]), atol=1e-6, rtol=0)
    assert EmbeddingBagCollection.concat(out).shape == (2, plain["user"].embedding_dim + plain["query"].embedding_dim)


def test_weights_for_some_features_weight_those_and_the_rest_pool_unweighted(grouping) -> None:
    ebc, plain = twins("sum", grouping=grouping)
    ids, offsets = features()
    weights = {k: torch.rand(ids[k].numel()) for k in ("user", "query")}
    out = ebc(ids, offsets, weights)
    for k in CONFIGS:
        want = plain[k](ids[k], offsets[k], per_sample_weights=weights.get(k))
        torch.testing.assert_close(out[k], want, atol=1e-6, rtol=0)
    some = ("item", "city")
    out = ebc({k: ids[k] for k in some}, {k: offsets[k] for k in some}, {"city": torch.rand(ids["city"].numel())})
    want = plain["item"](ids["item"], offsets["item"])  # the group's other feature, unweighted
    torch.testing.assert_close(out["item"], want, atol=1e-6, rtol=0)


def test_one_kernel_per_group_whatever_the_number_of_tables() -> None:
    counts = []
    for n in (2, 26):
        ebc = EmbeddingBagCollection(
            {f"t{i}": TableConfig(50 + i, 8, 1 + i % 4, "mod" if i % 2 else "div") for i in range(n)}
        )
        ids = {f"t{i}": torch.randint(0, 50, (4, 3)) for i in range(n)}
        with torch.profiler.profile() as prof:
            ebc(ids)
        counts.append(sum(e.count for e in prof.key_averages() if e.key == "aten::_embedding_bag"))
    assert counts == [1, 1]


def test_checkpoints_restore_into_plain_bags_and_other_layouts_with_optimizer_state(tmp_path, grouping) -> None:
    ebc, plain = twins("sum", grouping=grouping)
    opt = torch.optim.Adam(ebc.parameters(), lr=0.05)
    ids, offsets = features()
    sum(v.sum() for v in ebc(ids, offsets).values()).backward()
    opt.step()
    shardvar.save({"model": ebc, "opt": opt}, tmp_path)
    stock = nn.ModuleDict({"embedding_bags": nn.ModuleDict({k: copy.deepcopy(v) for k, v in plain.items()})})
    shardvar.load({"model": stock}, tmp_path)
    other_configs = {k: TableConfig(c.num_embeddings, c.embedding_dim, 2, "mod") for k, c in configs(grouping).items()}
    other = EmbeddingBagCollection(other_configs)
    other_opt = torch.optim.Adam(other.parameters(), lr=0.05)
    shardvar.load({"model": other, "opt": other_opt}, tmp_path)
    for name in CONFIGS:
        want = ebc.embedding_bags[name].weight.to_tensor()
        assert torch.equal(stock["embedding_bags"][name].weight, want)
        assert torch.equal(other.embedding_bags[name].weight.to_tensor(), want)
    torch.testing.assert_close(other(ids, offsets)["user"], ebc(ids, offsets)["user"], atol=0, rtol=0)
    assert list(ebc.state_dict()) == [f"embedding_bags.{k}.weight" for k in CONFIGS]


def test_each_table_is_held_once_in_its_groups_allocation(grouping) -> None:
    ebc = EmbeddingBagCollection(configs(grouping))  # as built: nothing has looked at the tables yet
    for names, variable in ebc._groups:
        group = variable.store.full_slab.untyped_storage().data_ptr()
        for n in names:  # no table's store keeps the allocation it was built in
            slabs = [g.slab for g in ebc.embedding_bags[n]._store.groups]  # not .store, which refreshes
            assert all(slab is not None and slab.untyped_storage().data_ptr() == group for slab in slabs)


def test_tables_moved_apart_are_looked_up_one_by_one(grouping) -> None:
    ebc, plain = twins("mean", grouping=grouping)
    ebc.embedding_bags["user"].double().float()  # new memory for one table: the group's slab is gone
    ids, offsets = features()
    out = ebc(ids, offsets)
    torch.testing.assert_close(out["item"], plain["item"](ids["item"], offsets["item"]), atol=1e-6, rtol=0)


@pytest.mark.parametrize("collection", [EmbeddingBagCollection, shardvar.EmbeddingCollection, "list"])
def test_a_collection_moved_whole_keeps_one_allocation_per_group(collection) -> None:
    # module.to() gives each shard memory of its own; the collection groups its tables again, at
    # once: an optimizer made next holds the shards' memory, which no lookup could move then.
    cfgs = {f"t{i}": TableConfig(40 + i, 8, 1 + i % 3, "mod" if i % 2 else "div") for i in range(4)}
    if collection == "list":
        module = shardvar.nn.EmbeddingBagList(
            [shardvar.ShardedEmbeddingBag(40 + i, 8, 2, mode="sum") for i in range(4)]
        )
        ids = [torch.randint(0, 40, (5, 3)) for _ in range(4)]
    else:
        module = collection(cfgs, sparse=True)
        ids = {k: torch.randint(0, 40, (5, 3)) for k in cfgs}
    want = module(ids)
    module.double()
    shardvar.optim.fuse(shardvar.optim.RowWiseAdagrad(module, lr=0.1))  # made before any lookup regroups
    groups = module._grouped() if collection == "list" else module._groups
    assert len(groups) == 1 and groups[0][1].store.full_slab.dtype == torch.float64
    slab = groups[0][1].store.full_slab.untyped_storage().data_ptr()
    assert all(p.untyped_storage().data_ptr() == slab for p in module.parameters())
    got = module(ids)
    for k in cfgs if collection != "list" else range(4):
        a, b = (got[k], want[k]) if collection != shardvar.EmbeddingCollection else (got[k].values, want[k].values)
        torch.testing.assert_close(a, b.double())


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda e: e({"nope": torch.tensor([[1]])}), ValueError, "no feature named"),
        (lambda e: e({"item": torch.tensor([[25]])}), IndexError, "25"),  # valid in the slab, not in the table
        (lambda e: e({"item": torch.tensor([1, 2])}, {"item": torch.tensor([0, 5])}), ValueError, "feature 'item'"),
        (lambda e: e({"item": torch.tensor([1, 2])}), ValueError, "feature 'item'"),
        (lambda e: e({"item": torch.tensor([[1]])}, per_sample_weights={"user": torch.ones(1)}), ValueError, "no ids"),
        (lambda e: e({"item": torch.tensor([[1]])}, offsets={"city": torch.tensor([0])}), ValueError, "no ids"),
        (
            lambda e: e({"item": torch.tensor([[1]])}, per_sample_weights={"item": torch.ones(2)}),
            ValueError,
            r"shape \[2\] must",
        ),
        (lambda e: e({"item": torch.tensor([[1]])}, offsets=[0]), TypeError, "offsets must be a dict"),
        (lambda e: e([1, 2]), TypeError, "features must be a dict"),
        (lambda e: EmbeddingBagCollection({"a": (10, 4)}), TypeError, "must be a TableConfig"),
        (lambda e: EmbeddingBagCollection({"a": TableConfig(10, 4, mode="median")}), ValueError, "mode"),
        (lambda e: e(KeyedJagged(("user",), torch.tensor([1, 2]), torch.tensor([[1, 2]]))), ValueError, "add up to 3"),
    ],
)
def test_bad_input_is_refused_with_clear_errors(call, error, match, grouping) -> None:
    ebc, _ = twins("sum", grouping=grouping)
    with pytest.raises(error, match=match):
        call(ebc)


def test_weights_for_a_mean_table_are_refused_whatever_the_grouping(grouping) -> None:
    ebc, _ = twins("mean", grouping=grouping)
    ids, offsets = features()
    with pytest.raises(ValueError, match=r"per_sample_weights go with mode 'sum'.*feature 'item' has mode 'mean'"):
        ebc(ids, offsets, {"item": torch.ones(ids["item"].numel())})


@settings(max_examples=20, deadline=None)
@given(
    sizes=st.lists(
        st.tuples(st.integers(1, 30), st.integers(1, 4), st.sampled_from(["div", "mod"])), min_size=1, max_size=5
    ),
    seed=st.integers(0, 100),
    grouped=st.booleans(),
)
def test_any_tables_and_layouts_equal_separate_bags(sizes, seed, grouped) -> None:
    configs = {
        f"t{i}": TableConfig(rows, 3 if grouped else 3 + i, shards, strategy)
        for i, (rows, shards, strategy) in enumerate(sizes)
    }
    ebc = EmbeddingBagCollection(configs)
    g = torch.Generator().manual_seed(seed)
    ids = {k: torch.randint(0, c.num_embeddings, (3, 2), generator=g) for k, c in configs.items()}
    out = ebc(ids)
    for k in configs:
        bag = nn.EmbeddingBag(configs[k].num_embeddings, configs[k].embedding_dim, mode="sum")
        bag.load_state_dict(ebc.embedding_bags[k].state_dict())
        torch.testing.assert_close(out[k], bag(ids[k]), atol=1e-6, rtol=0)
